"""`python -m mlkv_torch.train CONFIG [dotted.key=value ...] [--resume | --overwrite]`."""
import os
import sys

from ..ranks import exit_without_finalizing
from .cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank: gloo's threads may outlive the group
    exit_without_finalizing(code)
sys.exit(code)
