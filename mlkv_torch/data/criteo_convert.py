"""Criteo Kaggle / Terabyte click logs: TSV files converted once into torchrec's npy layout (criteo_npy).

`convert` streams each TSV file (plain or gzip) through pyarrow in blocks, so memory stays bounded
whatever its size; with ``days=N`` one file (Kaggle's ``train.txt``) is split into N consecutive
days as DLRM's preprocessing splits it, each day with its own minimum. A day whose dense values
span more than int32 wraps in the shift exactly as torchrec's does.

Converted once: each input's days live in ``<out_dir>/<stem>-<fingerprint>/``, keyed by the
file's absolute path, size and mtime, the converter's version and the options. An entry is
built in a hidden ``.partial`` sibling and renamed into place after its ``manifest.json`` is
written and everything is fsynced; it is served only while the manifest matches and every file
has its recorded size, else it is converted again. A per-entry ``flock`` makes concurrent
callers (torchrun ranks, parallel experiments) wait for one conversion instead of repeating it.
A new conversion removes the entries it supersedes (same path and options, older contents) and
the partial directories of dead processes.

Bad input is rejected, never skipped (see `criteo_tsv` for the format): CriteoFormatError names
the file and the 1-based line; an empty file is an error (no rows); nothing half-written is
left to be served.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from typing import BinaryIO, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..cut import sync_directory
from .criteo_npy import NPY_PARTS, npy_header
from .criteo_tsv import (CAT_FEATURES, DEFAULT_BLOCK_SIZE, INT_FEATURES, CriteoBlock, CriteoFormatError, count_lines,
                         read_blocks)

__all__ = ["CONVERTER_VERSION", "CriteoConversion", "cache_entry", "convert", "convert_file"]

CONVERTER_VERSION = 1
"""Part of every cache key: raise it when the converter's output changes, so old entries are not served."""

_MANIFEST = "manifest.json"
_PARTIAL = re.compile(r"^\.(?P<entry>.+)\.partial-(?P<host>.+)-(?P<pid>\d+)$")
_DENSE_CHUNK_VALUES = 1 << 20
_PROGRESS_SECONDS = 10.0


@dataclass(frozen=True)
class CriteoConversion:
    """One input's converted days.

    Attributes:
        source: the input's absolute path.
        entry: the cache directory holding the days.
        prefixes: the day prefixes, in order.
        rows: the rows of each day.
        seconds: the time `convert_file` took (the lookup alone when served from the cache).
        converted: False when an earlier conversion was served.
        held_lock: with ``hold=True``, the descriptor of the shared lock that keeps the entry from
            being removed as superseded while it is read; `release` lets it go.
    """

    source: str
    entry: str
    prefixes: List[str]
    rows: List[int]
    seconds: float
    converted: bool
    held_lock: Optional[int] = None

    def release(self) -> None:
        """Lets the entry go (with ``hold=True``; the process's exit does the same)."""
        if self.held_lock is not None:
            os.close(self.held_lock)
            object.__setattr__(self, "held_lock", None)


def convert(tsv_paths: Sequence[str], out_dir: str, days: Optional[int] = None,
            progress: bool = False) -> List[List[str]]:
    """Each input's day prefixes (one per file, or N per file with days=N), converting what is not
    converted yet.

    Args:
        tsv_paths: Criteo TSV files, plain or gzip.
        out_dir: the cache directory (created if missing).
        days: split each file into this many consecutive days (DLRM's split); None: one day per file.
        progress: report conversions on stderr.

    Returns:
        Per input, its day prefixes (``npy_files`` gives their files).

    Raises:
        FileNotFoundError: an input does not exist.
        CriteoFormatError: an input breaks the format (the message names the file and line).
        OSError: `out_dir` cannot be written.

    Example::

        days = convert(["/data/criteo/train.txt"], "/scratch/criteo", days=7)[0]
        dense, sparse, labels = npy_files(days)
    """
    return [convert_file(path, out_dir, days=days, progress=progress).prefixes for path in tsv_paths]


def cache_entry(tsv_path: str, out_dir: str, days: Optional[int] = None) -> str:
    """The directory that holds (or will hold) the file's conversion with these options; its lock
    file is this path plus ``.lock``."""
    return os.path.join(out_dir, _entry_name(_source_fingerprint(tsv_path, days)))


