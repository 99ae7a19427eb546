"""Restarts by TorchElastic (`torchrun --max-restarts N`): when a rank dies, torchrun stops every
worker and starts them all again, with TORCHELASTIC_RESTART_COUNT one higher and the job's
TORCHELASTIC_RUN_ID unchanged. A restarted worker goes on from the job's last checkpoint by
itself (as `--resume` would), or starts over when the job died before its first one.

Only this job's own output is continued or dropped: the first attempt records the job's run id in
output_dir once its tables exist (`record_job`), and a restart acts only where that record names
its job. A first attempt refused for an earlier run's tables (a config error, which torchrun
restarts too) recorded nothing, so its restarts are refused in the same words.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from ..config import ExperimentConfig
from ..cut import write_json_record

JOB_RECORD = "elastic_job.json"  # in output_dir: {"run_id": TORCHELASTIC_RUN_ID of the job that made it}

__all__ = ["JOB_RECORD", "record_job", "restart_of_this_job", "drop_failed_attempt"]


def _run_id() -> Optional[str]:
    return os.environ.get("TORCHELASTIC_RUN_ID")


def record_job(config: ExperimentConfig) -> None:
    """On rank 0, once the run's tables exist: output_dir belongs to this job (if torchrun started it)."""
    if _run_id() is not None:
        write_json_record(os.path.join(config.output_dir, JOB_RECORD), {"run_id": _run_id()})


def restart_of_this_job(config: ExperimentConfig, distributed: bool) -> bool:
    """Whether this worker is a TorchElastic restart of the job whose run output_dir holds. Under
    torchrun every rank answers alike: a node that joins the job again (`--nnodes MIN:MAX`) starts
    its workers as a first attempt (TORCHELASTIC_RESTART_COUNT 0) where the others count restarts."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if distributed:
        from ..ranks import all_gather_objects

        restarted = any(all_gather_objects(restarted))
    if not restarted or _run_id() is None:
        return False
    try:
        with open(os.path.join(config.output_dir, JOB_RECORD)) as f:
            return json.load(f).get("run_id") == _run_id()
    except (OSError, ValueError, AttributeError):
        return False


def drop_failed_attempt(config: ExperimentConfig, rank: Optional[int]) -> None:
    """Before starting over (the job died before its first checkpoint): this rank's tables of the
    failed attempt go (one process, `rank` None: every table there); rank 0 also drops its metrics."""
    from ..table_files import remove_tables
    from ..torchrec.kernel import rank_storage_dir

    if rank is None:
        remove_tables(config.tables_path)
    else:
        shutil.rmtree(rank_storage_dir(config.tables_path, rank), ignore_errors=True)
    if not rank:
        for name in ("metrics.jsonl", "summary.json"):
            try:
                os.remove(os.path.join(config.output_dir, name))
            except FileNotFoundError:
                pass
