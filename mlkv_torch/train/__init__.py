"""Trains and evaluates DLRM from a YAML experiment.

    python -m mlkv_torch.train CONFIG [dotted.key=value ...] [--resume | --overwrite]
    torchrun --nproc_per_node N -m mlkv_torch.train CONFIG ...   # DistributedModelParallel: gloo, or NCCL on GPUs

Writes to ``output_dir``: ``metrics.jsonl`` (a line every ``train.log_every`` steps and at
each evaluation), ``summary.json`` at the end (samples_per_s, auc, logloss, steps,
peak_rss_bytes, disk_bytes, ...), and checkpoints every ``train.checkpoint_every`` steps
(``--resume`` continues from the latest). A second run on an output_dir that holds an earlier
run's tables is refused unless it says ``--resume`` or ``--overwrite`` (start over: the earlier
run's tables, checkpoints and metrics removed). A progress bar shows samples/s, loss and the disk
tables' hit rate.
"""
from .cli import main
from .placement import RUNNER_BACKEND
from .experiment import Experiment, torch_threads
from .loop import run

__all__ = ["Experiment", "RUNNER_BACKEND", "main", "run", "torch_threads"]