def convert_file(tsv_path: str, out_dir: str, days: Optional[int] = None, progress: bool = False,
                 block_size: int = DEFAULT_BLOCK_SIZE, hold: bool = False) -> CriteoConversion:
    """One input's days, converted unless a valid entry for its current contents exists.

    Args:
        tsv_path: a Criteo TSV file, plain or gzip.
        out_dir: the cache directory (created if missing).
        days: split the file into this many consecutive days; None: one day.
        progress: report the conversion on stderr.
        block_size: bytes of text parsed at a time.
        hold: return holding a shared lock on the entry (`CriteoConversion.release`), so that a
            conversion of a changed input elsewhere does not remove it while it is read.
    """
    if days is not None and days < 1:
        raise ValueError(f"days must be positive, got {days}")
    started = time.perf_counter()
    fingerprint = _source_fingerprint(tsv_path, days)
    name = _entry_name(fingerprint)
    entry = os.path.join(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    # Readers of a valid entry share its lock (a run holds it while it reads); converting takes it alone.
    converted, held = False, None
    while True:
        held = _lock_file(entry + ".lock", fcntl.LOCK_SH)
        manifest = _valid_manifest(entry, fingerprint)
        if manifest is not None:
            if not hold:
                os.close(held)
                held = None
            break
        os.close(held)
        held = None
        # Converting takes the lock alone, without waiting: a process converting it holds it (the
        # shared wait above then waits for it to finish), and one that found the entry valid after
        # a conversion keeps its share for its whole run, so a blocking wait here could be forever.
        exclusive = _try_lock_file(entry + ".lock", fcntl.LOCK_EX)
        if exclusive is None:
            time.sleep(_RETRY_SECONDS)
            continue
        try:
            if _valid_manifest(entry, fingerprint) is None:  # nobody converted it meanwhile
                _convert_entry(fingerprint, out_dir, name, block_size, progress)
                converted = True
                _remove_superseded(out_dir, name, fingerprint)
        finally:
            os.close(exclusive)
    seconds = time.perf_counter() - started
    if progress and converted:
        rows = sum(part["rows"] for part in manifest["parts"])
        print(f"[criteo] {fingerprint['path']}: {rows} rows in {seconds:.1f} s ({rows / seconds:.0f} rows/s) "
              f"-> {entry}", file=sys.stderr, flush=True)
    return CriteoConversion(source=fingerprint["path"], entry=entry, seconds=seconds, converted=converted,
                            prefixes=[os.path.join(entry, part["name"]) for part in manifest["parts"]],
                            rows=[part["rows"] for part in manifest["parts"]], held_lock=held)


def _source_fingerprint(tsv_path: str, days: Optional[int]) -> Dict:
    source = os.path.abspath(tsv_path)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"Criteo TSV file {tsv_path!r} does not exist or is not a file")
    stat = os.stat(source)
    return {"path": source, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter_version": CONVERTER_VERSION, "days": days}


def _entry_name(fingerprint: Dict) -> str:
    stem = os.path.basename(fingerprint["path"])
    stem = stem[:-3] if stem.endswith(".gz") else stem
    stem = os.path.splitext(stem)[0].lstrip(".") or "criteo"  # a leading dot would hide the entry
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    return f"{stem}-{key}"


def _day_names(fingerprint: Dict) -> List[str]:
    if fingerprint["days"] is None:
        return [_entry_name(fingerprint).rsplit("-", 1)[0]]
    return [f"day_{i}" for i in range(fingerprint["days"])]


def _lock_file(path: str, mode: int) -> int:
    """An open descriptor of `path` (created if missing) holding flock `mode`; retried when the file
    was replaced while waiting (a superseded entry's lock is unlinked by whoever removes the entry)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


_RETRY_SECONDS = 0.05  # between a failed try of the exclusive lock and the next shared check


def _try_lock_file(path: str, mode: int) -> Optional[int]:
    """`_lock_file` without waiting: None when another process holds a conflicting lock."""
    try:
        return _lock_file(path, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return None


def _valid_manifest(entry: str, fingerprint: Dict) -> Optional[Dict]:
    """The entry's manifest if it describes this fingerprint and every file has its recorded size."""
    try:
        with open(os.path.join(entry, _MANIFEST)) as f:
            manifest = json.load(f)
        if manifest.get("source") != fingerprint or len(manifest["parts"]) != len(_day_names(fingerprint)):
            return None
        for part in manifest["parts"]:
            for file, size in part["files"].items():
                if os.path.getsize(os.path.join(entry, file)) != size:
                    return None
        return manifest
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError, AttributeError):
        return None  # other errors (EMFILE, EACCES, ESTALE) say nothing of the entry: they are raised


