"""KVStore: the Python face of the log-structured storage engine."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .checks import is_int

CorruptionError = _C.CorruptionError
"""A record or file on disk fails its checksum or is truncated; the message names the file."""

_ELEMENT_TYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


def initial_rows(ids: KeysLike, dim: int, seed: int = 0, low: Optional[float] = None, high: Optional[float] = None,
                 dtype: torch.dtype = torch.float32, num_embeddings: Optional[int] = None,
                 first_column: int = 0, *, mean: Optional[float] = None, std: Optional[float] = None) -> torch.Tensor:
    """Deterministic initial values of embedding rows never written.

    Element j of row `id` is uniform in [low, high) (or normal with `mean` and
    `std`, when those are given) and a function of (seed, id, j) alone: any
    batch order, any process, gives the same rows. By default the range is
    TorchRec's uniform(-sqrt(1/n), sqrt(1/n)) for a table of `num_embeddings` rows.

    Args:
        ids: int64 ids [N], non-negative.
        dim: elements per row.
        seed: the table's seed.
        low, high: the range; both or neither.
        mean, std: a normal distribution instead of the range; both or neither.
        dtype: float32, float16 or bfloat16.
        num_embeddings: the table's row count, for the default range.
        first_column: the rows are columns [first_column, first_column + dim)
            of the full rows (a column shard of a wider table).

    Returns:
        [N, dim] rows of `dtype` on the CPU.
    """
    if (low is None) != (high is None):
        raise ValueError("give both low and high, or neither")
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    normal = mean is not None
    if normal and low is not None:
        raise ValueError("give low and high (uniform) or mean and std (normal), not both")
    if normal:
        low, high = mean, std
    elif low is None:
        if not num_embeddings or num_embeddings <= 0:
            raise ValueError("num_embeddings (positive) is needed for the default range uniform(-sqrt(1/n), sqrt(1/n))")
        high = (1.0 / num_embeddings) ** 0.5
        low = -high
    if dtype not in _ELEMENT_TYPES:
        raise TypeError(f"dtype must be one of {list(_ELEMENT_TYPES)}, got {dtype}")
    if not is_int(dim):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.int64)
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"ids must be non-negative, got {int(ids.min())}")
    return _C.initial_rows(ids.detach().to("cpu").contiguous(), dim, int(seed), float(low), float(high), dtype,
                           int(first_column), normal)


_IO_ENGINES = ("auto", "uring", "threads", "pread")

KeysLike = Union[torch.Tensor, Sequence[int]]


class _RowStore:
    """What both stores share: rows of ``dim`` elements of ``dtype`` under non-negative int64 keys,
    batched put and lookup, and an open/closed life. Subclasses set ``_store`` (the binding)."""

    _store: Any

    def _open(self, path: Union[str, os.PathLike], dim: int, dtype: torch.dtype, memory_budget_bytes: int) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        for name, value in (("dim", dim), ("memory_budget_bytes", memory_budget_bytes)):
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
        if dtype not in _ELEMENT_TYPES:
            raise TypeError(f"dtype must be one of {list(_ELEMENT_TYPES)}, got {dtype}")
        self._closed = True
        self._path = os.fspath(path)
        self._dim = dim
        self._dtype = dtype

    @property
    def path(self) -> str:
        return self._path

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _keys(self, keys: KeysLike) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor):
            keys = torch.as_tensor(keys, dtype=None)
            if keys.numel() == 0:
                keys = keys.to(torch.int64)
        if keys.dtype != torch.int64:
            raise TypeError(f"keys must be int64, got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
        return keys.detach().to("cpu").contiguous()

    def put(self, keys: KeysLike, values: torch.Tensor) -> None:
        """Inserts or overwrites rows; with duplicate keys the last one wins."""
        keys = self._keys(keys)
        self._store.put(keys, self._rows_of(keys, values))

    @contextlib.contextmanager
    def filling(self, expected_rows: int = 0) -> Iterator[Callable[[KeysLike, torch.Tensor], None]]:
        """A writer of (keys, rows) chunks for filling the store: here `put`; a KVStore loads the
        chunks whose keys increase from one to the next into an empty store (`KVStore.filling`)."""
        yield self.put

    def _rows_of(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`values` checked as the rows of `keys`, contiguous on the CPU."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self._dtype:
            raise TypeError(f"values must be {self._dtype} (the store's dtype), got {values.dtype}")
        if tuple(values.shape) != (keys.numel(), self._dim):
            raise ValueError(f"values must have shape [{keys.numel()}, {self._dim}] (keys x dim), "
                             f"got {list(values.shape)}")
        return values.detach().to("cpu").contiguous()

    def lookup(self, keys: KeysLike) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (rows [N, dim], found bool [N]); rows of absent keys are zero.

        Absent keys are no error: a caller that initializes missing rows (an
        embedding table) reads present and absent ones in one call.
        """
        keys = self._keys(keys)
        rows = torch.zeros(keys.numel(), self._dim, dtype=self._dtype)
        found = self._store.lookup(keys, rows)
        return rows, found

    def checkpoint(self) -> None:
        """Makes the current contents durable; reopening the path recovers them."""
        self._store.checkpoint()

    def stats(self) -> Dict[str, Any]:
        """The store's counters (see the subclass)."""
        self._check_open()
        return self._store.stats()

    def close(self) -> None:
        """Checkpoints and releases the path. Idempotent."""
        if self._closed:
            return
        try:
            self._store.close()
        except BaseException:
            # A store whose checkpoints can no longer succeed closes anyway, and raises why.
            self._closed = hasattr(self._store, "closed") and self._store.closed()
            raise
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"store at {self._path} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVStore(_RowStore):
    """A larger-than-memory key-value store of fixed-width rows.

    Keys are non-negative int64; each value is a row of ``dim`` elements of
    ``dtype``. Rows live in a hybrid log: the newest ``memory_budget_bytes`` in
    memory (updated in place), older ones in append-only segment files under
    ``path``. Opening an existing ``path`` recovers its latest checkpoint.

    Args:
        path: directory of the store; created when missing.
        dim: elements per row.
        dtype: torch.float32, torch.float16 or torch.bfloat16.
        memory_budget_bytes: bytes of log pages held in memory (the index is extra).
        expected_rows: pre-sizes the hash index (16 bytes a row); by default it starts at its least
            (256 KiB; with a key_limit of at most 2**51, one 64-byte bucket) and grows with the rows.
        index_budget_bytes: bytes the hash index may take (at 16 a key). Past them, the rows of the
            log's written pages move into the base run, a file of rows sorted by key that a get
            reads with one 4 KiB read and no memory per row, so the store's memory stays bounded
            however many rows it holds. 0 (the default): no bound; the index keeps every key.
        segment_bytes: size of one segment file on disk.
        page_bytes: log page size; 0 picks budget/16, at most 1 MiB.
        mutable_fraction: share of the memory pages updated in place.
        io_depth: disk reads in flight per batch.
        io_engine: "uring", "threads" (a pool of pread workers), "pread" (on the calling
            thread) or "auto": "pread" for a store in memory (tmpfs, /dev/shm), where a read is
            a copy, else io_uring where the kernel allows it, else "threads".
        io_threads: workers of the "threads" engine.
        direct_io: bypass the page cache (O_DIRECT) where the file system allows.
        compaction_ratio: compact automatically once the on-disk log exceeds
            this multiple of the live rows; 0 turns automatic compaction off.
            A compaction ends with a checkpoint (unless cut_checkpoints).
        promote_hot_reads: copy a row that gets read from disk twice within a
            short window into memory (in the background), so skewed reads
            are served from memory; uniform scans are not promoted.
        cut_checkpoints: checkpoints are cuts that the store's owner commits
            across several stores (an embedding table's, at a training
            checkpoint): automatic compaction takes none, and besides the
            latest the store keeps the one its owner last committed
            (`commit_checkpoint`), so a cut that a crash left half-way across
            the stores, or that failed, can be undone.
        checkpoint: recover this checkpoint (a number `checkpoint()`
            returned): the latest or, with cut_checkpoints, the committed one
            kept beside it; ValueError names the ones the store has. Default:
            the latest.
        key_limit: keys are below this (an embedding table's rows); 0 (the default): any
            non-negative int64. The index then hashes only the bits such keys have, so a table of
            few rows takes as little index memory as its keys fill; a key at or past the limit is
            refused (ValueError). Reopen a store with the key_limit it was written with.
        read_only: open the store's checkpoint (the latest, or `checkpoint`) without writing a byte:
            no file is created, changed or removed (not even to discard a newer checkpoint), puts,
            deletes, lookaheads, compactions and checkpoints are refused (ValueError), and rows read
            from disk are not promoted. Any number of read-only opens share a path while no writer
            holds it (a writer and a reader refuse each other: ValueError). For reading a
            checkpoint that another job resumes from.

    Example::

        with KVStore("/tmp/table", dim=16, memory_budget_bytes=64 << 20) as store:
            store.put(torch.arange(4), torch.randn(4, 16))
            rows = store.get(torch.tensor([0, 3]))
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        dim: int,
        dtype: torch.dtype = torch.float32,
        memory_budget_bytes: int = 256 << 20,
        *,
        expected_rows: int = 0,
        segment_bytes: int = 64 << 20,
        page_bytes: int = 0,
        mutable_fraction: float = 0.9,
        io_depth: int = 64,
        io_engine: str = "auto",
        io_threads: int = 16,
        direct_io: bool = True,
        compaction_ratio: float = 2.0,
        promote_hot_reads: bool = True,
        cut_checkpoints: bool = False,
        checkpoint: Optional[int] = None,
        index_budget_bytes: int = 0,
        key_limit: int = 0,
        read_only: bool = False,
    ) -> None:
        self._open(path, dim, dtype, memory_budget_bytes)
        if checkpoint is not None and (not is_int(checkpoint) or checkpoint <= 0):
            raise ValueError(f"checkpoint must be a positive int (a number checkpoint() returned), got {checkpoint!r}")
        for name, value in (("expected_rows", expected_rows), ("segment_bytes", segment_bytes),
                            ("page_bytes", page_bytes), ("index_budget_bytes", index_budget_bytes),
                            ("key_limit", key_limit), ("io_depth", io_depth), ("io_threads", io_threads)):
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if io_engine not in _IO_ENGINES:
            raise ValueError(f"io_engine must be one of {_IO_ENGINES}, got {io_engine!r}")
        self._store = _C.Store(self._path, dim, _ELEMENT_TYPES[dtype], memory_budget_bytes, max(expected_rows, 0),
                               segment_bytes, page_bytes, float(mutable_fraction), io_depth, io_engine, io_threads,
                               bool(direct_io), float(compaction_ratio), bool(promote_hot_reads),
                               bool(cut_checkpoints), int(checkpoint or 0), index_budget_bytes, key_limit,
                               bool(read_only))
        self._closed = False

    def get(self, keys: KeysLike, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns rows [N, dim] on the keys' device; KeyError names keys not in the store.

        Args:
            keys: int64 keys [N].
            out: optional contiguous CPU tensor [N, dim] of the store's dtype to
                fill and return (saves allocating the result on every call).
        """
        device = keys.device if isinstance(keys, torch.Tensor) else torch.device("cpu")
        keys = self._keys(keys)
        if out is None:
            result = torch.empty(keys.numel(), self._dim, dtype=self._dtype)
            self._store.get(keys, result)
            return result.to(device)
        if not isinstance(out, torch.Tensor) or out.dtype != self._dtype:
            raise TypeError(f"out must be a {self._dtype} tensor")
        if tuple(out.shape) != (keys.numel(), self._dim) or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU tensor of shape [{keys.numel()}, {self._dim}], "
                             f"got {list(out.shape)} on {out.device}")
        self._store.get(keys, out)
        return out

    def contains(self, keys: KeysLike) -> torch.Tensor:
        """Returns a bool tensor [N]: whether each key holds a row."""
        return self._store.contains(self._keys(keys))

    def delete(self, keys: KeysLike) -> int:
        """Removes rows (absent keys are ignored); returns how many were removed."""
        return self._store.delete(self._keys(keys))

    def lookahead(self, keys: KeysLike) -> None:
        """Starts bringing these rows from disk into memory and returns at once."""
        self._store.lookahead(self._keys(keys))

    def flush(self) -> None:
        """Waits until queued lookaheads are applied; raises an error one of them met."""
        self._store.flush()

    def scan(self, chunk_rows: int = 1 << 16, part: str = "all") -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Every row, as (keys [n], rows [n, dim]) chunks of about `chunk_rows`, in the log's order:
        the log is read sequentially, a few MiB at a time, where `get` reads a 4 KiB block per
        row (for a table larger than memory, ~15x less I/O than reading it key by key). A row
        written during the scan may come twice (the newer last); at rest each comes once.

        `part`: "all"; "log", the rows the log holds; "base", the others (those that moved into
        the base run past the index's budget), in increasing key order, as `load_rows` takes them."""
        if not is_int(chunk_rows) or chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        if part not in ("all", "log", "base"):
            raise ValueError(f"part must be 'all', 'log' or 'base', got {part!r}")
        cursor = _C.Store.SCAN_BASE if part == "base" else 0
        while cursor >= 0 and not (part == "log" and cursor >= _C.Store.SCAN_BASE):
            self._check_open()
            keys, raw, cursor = self._store.scan_rows(cursor, chunk_rows)
            if keys.numel():
                yield keys, raw.view(self._dtype).view(keys.numel(), self._dim)

    def begin_load(self, expected_rows: int = 0) -> bool:
        """Begins a load into a store that holds no row (False, and nothing begun, for one that
        does): `load_rows` then writes rows in increasing key order once, straight into the base
        run, where `put` writes each to the log and again when it moves there past the index's
        budget (a table filled from another's sorted rows). Until `end_load` every write is refused
        and gets do not see the rows loaded; `close` before it drops them. `expected_rows` (at least
        the rows to come; default the key_limit) sizes the run's filter, which keys with gaps need."""
        if not is_int(expected_rows) or expected_rows < 0:
            raise ValueError(f"expected_rows must be a non-negative int, got {expected_rows!r}")
        self._check_open()
        return self._store.begin_load(expected_rows)

    def load_rows(self, keys: KeysLike, values: torch.Tensor) -> None:
        """Rows of a load (`begin_load`): keys strictly increasing, above every key loaded before;
        ValueError names the first that is not (the rows before it are loaded)."""
        keys = self._keys(keys)
        self._store.load_rows(keys, self._rows_of(keys, values))

    def end_load(self) -> int:
        """Makes the rows loaded the store's (its base, which the next checkpoint records); returns
        how many."""
        self._check_open()
        return self._store.end_load()

    @contextlib.contextmanager
    def filling(self, expected_rows: int = 0) -> Iterator[Callable[[KeysLike, torch.Tensor], None]]:
        """A writer of (keys, rows) chunks for filling the store (a table before it is trained):
        while their keys increase from chunk to chunk into a store that holds no row, it loads them
        (`begin_load`: each row written once, straight into the base run); from the first chunk out
        of that order on, it puts them. The load ends when the block does."""
        fill = _Fill(self, self.begin_load(expected_rows))
        try:
            yield fill.write
        finally:
            fill.end()

    def checkpoint(self) -> int:
        """Makes the current contents durable; returns the checkpoint's number, which reopening
        recovers (the latest by default). With nothing changed since the last checkpoint, that
        one stands and its number is returned."""
        return self._store.checkpoint()

    def begin_checkpoint(self) -> None:
        """The first half of `checkpoint`, for a writer that must not wait for the disk: fixes the
        checkpoint's contents (every row put so far, none put after) and returns without waiting
        for the disk; puts and gets go on, and rows put from now on are not in it.
        `finish_checkpoint` makes it durable. Until then `begin_checkpoint`, `checkpoint`,
        `compact` and `commit_checkpoint` raise ValueError; `close` finishes it."""
        self._check_open()
        self._store.begin_checkpoint()

    def finish_checkpoint(self) -> int:
        """Makes the checkpoint `begin_checkpoint` began durable and returns its number, as
        `checkpoint` does; ValueError when none is begun."""
        self._check_open()
        return self._store.finish_checkpoint()

    def commit_checkpoint(self, sequence: int) -> None:
        """With cut_checkpoints: the owner has recorded the latest checkpoint, `sequence`, as its
        cut. The next checkpoint keeps it beside itself (and the one kept until now may go); until
        this is called, each new checkpoint replaces the latest and keeps the committed one, which
        the owner's record still names. Kept in memory only: after a crash, open the store at the
        checkpoint the record names. ValueError for a sequence that is not the latest."""
        if not is_int(sequence):
            raise TypeError(f"sequence must be an int, got {type(sequence).__name__}")
        self._check_open()
        self._store.commit_checkpoint(sequence)

    def compact(self) -> None:
        """Copies live rows out of the on-disk log, checkpoints, and deletes the old segments."""
        self._store.compact()

    def stats(self) -> Dict[str, Any]:
        """Counters: rows, memory and disk bytes, memory hits, disk reads, lookahead rows, ..."""
        return super().stats()

    def __len__(self) -> int:
        self._check_open()
        return self._store.size()

    @staticmethod
    def destroy(path: Union[str, os.PathLike]) -> None:
        """Deletes the files of the closed store at `path` (its rows are gone), as LevelDB's
        DestroyDB; other files there stay. Raises if the store is open."""
        _C.Store.destroy(os.fspath(path))

    @staticmethod
    def minimum_memory_bytes(path: Union[str, os.PathLike]) -> int:
        """The least memory_budget_bytes the store at `path` opens with: four of the log pages it
        was created with (a store's page size is fixed when it is created, from its budget then:
        a sixteenth of it, at most 1 MiB). 0 when no store is there yet."""
        return int(_C.Store.minimum_memory_bytes(os.fspath(path)))

    def __contains__(self, key: int) -> bool:
        return bool(self.contains([key])[0])

    def __repr__(self) -> str:
        rows = "closed" if self._closed else f"rows={len(self)}"
        return f"KVStore(path={self._path!r}, dim={self._dim}, dtype={self._dtype}, {rows})"


class _Fill:
    """`KVStore.filling`'s writer: loads while the keys increase, puts from the first chunk that
    breaks the order on."""

    def __init__(self, store: KVStore, loading: bool) -> None:
        self.store, self.loading, self.last_key = store, loading, -1

    def write(self, keys: KeysLike, rows: torch.Tensor) -> None:
        keys = self.store._keys(keys)
        if self.loading and keys.numel() and (int(keys[0]) <= self.last_key or not bool((keys[1:] > keys[:-1]).all())):
            self.end()
        if not self.loading:
            self.store.put(keys, rows)
            return
        self.store.load_rows(keys, rows)
        self.last_key = int(keys[-1]) if keys.numel() else self.last_key

    def end(self) -> None:
        if self.loading:
            self.loading = False
            self.store.end_load()


class RocksDBStore(_RowStore):
    """The same rows in RocksDB: the offloading baseline MLKV was measured against.

    ``DiskEmbeddingBag(..., backend="rocksdb")`` runs its cache and optimizer over this
    store instead of the hybrid log, so a comparison isolates the store. RocksDB gets
    settings that favour it: no write-ahead log (rows become durable at `checkpoint` and
    `close`, as the log's do at its checkpoint), no compression, 4 KiB blocks with bloom
    filters. ``memory_budget_bytes`` is split between its block cache and two memtables;
    reads bypass the page cache where the file system allows (``direct_io``).

    Needs a build with RocksDB (Debian's librocksdb-dev; ``scripts/setup.sh`` installs it).
    """

    def __init__(self, path: Union[str, os.PathLike], dim: int, dtype: torch.dtype = torch.float32,
                 memory_budget_bytes: int = 256 << 20, *, direct_io: bool = True) -> None:
        if not _C.with_rocksdb:
            raise RuntimeError("mlkv_torch was built without RocksDB: install its headers and library "
                               "(Debian: apt-get install librocksdb-dev) and rebuild the package")
        self._open(path, dim, dtype, memory_budget_bytes)
        self._store = _C.RocksStore(self._path, dim * dtype.itemsize, memory_budget_bytes, bool(direct_io))
        self._closed = False

    def flush(self) -> None:
        """Returns at once: unlike KVStore, this store runs no reads in the background for its
        callers, and RocksDB reports its own background errors on the calls that meet them."""
        self._check_open()

    def stats(self) -> Dict[str, Any]:
        """Counters: RocksDB's estimate of its rows, live SST bytes, memtable and block-cache bytes,
        block-cache hits and misses (a data-block miss is a disk read), rows read, found and written."""
        return super().stats()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"RocksDBStore(path={self._path!r}, dim={self._dim}, dtype={self._dtype}, {state})"
