"""What a run of the runner leaves behind, and starting over (`--overwrite`): the disk tables it
made (under `storage.path`, else output_dir/tables), its checkpoints, metrics and summary. Only
those go: a `storage.path` or output_dir the user shares with other files keeps them."""
from __future__ import annotations

import os
import re
import shutil
from typing import List

from ..config import ExperimentConfig
from ..table_files import remove_tables, table_directories
from . import checkpoints, elastic
from .reshard import GENERATION

# Not .process_group: a one-process run's own process group may be using it (run() renews it).
_RUN_FILES = ("metrics.jsonl", "summary.json", elastic.JOB_RECORD, checkpoints.ONE_PROCESS_CHECKPOINT,
              checkpoints.SHARDED_CHECKPOINT_POINTER)
_RUN_DIRECTORIES = re.compile(rf"tensorboard|{checkpoints.CHECKPOINT_DIRECTORY.pattern}")


def checkpoints_and_metrics(config: ExperimentConfig) -> List[str]:
    """The names in output_dir that a run wrote besides its tables."""
    return [n for n in _names(config.output_dir) if n in _RUN_FILES or _RUN_DIRECTORIES.fullmatch(n)]


def earlier_run(config: ExperimentConfig) -> List[str]:
    """What output_dir and the tables' path hold of an earlier run (its summary, metrics,
    checkpoints and tables, in any world's layout), named; empty when nothing. A torchrun job's
    record and a TensorBoard log alone are not a run to continue."""
    found = [n for n in checkpoints_and_metrics(config) if n not in (elastic.JOB_RECORD, "tensorboard")]
    tables = len(table_directories(config.tables_path))
    return found + ([f"{tables} table{'s' if tables > 1 else ''}"] if tables else [])


def _names(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove_earlier_run(config: ExperimentConfig) -> int:
    """Removes what an earlier run left (its tables, checkpoints, metrics, summary); returns how
    many tables, cuts, files and directories went. The default tables directory goes once empty;
    anything else there stays."""
    removed = remove_tables(config.tables_path)
    for name in _names(config.tables_path):  # the directories reshards filled
        if GENERATION.fullmatch(name):
            shutil.rmtree(os.path.join(config.tables_path, name))
            removed += 1
    for name in checkpoints_and_metrics(config):
        path = os.path.join(config.output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        removed += 1
    if config.storage.path is None:
        try:
            os.rmdir(config.tables_path)  # only where nothing else is left
        except OSError:
            pass
    return removed
