"""The disk tables a directory holds, as files: finding them and removing them (a second run of a
script that starts over). A table's directory is the one holding its TABLE.json; a collection's
tables may lie in its ranks' directories (rank<r>/, under torchrun) beside their cut (CUT.json)."""
from __future__ import annotations

import os
import re
import shutil
from typing import List

from .cut import CUT_RECORD, remove_cut
from .disk_table import TABLE_RECORD

__all__ = ["remove_tables", "table_directories"]

_RANK_DIRECTORY = re.compile(r"rank[0-9]+")


def table_directories(path: str) -> List[str]:
    """The directories under `path` that hold a table (its TABLE.json), directly or in a rank's
    directory."""
    return [os.path.join(parent, n) for parent in _table_parents(path) for n in _names(parent)
            if os.path.isfile(os.path.join(parent, n, TABLE_RECORD))]


def remove_tables(path: str) -> int:
    """Removes the tables under `path` (their rows, optimizer state and cut), so tables opened there
    next start from their initial rows; returns how many tables and cuts went. Anything else under
    `path` stays; so does `path`, and a rank's directory where something else is left in it."""
    removed = 0
    for table in table_directories(path):
        shutil.rmtree(table)
        removed += 1
    parents = _table_parents(path)
    for parent in parents:
        removed += os.path.isfile(os.path.join(parent, CUT_RECORD))
        remove_cut(parent)  # the cut of the tables gone
    for rank_directory in parents[1:]:
        try:
            os.rmdir(rank_directory)  # only where nothing else is left
        except OSError:
            pass
    return removed


def _table_parents(path: str) -> List[str]:
    """`path` and its ranks' directories: where tables and their collections' cuts lie."""
    return [path] + [os.path.join(path, n) for n in _names(path) if _RANK_DIRECTORY.fullmatch(n)]


def _names(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
