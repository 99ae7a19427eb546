"""Cuts: one consistent state of a set of disk tables, recorded where their owner keeps it.

A cut is taken at a step boundary: every table's cache is written back, every table's store
checkpoints (its rows and optimizer state), and one record names each table's store checkpoint
and optimizer step. Writing that record (atomically, ``CUT.json``) commits the cut, and then each
store is told so (`KVStore.commit_checkpoint`). A store keeps the checkpoint last committed beside
its latest, so a crash half-way through a cut (some stores at the new checkpoint, the record still
naming the old), or a cut that failed and the ones after it, reopens every table at the committed
cut; and a table store moves only at cuts (automatic compaction takes no checkpoint), so it can
never reopen past one. The runner's checkpoint holds the record of its cut beside the
dense model and optimizer, and commits both at once.

The record, as JSON: ``{"label": <int or null>, "tables": {<table>: {"checkpoint": <int or null>,
"step": <int>}}}``; ``checkpoint`` is the KVStore's checkpoint number (null for RocksDB, which
keeps only its latest state).
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

CUT_RECORD = "CUT.json"

__all__ = ["CUT_RECORD", "CutPart", "PendingCut", "read_cut", "write_cut", "remove_cut", "check_cut"]


def check_cut(record: Any, where: str) -> Dict[str, Any]:
    """`record` if it is a well-formed cut record; ValueError naming `where` otherwise."""
    ok = isinstance(record, dict) and isinstance(record.get("tables"), dict) and (
        record.get("label") is None or isinstance(record.get("label"), int))
    if ok:
        for entry in record["tables"].values():
            checkpoint, step = (entry.get("checkpoint", -1),
                                entry.get("step")) if isinstance(entry, dict) else (-1, None)
            if not (checkpoint is None or (isinstance(checkpoint, int) and checkpoint > 0)) \
                    or not isinstance(step, int) or step < 0:
                ok = False
    if not ok:
        raise ValueError(f"{where} is not a cut record of mlkv_torch tables: got {record!r}")
    return record


def read_json_record(path: str, what: str) -> Any:
    """The JSON a table's directory records at `path`, or None when there is none; ValueError names
    a record that is unreadable or corrupted and says `what` it records."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable or corrupted ({e}); it records {what}") from e


def write_json_record(path: str, record: Any) -> None:
    """Writes `record` to `path` whole or not at all (a crash never leaves half of it), durably."""
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    sync_directory(os.path.dirname(path) or ".")  # the rename itself


def sync_directory(path: str) -> None:
    """Makes a rename in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_cut(directory: str) -> Optional[Dict[str, Any]]:
    """The cut recorded in `directory`, or None when none is; ValueError names a corrupted record."""
    path = os.path.join(directory, CUT_RECORD)
    record = read_json_record(path, "the checkpoint each table reopens at")
    return None if record is None else check_cut(record, path)


def write_cut(directory: str, record: Dict[str, Any]) -> None:
    """Commits `record` in `directory`: whole or not at all, durable when this returns."""
    write_json_record(os.path.join(directory, CUT_RECORD), check_cut(record, "the cut to record"))


def remove_cut(directory: str) -> None:
    """Forgets the cut recorded in `directory` (its tables were destroyed)."""
    for name in (CUT_RECORD, CUT_RECORD + ".tmp"):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


class CutPart(NamedTuple):
    """One kernel's part of a cut (`DiskTableBatch.begin_checkpoint`): `finish` waits for it to be
    written and returns its tables' entries, by table name; `commit`, called once a record naming
    them is written, tells their stores the cut is committed."""
    finish: Callable[[], Dict[str, Any]]
    commit: Callable[[], None]


class PendingCut:
    """A cut begun at a step boundary and being written while training goes on: `wait` waits for
    every part, commits the record in `directory` (and tells the parts' stores), and returns it.
    Until it returns, the committed cut is the one before. If writing fails (a full disk), `wait`
    raises, and raises the same again: this cut is not committed and the one before stays; a later
    cut writes what this one could not first."""

    def __init__(self, directory: str, label: Optional[int], parts: List[CutPart]) -> None:
        self.directory, self.label = directory, label
        self._parts = parts
        self._record: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._commit_deferred = False
        self._committed = False
        self._waiting = threading.Lock()  # a close may wait while the training checkpoint's thread does

    def defer_commit(self) -> "PendingCut":
        """The stores are told the cut is committed only by `commit()`, which the caller calls once
        its own record naming the cut (a training checkpoint) is durable; `wait()`, a close's
        included, does not tell them. Until then every store keeps the cut before beside this one,
        so a close before that record is written leaves the cut it names recoverable."""
        self._commit_deferred = True
        return self

    @property
    def done(self) -> bool:
        """`wait` would return (or raise) at once."""
        return self._record is not None or self._error is not None

    def wait(self) -> Dict[str, Any]:
        with self._waiting:
            if self._error is not None:
                raise self._error
            if self._record is None:
                tables: Dict[str, Any] = {}
                try:
                    for part in self._parts:
                        tables.update(part.finish())
                    recorded = read_cut(self.directory)
                    if self.label is None and recorded is not None and recorded["tables"] == tables:
                        # nothing changed since that cut (closing after one): it stands, label and all
                        record = recorded
                    else:
                        os.makedirs(self.directory, exist_ok=True)
                        record = {"label": self.label, "tables": tables}
                        write_cut(self.directory, record)
                except BaseException as e:
                    self._error = e
                    raise
                self._record = record
        if not self._commit_deferred:
            self.commit()
        return self._record

    def commit(self) -> None:
        """Tells every part's stores the cut is committed (once; after `wait`)."""
        with self._waiting:
            if self._record is None:
                raise RuntimeError(f"the cut {self.label!r} is not written yet: wait() for it first")
            if not self._committed:
                for part in self._parts:
                    part.commit()
                self._committed = True
