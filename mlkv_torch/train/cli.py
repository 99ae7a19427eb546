"""`python -m mlkv_torch.train`: the runner's command line, in one process or under torchrun."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from ..config import ConfigError, ExperimentConfig, load_config
from . import checkpoints, elastic, outputs
from .quiet import quiet_known_warnings
from .loop import run
from .placement import forget_runner_group, join_process_group, make_runner_group, runner_group, this_process_placement


def _leave_process_group(quiesce: bool) -> None:
    """Leaves the process group; after a finished run (`quiesce`), once no gloo worker thread still
    holds a tensor made in Python.

    A worker lets go of a finished collective a moment after the rank resumed; if the interpreter
    is already exiting by then, freeing its tensors needs the GIL and the process aborts
    ("terminate called without an active exception", see ranks.py). Collecting first frees what
    the run left, and a barrier (which holds no tensors) runs after every earlier collective. A
    failed rank leaves at once: a barrier would wait for ranks still in their steps.
    """
    try:
        if quiesce:
            gc.collect()
            dist.barrier()  # the model's group
            dist.barrier(group=runner_group())
    finally:
        dist.destroy_process_group()
        forget_runner_group()


def _refuse_an_earlier_run(config: ExperimentConfig, distributed: bool) -> None:
    """A run over what an earlier one left (of any world size: its tables may lie in another
    layout than this run's, where opening them would not collide) is refused in one line. Under
    torchrun rank 0 looks and every rank answers alike."""
    found = outputs.earlier_run(config) if not distributed or dist.get_rank() == 0 else []
    if distributed:
        from ..ranks import all_gather_objects

        found = all_gather_objects(found)[0]
    if found:
        raise ConfigError(f"output_dir {config.output_dir!r} holds an earlier run ({', '.join(found)}): continue it "
                          f"with --resume, or start over with --overwrite")


def main(argv: Optional[Sequence[str]] = None) -> int:
    description = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package docstring's first paragraph
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.train", description=description)
    parser.add_argument("config", help="the experiment's YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=200")
    again = parser.add_mutually_exclusive_group()  # what to do with a run output_dir already holds
    again.add_argument("--resume", action="store_true", help="continue from output_dir's latest checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="start over: remove the tables, checkpoints and metrics an earlier run left first")
    parser.add_argument("--import", dest="imported", metavar="EXPORT",
                        help="start from an export's tables and dense model (python -m mlkv_torch.export), at its "
                             "step, under this run's own plan and number of processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_intermixed_args(argv)  # overrides and options in any order
    if args.resume and args.imported:
        parser.error("--resume continues output_dir's own checkpoint, --import starts from an export: choose one")
    quiet_known_warnings()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun
    try:
        placement = this_process_placement(config.device, distributed)
    except ConfigError as e:  # before any rank joins: every rank refuses alike
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if distributed:
        join_process_group(placement)
        make_runner_group()
    resume, overwrite, imported = args.resume, args.overwrite, args.imported
    # A restart may have another world than the attempt before (nodes gone or back): one process
    # (a world of 1) continues a checkpoint of ranks, and ranks one of a process.
    restarted = "TORCHELASTIC_RUN_ID" in os.environ and not resume and elastic.restart_of_this_job(config, distributed)
    if restarted:
        overwrite = False  # this job's own tables and checkpoints: continued or dropped below
        resume = any(os.path.exists(os.path.join(config.output_dir, name))
                     for name in (checkpoints.SHARDED_CHECKPOINT_POINTER, checkpoints.ONE_PROCESS_CHECKPOINT))
        imported = None if resume else imported  # an import checkpoints at once: a restart continues that
        if not resume:
            elastic.drop_failed_attempt(config, dist.get_rank() if distributed else None)
        if not distributed or dist.get_rank() == 0:
            print(f"[train] restarted by torchrun (restart {os.environ['TORCHELASTIC_RESTART_COUNT']}): "
                  f"{'resuming from the last checkpoint' if resume else 'no checkpoint yet, starting over'}",
                  file=sys.stderr, flush=True)
    finished = False
    try:
        if not (resume or overwrite or restarted):
            _refuse_an_earlier_run(config, distributed)
        summary = run(config, resume=resume, progress=not args.no_progress, overwrite=overwrite, imported=imported)
        finished = True
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            _leave_process_group(quiesce=finished)
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 0
