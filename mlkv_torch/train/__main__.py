"""`python -m mlkv_torch.train CONFIG [dotted.key=value ...] [--resume]`."""
import sys

from .cli import main

sys.exit(main())