def _convert_entry(fingerprint: Dict, out_dir: str, name: str, block_size: int, progress: bool) -> Dict:
    """Converts the source into a partial directory and renames it to the entry; returns the manifest."""
    entry = os.path.join(out_dir, name)
    for stale in _partial_dirs(out_dir, entry_name=name):  # the lock is ours: any partial of this entry is dead
        shutil.rmtree(stale, ignore_errors=True)
    if os.path.exists(entry):
        shutil.rmtree(entry)
    partial = os.path.join(out_dir, f".{name}.partial-{socket.gethostname()}-{os.getpid()}")
    os.mkdir(partial)
    try:
        started = time.perf_counter()
        if progress:
            print(f"[criteo] converting {fingerprint['path']} -> {entry}", file=sys.stderr, flush=True)
        source = fingerprint["path"]
        names = _day_names(fingerprint)
        day_rows = None if fingerprint["days"] is None else _dlrm_day_rows(source, fingerprint["days"])
        parts = _convert_days(source, partial, names, day_rows, block_size, progress)
        if _source_fingerprint(source, fingerprint["days"]) != fingerprint:
            raise RuntimeError(f"{source} changed while it was being converted")
        manifest = {"source": fingerprint, "parts": parts, "seconds": round(time.perf_counter() - started, 3),
                    "converted_by": {"host": socket.gethostname(), "pid": os.getpid()},
                    "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(os.path.join(partial, _MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        sync_directory(partial)
        os.rename(partial, entry)
        sync_directory(out_dir)
        return manifest
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _dlrm_day_rows(source: str, days: int) -> List[int]:
    """Rows per day of DLRM's split (getCriteoAdData): equal parts, the first `extras` one row longer."""
    total = count_lines(source)
    if total == 0:
        raise CriteoFormatError(f"{source}: no lines (an empty file)")
    if total < days:
        raise CriteoFormatError(f"{source}: {days} days need at least {days} lines, the file has {total}")
    per_day, extras = divmod(total, days)
    return [per_day + (day < extras) for day in range(days)]


def _convert_days(source: str, directory: str, names: List[str], day_rows: Optional[List[int]], block_size: int,
                  progress: bool) -> List[Dict]:
    """Writes each day's npy files into `directory`; returns each day's manifest part."""
    parts: List[Dict] = []
    writers: List[_DayNpyWriter] = []
    next_report = time.perf_counter() + _PROGRESS_SECONDS
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(lambda: writers and writers[-1].close())  # a failed day's files are closed too
        blocks = cleanup.enter_context(contextlib.closing(read_blocks(source, block_size=block_size)))
        for block in blocks:  # closing() stops the reader's thread when this loop fails
            start = 0
            while start < len(block):
                if len(writers) == len(parts):
                    if len(writers) == len(names):
                        raise CriteoFormatError(f"{source}: line {block.first_line + start}: more lines than "
                                                f"counted (a lone carriage return?)")
                    writers.append(_DayNpyWriter(os.path.join(directory, names[len(writers)])))
                writer = writers[-1]
                room = len(block) if day_rows is None else day_rows[len(parts)] - writer.rows
                end = min(len(block), start + room)
                writer.append(block, start, end)
                start = end
                if day_rows is not None and writer.rows == day_rows[len(parts)]:
                    parts.append(writer.finish())
            if progress and time.perf_counter() > next_report:
                print(f"[criteo] {source}: {block.first_line + len(block) - 1} lines", file=sys.stderr, flush=True)
                next_report += _PROGRESS_SECONDS
        if day_rows is None:
            parts.append(writers[-1].finish())
        elif len(parts) != len(names):
            raise CriteoFormatError(f"{source}: fewer lines than counted ({sum(w.rows for w in writers)} of "
                                    f"{sum(day_rows)})")
    return parts


class _DayNpyWriter:
    """One day's three npy files, appended block by block; the headers are written last.

    The dense file first holds the raw int32 values (as many bytes as the float32 ones), and
    `finish` rewrites them in place as torchrec's log(x - min + 2), once the day's minimum is known.
    """

    _COLUMNS = {"dense": (np.float32, INT_FEATURES), "sparse": (np.int64, CAT_FEATURES), "labels": (np.int32, 1)}

    def __init__(self, prefix: str) -> None:
        self.prefix, self.rows = prefix, 0
        self.dense_min: Optional[int] = None
        self.header_bytes = len(npy_header(np.float32, (0, INT_FEATURES)))
        self.files: Dict[str, BinaryIO] = {}
        try:
            for part in NPY_PARTS:
                self.files[part] = open(f"{prefix}_{part}.npy", "w+b")
                self.files[part].seek(self.header_bytes)
        except BaseException:
            self.close()
            raise

    def append(self, block: CriteoBlock, start: int, end: int) -> None:
        if end <= start:
            return
        dense = block.dense[start:end]
        low = int(dense.min())
        self.dense_min = low if self.dense_min is None else min(self.dense_min, low)
        self.files["dense"].write(np.ascontiguousarray(dense).data)
        self.files["sparse"].write(np.ascontiguousarray(block.sparse[start:end]).data)
        self.files["labels"].write(np.ascontiguousarray(block.labels[start:end]).data)
        self.rows += end - start

    def close(self) -> None:
        """Closes the files, finished or not."""
        for f in self.files.values():
            f.close()

    def finish(self) -> Dict:
        """Transforms the dense values, writes the headers, fsyncs; returns the day's manifest part."""
        self._log_dense_in_place()
        files = {}
        for part, f in self.files.items():
            dtype, columns = self._COLUMNS[part]
            header = npy_header(dtype, (self.rows, columns))
            if len(header) != self.header_bytes:
                raise RuntimeError(f"npy header of {f.name} is {len(header)} bytes, {self.header_bytes} reserved")
            f.seek(0)
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
            files[os.path.basename(f.name)] = os.fstat(f.fileno()).st_size
            f.close()
        return {"name": os.path.basename(self.prefix), "rows": self.rows, "files": files}

    def _log_dense_in_place(self) -> None:
        f = self.files["dense"]
        f.flush()
        fd = f.fileno()
        with np.errstate(over="ignore"):  # torchrec's int32 arithmetic, wrapping included
            shift = np.int32(self.dense_min) - np.int32(2)
        values = self.rows * INT_FEATURES
        chunk = np.empty(_DENSE_CHUNK_VALUES, dtype=np.int32)
        for first in range(0, values, _DENSE_CHUNK_VALUES):
            count = min(_DENSE_CHUNK_VALUES, values - first)
            offset = self.header_bytes + 4 * first
            view = chunk[:count]
            if os.preadv(fd, [view.data], offset) != 4 * count:
                raise OSError(errno.EIO, f"short read of {f.name}")
            view -= shift
            os.pwrite(fd, np.log(view, dtype=np.float32).data, offset)


def _partial_dirs(out_dir: str, entry_name: Optional[str] = None) -> Iterator[str]:
    """Partial directories in `out_dir`: those of `entry_name`, or those nobody is writing (their
    converter holds its entry's lock while it writes; pids are no evidence across containers)."""
    for name in os.listdir(out_dir):
        match = _PARTIAL.match(name)
        if match is None:
            continue
        if entry_name is not None:
            if match["entry"] == entry_name:
                yield os.path.join(out_dir, name)
            continue
        fd = os.open(os.path.join(out_dir, match["entry"] + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # being written
        finally:
            os.close(fd)
        yield os.path.join(out_dir, name)


def _remove_superseded(out_dir: str, name: str, fingerprint: Dict) -> None:
    """Removes entries of the same source path and options with other contents, unless someone holds
    their lock, and partial directories of dead processes."""
    for other in os.listdir(out_dir):
        path = os.path.join(out_dir, other)
        if other == name or other.startswith(".") or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _MANIFEST)) as f:
                source = json.load(f)["source"]
            superseded = source["path"] == fingerprint["path"] and source["days"] == fingerprint["days"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not superseded:
            continue
        lock = path + ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            os.unlink(lock)
        finally:
            os.close(fd)
    for stale in _partial_dirs(out_dir):
        shutil.rmtree(stale, ignore_errors=True)
