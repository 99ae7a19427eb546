"""What a run of the runner leaves behind, and starting over (`--overwrite`): the disk tables it
made (under `storage.path`, else output_dir/tables), its checkpoints, metrics and summary. Only
those go: a `storage.path` or output_dir the user shares with other files keeps them."""
from __future__ import annotations

import os
import re
import shutil
from typing import List

from ..config import ExperimentConfig
from ..cut import CUT_RECORD, remove_cut
from ..disk_table import TABLE_RECORD
from . import checkpoints, elastic

_RUN_FILES = ("metrics.jsonl", "summary.json", ".process_group", elastic.JOB_RECORD,
              checkpoints.ONE_PROCESS_CHECKPOINT, checkpoints.SHARDED_CHECKPOINT_POINTER)
_RUN_DIRECTORIES = re.compile(rf"tensorboard|{checkpoints.CHECKPOINT_DIRECTORY.pattern}")
_RANK_DIRECTORY = re.compile(r"rank[0-9]+")  # a rank's shards under torchrun


def table_directories(tables_path: str) -> List[str]:
    """The directories under `tables_path` that hold a table (its TABLE.json), directly or in a
    rank's directory."""
    return [os.path.join(parent, n) for parent in _table_parents(tables_path) for n in _names(parent)
            if os.path.isfile(os.path.join(parent, n, TABLE_RECORD))]


def _table_parents(tables_path: str) -> List[str]:
    """`tables_path` and its ranks' directories: where tables and their collections' cuts lie."""
    return [tables_path] + [os.path.join(tables_path, n) for n in _names(tables_path) if _RANK_DIRECTORY.fullmatch(n)]


def checkpoints_and_metrics(config: ExperimentConfig) -> List[str]:
    """The names in output_dir that a run wrote besides its tables."""
    return [n for n in _names(config.output_dir) if n in _RUN_FILES or _RUN_DIRECTORIES.fullmatch(n)]


def remove_earlier_run(config: ExperimentConfig) -> int:
    """Removes what an earlier run left (its tables, checkpoints, metrics, summary); returns how
    many files and directories went. The tables' rank directories go once empty, and the default
    tables directory too; anything else there stays."""
    removed = 0
    for path in table_directories(config.tables_path):
        shutil.rmtree(path)
        removed += 1
    for parent in _table_parents(config.tables_path):
        removed += os.path.isfile(os.path.join(parent, CUT_RECORD))
        remove_cut(parent)  # the cut of the tables gone
    for name in checkpoints_and_metrics(config):
        path = os.path.join(config.output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        removed += 1
    ours = _table_parents(config.tables_path)[1:] + ([config.tables_path] if config.storage.path is None else [])
    for path in ours:
        try:
            os.rmdir(path)  # only where nothing else is left
        except OSError:
            pass
    return removed


def _names(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
