"""DiskEmbeddingBag: an embedding bag whose table lives in a KVStore (or, as a baseline, in RocksDB).

Forward takes the distinct ids of the batch, fetches their weights through a
hot cache in device memory (rows missing from it come from the store, or are
`initial_rows` when never written), and pools them as torch.nn.EmbeddingBag
does. Backward computes one gradient row per distinct id (duplicates summed,
as in a coalesced sparse gradient) and queues it for the cache's applier,
which runs the fused optimizer on the row and its state (kept together in one
store row) and writes rows outside the cache back to the store. No dense
weight gradient exists.

With `staleness=s`, a forward waits until at most s updates of this table are
still queued: no row it reads misses more than s of its updates, and s=0 reads
every update (training equals the in-memory reference).
"""
from __future__ import annotations

import atexit
import os
import tempfile
import warnings
import weakref
import zlib
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import _C
from . import optim as optim_lib
from .checks import is_int
from .memory_budget import (HostMemorySplit, MemoryBudgetError, buffer_host_bytes, cache_host_bytes,  # noqa: F401
                            host_memory_for_all_rows, least_host_memory, split_host_memory, stores_min_bytes)
from .row_layout import row_bytes, weight_words
from .cut import CutPart, PendingCut, check_cut, read_cut, read_json_record, write_json_record
from .store import KVStore, RocksDBStore, initial_rows

__all__ = ["DiskEmbeddingBag", "DiskRows", "DiskTable", "DiskTableBatch", "HostMemorySplit", "host_memory_for_all_rows",
           "split_host_memory"]

_MODES = ("sum", "mean")
_WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CACHE_POLICIES = ("lfu", "lru")
BACKENDS = ("mlkv", "rocksdb")  # the stores a table can sit on
# A table's store updates half its log pages in place, not 0.9 (KVStore's default): the cache in
# front of it takes the rows updated often, and with half its pages read-only the store's flush
# writes several at a time (see KVStore::StartPage).
_STORE_MUTABLE_FRACTION = 0.5


class _PooledLookup(torch.autograd.Function):
    """Autograd glue of the table-batched lookup: pools the fetched rows of every feature in one
    ``embedding_bag`` call; backward computes one gradient row per distinct key and queues the
    batch's fused optimizer step. `anchors` (one empty parameter per table) make backward run
    even when no other input needs a gradient, and say which tables train: under no_grad, or
    with a table frozen, its rows are not updated."""

    @staticmethod
    def forward(ctx: Any, batch: "DiskTableBatch", unique: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                device_lookup: Optional[Tuple[torch.Tensor, int, int]], *anchors: torch.Tensor) -> torch.Tensor:
        out = F.embedding_bag(inverse, weights, offsets, mode=batch.mode, per_sample_weights=per_sample_weights,
                              include_last_offset=True)
        ctx.batch = batch
        ctx.device_lookup = device_lookup  # (slots, index version, rows not cached) of a device lookup
        psw_needs_grad = per_sample_weights is not None and ctx.needs_input_grad[5]
        ctx.save_for_backward(unique, inverse, offsets, weights if psw_needs_grad else None, per_sample_weights)
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        batch: DiskTableBatch = ctx.batch
        unique, inverse, offsets, weights, per_sample_weights = ctx.saved_tensors
        if grad_out.device.type == "cpu":
            grads, grad_psw = _C.bag_backward(grad_out, offsets, inverse, unique.numel(), batch.mode == "mean",
                                              per_sample_weights, weights)
        else:
            grads, grad_psw = _bag_backward_torch(grad_out, offsets, inverse, unique.numel(), batch.mode == "mean",
                                                  per_sample_weights, weights)
        if grad_psw is not None:
            grad_psw = grad_psw.to(per_sample_weights.dtype)
        trains = ctx.needs_input_grad[7:]
        if ctx.device_lookup is not None:
            slots, version, outside = ctx.device_lookup
            if all(trains):
                batch.update_on_device(unique, slots, version, outside, grads)
            elif any(trains):  # some tables frozen: their rows keep their values
                keep = torch.tensor(trains, device=unique.device).index_select(
                    0, unique >> _C.EmbeddingCache.table_shift)
                batch.update_on_device(unique[keep], slots[keep], version, -1, grads[keep])
        elif all(trains):
            batch.queue_update(unique, grads)
        elif any(trains):  # some tables frozen (requires_grad_(False)): their rows keep their values
            keep = torch.tensor(trains).index_select(0, unique >> _C.EmbeddingCache.table_shift)
            if bool(keep.any()):
                batch.queue_update(unique[keep].contiguous(), grads[keep.to(grads.device)])
        # A training table's anchor gets its (empty) gradient: data-parallel wrappers (DDP) expect
        # every parameter that takes part in the forward to receive one.
        anchor_grads = tuple(torch.zeros(shape, dtype=dtype, device=device) if train else None
                             for train, (shape, dtype, device) in zip(trains, ctx.anchors))
        return (None, None, None, None, None, grad_psw, None) + anchor_grads


_OPEN_BATCHES: "weakref.WeakSet[DiskTableBatch]" = weakref.WeakSet()


@atexit.register
def _close_open_tables() -> None:
    """At interpreter exit, close tables still open: their cached rows reach the stores, and the
    cache's threads stop before the interpreter and torch tear down."""
    for batch in list(_OPEN_BATCHES):
        try:
            batch.close()
        except Exception as e:  # exiting anyway: say what was lost
            warnings.warn(f"closing {', '.join(s.path for s in batch.stores)} at exit failed: {e}")


def _bag_backward_torch(grad_out: torch.Tensor, offsets: torch.Tensor, inverse: torch.Tensor, distinct: int, mean: bool,
                        per_sample_weights: Optional[torch.Tensor], weights: Optional[torch.Tensor]
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """_C.bag_backward in torch ops, for devices other than the CPU."""
    lengths = offsets[1:] - offsets[:-1]
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                     output_size=inverse.numel())  # known: no synchronisation
    per_id = grad_out.to(torch.float32).index_select(0, bag_of)  # d out[bag] / d weight row, per input position
    grad_psw = None
    if weights is not None:
        grad_psw = (per_id * weights.index_select(0, inverse).to(torch.float32)).sum(1)
    if mean:
        per_id = per_id / lengths.index_select(0, bag_of).unsqueeze(1).to(torch.float32)
    elif per_sample_weights is not None:
        per_id = per_id * per_sample_weights.to(torch.float32).unsqueeze(1)
    grads = torch.zeros(distinct, grad_out.shape[1], dtype=torch.float32, device=per_id.device)
    return grads.index_add_(0, inverse, per_id), grad_psw


def _empty_rows(shape: Tuple[int, int], dtype: torch.dtype, directory: Optional[str]) -> torch.Tensor:
    """An uninitialised CPU tensor; with `directory`, backed by a file there rather than by memory.

    The file's blocks are reserved first (a full disk raises OSError here, not SIGBUS on a later
    write through the mapping), and its name is unlinked at once: the mapping keeps the data.
    """
    if directory is None:
        return torch.empty(shape, dtype=dtype)
    numel = shape[0] * shape[1]
    fd, name = tempfile.mkstemp(prefix=".snapshot-", dir=directory)
    try:
        if numel:
            os.posix_fallocate(fd, 0, numel * dtype.itemsize)
        mapped = torch.from_file(name, shared=True, size=numel, dtype=dtype)
    except OSError as e:
        raise OSError(e.errno, f"cannot reserve {numel * dtype.itemsize} bytes for a snapshot in {directory}: "
                               f"{e.strerror}") from e
    finally:
        os.close(fd)
        os.unlink(name)
    return mapped.view(shape)


# A table's own facts, kept beside its store: the seed its rows never written derive from.
TABLE_RECORD = "TABLE.json"


def draw_seed() -> int:
    """The seed of tables built without one (``seed=None``), read from the state of torch's
    default generator: after the same ``torch.manual_seed`` (and the same random draws since),
    tables start from the same rows, as EmbeddingBagCollection's do. It draws nothing: the
    model's other layers, and TorchRec's own tables, initialise as they would without it."""
    return zlib.crc32(torch.get_rng_state().numpy().tobytes()) & 0x7FFFFFFF


def _read_record(table_path: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(table_path, TABLE_RECORD)
    record = read_json_record(path, "the seed of the table's initial rows")
    if record is None:
        return None
    if not isinstance(record, dict) or isinstance(record.get("seed"), bool) or not isinstance(record.get("seed"), int):
        raise ValueError(f"{path} is corrupted: it records no integer 'seed', got {record!r}")
    return record


def _write_record(table_path: str, record: Dict[str, Any]) -> None:
    write_json_record(os.path.join(table_path, TABLE_RECORD), record)


def destroy_table(path: str) -> None:
    """Deletes a closed table's files: its KVStore's and its record (what a table that holds no
    rows yet needs to reopen with another row layout)."""
    KVStore.destroy(path)
    for name in (TABLE_RECORD, TABLE_RECORD + ".tmp"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class DiskTable:
    """One table of a DiskTableBatch.

    Args:
        name: named in errors and stats.
        num_embeddings: rows; ids must lie in [0, num_embeddings).
        path: the directory of its store.
        seed: seed of the initial values of its rows never written.
        first_column: the table holds columns [first_column, first_column + dim) of a wider
            table (a column shard); its initial rows are that slice of the wider table's.
        expected_rows: sizes the store's index; default min(num_embeddings, 4M).
        init: how rows never written start: ("uniform", low, high) or ("normal", mean, std);
            default TorchRec's ("uniform", -sqrt(1/num_embeddings), sqrt(1/num_embeddings)).
        seed_drawn: `seed` was drawn (``seed=None``), not chosen: a reopened table keeps the
            seed it was created with (a chosen seed must equal it).
    """

    name: str
    num_embeddings: int
    path: str
    seed: int = 0
    first_column: int = 0
    expected_rows: Optional[int] = None
    init: Optional[Tuple[str, float, float]] = None
    seed_drawn: bool = False

    def initial_distribution(self) -> Tuple[str, float, float]:
        """("uniform", low, high) or ("normal", mean, std) of the rows never written."""
        if self.init is not None:
            return self.init[0], float(self.init[1]), float(self.init[2])
        bound = (1.0 / self.num_embeddings) ** 0.5
        return "uniform", -bound, bound

    def initial_rows(self, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows `ids` hold until written (what the cache generates for them)."""
        kind, a, b = self.initial_distribution()
        params = dict(mean=a, std=b) if kind == "normal" else dict(low=a, high=b)
        return initial_rows(ids, dim, seed=self.seed, dtype=dtype, first_column=self.first_column, **params)


def _settle_reopened(tables: Sequence[DiskTable], stores: Sequence[Union[KVStore, RocksDBStore]], reopen: bool
                     ) -> List[DiskTable]:
    """The tables as their directories have them. A directory that holds rows from an earlier run
    is reopened only when `reopen` says so; a reopened table keeps the seed it was created with (its
    rows never written must not change), and a fresh one records its seed."""
    records = [_read_record(t.path) for t in tables]
    # A KVStore counts its rows; for RocksDB a record says an earlier run opened the table.
    holds = [len(store) > 0 if isinstance(store, KVStore) else record is not None
             for store, record in zip(stores, records)]
    held = [f"{t.name!r} at {t.path}" + (f" ({len(store):,} rows)" if isinstance(store, KVStore) else "")
            for t, store, h in zip(tables, stores, holds) if h]
    if held and not reopen:  # a second run of a script would otherwise continue silently from the first's rows
        raise FileExistsError(f"{'; '.join(held)}: the directory holds rows and optimizer state from an earlier run. "
                              f"Pass reopen=True to continue from them, or remove the directory to start from "
                              f"initial rows")
    settled = []
    for t, record, h in zip(tables, records, holds):
        if record is not None and (h or reopen):
            if not t.seed_drawn and record["seed"] != t.seed:
                raise ValueError(f"table {t.name!r} at {t.path} was created with seed {record['seed']}, not {t.seed}: "
                                 f"its rows never written derive from it. Pass that seed, or none")
            t = replace(t, seed=record["seed"])
        else:
            _write_record(t.path, {"seed": t.seed})
        settled.append(t)
    return settled


def directory_path(path: Union[str, os.PathLike]) -> str:
    """`path` as a str; TypeError naming the argument when it is not a path (None, say)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (the tables' directory), got {type(path).__name__}")
    return os.fspath(path)


def _cache_init(table: DiskTable) -> Tuple[bool, float, float]:
    """The (normal, a, b) a cache table's initial rows take (see EmbeddingCache's table tuple)."""
    kind, a, b = table.initial_distribution()
    return kind == "normal", a, b


class DiskTableBatch:
    """The table-batched disk kernel: tables of one row layout (dim, weight type, optimizer,
    pooling) behind one hot cache, as FBGEMM's table-batched embeddings are.

    A batch of every table's features is deduplicated, fetched (misses read from each table's
    store in one batched read per table), pooled in one ``embedding_bag`` call and updated by one
    fused optimizer pass over its distinct rows; one applier and one prefetch thread serve all the
    tables. A cached row of table t, id i, is keyed ``(t << table_shift) | i``, so admission and
    eviction weigh every table's rows against each other by frequency.

    DiskEmbeddingBag is the one-table case; DiskEmbeddingBagCollection and the sharded disk kernel
    build one batch per row layout and view each table as a DiskEmbeddingBag.

    Args:
        tables: the tables (each its own store directory).
        embedding_dim: elements per row.
        mode: "sum" or "mean".
        optimizer: a `mlkv_torch.optim` rule, shared by the tables.
        cache_rows: rows of the hot cache on `device`, for all tables; default by `split_host_memory`.
        memory_budget_bytes: host memory for rows, for all tables (`split_host_memory`).
        staleness: updates a forward may miss per row (0: exact).
        dtype: float32, float16, bfloat16 or float64 weights (optimizer state stays float32).
        device: where the cache, the pooling and the output live (CPU or CUDA).
        cache_policy: "lfu" (frequency-based admission) or "lru".
        staging_bytes: bytes of rows for the staging area (rows read ahead, rows the policy kept out
            until their update), inside the budget; default an eighth of the budget
            (`split_host_memory`).
        backend: "mlkv" (KVStore) or "rocksdb" (RocksDBStore).
        reopen: continue from the rows and optimizer state that the tables' directories hold
            from an earlier run; without it, a directory holding rows is refused
            (FileExistsError), so a second run of a script never continues silently.
        cut: reopen every table at this cut (a record `checkpoint` returned, `mlkv_torch.cut`):
            each store at the checkpoint it names, the optimizer at its step. ValueError names a
            table whose store has moved past it or is missing from it.
    """

    def __init__(self, tables: Sequence[DiskTable], embedding_dim: int, *, mode: str = "sum",
                 optimizer: Optional[optim_lib.SparseOptimizer] = None, cache_rows: Optional[int] = None,
                 memory_budget_bytes: int = 64 << 20, staleness: int = 0, dtype: torch.dtype = torch.float32,
                 device: Optional[Union[str, torch.device]] = None, cache_policy: str = "lfu",
                 staging_bytes: Optional[int] = None, backend: str = "mlkv", reopen: bool = False,
                 cut: Optional[Dict[str, Any]] = None) -> None:
        for name, value in (("embedding_dim", embedding_dim), ("memory_budget_bytes", memory_budget_bytes)):
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("staleness", staleness), ("cache_rows", 0 if cache_rows is None else cache_rows),
                            ("staging_bytes", 0 if staging_bytes is None else staging_bytes)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not tables:
            raise ValueError("a table batch needs at least one table")
        for t in tables:
            if isinstance(t.num_embeddings, bool) or not isinstance(t.num_embeddings, int) or t.num_embeddings <= 0:
                raise ValueError(f"num_embeddings must be a positive int, got {t.num_embeddings!r}")
            if isinstance(t.first_column, bool) or not isinstance(t.first_column, int) or t.first_column < 0:
                raise ValueError(f"first_column must be a non-negative int, got {t.first_column!r}")
            if t.init is not None and (len(t.init) != 3 or t.init[0] not in ("uniform", "normal")):
                raise ValueError(f"table {t.name!r}: init must be ('uniform', low, high) or ('normal', mean, std), "
                                 f"got {t.init!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if dtype not in _WEIGHT_TYPES:
            raise TypeError(f"dtype must be one of {list(_WEIGHT_TYPES)}, got {dtype}")
        if cache_policy not in _CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {_CACHE_POLICIES}, got {cache_policy!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        optimizer = optimizer if optimizer is not None else optim_lib.SGD()
        if not isinstance(optimizer, optim_lib.SparseOptimizer):
            raise TypeError(f"optimizer must be a mlkv_torch.optim rule, got {type(optimizer).__name__}")
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for, but torch sees no CUDA device")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.tables = list(tables)
        self._closed_by_close = False  # set by close(): every operation refuses from then on
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.optimizer = optimizer
        self.lr = float(optimizer.lr)
        self.staleness = staleness
        self.dtype = dtype
        self.device = device
        self.memory_budget_bytes = memory_budget_bytes
        self.state_dim = optimizer.state_dim(embedding_dim)
        self.weight_words = weight_words(embedding_dim, dtype)
        self.row_bytes = row_bytes(embedding_dim, dtype, optimizer)
        store_min_bytes = stores_min_bytes([t.path for t in self.tables], backend)
        self.cache_rows, log_bytes, self.staging_rows, self.write_back_rows = split_host_memory(
            memory_budget_bytes, len(self.tables), sum(t.num_embeddings for t in self.tables), self.row_bytes,
            device.type == "cpu", cache_rows, staging_bytes, store_min_bytes)
        self.step = 0
        self.backend = backend
        # One empty parameter per table: autograd runs backward through it and tells which tables train.
        # [0, dim]: TorchRec's row-wise optimizers (apply_optimizer_in_backward) build on it without failing.
        self.anchors = [nn.Parameter(torch.empty(0, embedding_dim)) for _ in self.tables]
        at_cut = self._entries_at(cut) if cut is not None else None
        self.stores: List[Union[KVStore, RocksDBStore]] = []
        try:
            for i, t in enumerate(self.tables):
                if backend == "rocksdb":
                    self.stores.append(RocksDBStore(t.path, self.weight_words + self.state_dim, torch.float32,
                                                    log_bytes))
                    continue
                checkpoint = at_cut[i]["checkpoint"] if at_cut else None
                try:
                    # Cut checkpoints: the store moves only when its tables' owner takes a cut.
                    self.stores.append(KVStore(t.path, self.weight_words + self.state_dim, torch.float32, log_bytes,
                                               expected_rows=t.expected_rows or min(t.num_embeddings, 1 << 22),
                                               mutable_fraction=_STORE_MUTABLE_FRACTION, cut_checkpoints=True,
                                               checkpoint=checkpoint))
                except ValueError as e:
                    if checkpoint is None:
                        raise
                    raise ValueError(f"table {t.name!r} cannot reopen at the cut {cut.get('label')!r} (its store's "
                                     f"checkpoint {checkpoint}): {e}") from e
            self.tables = _settle_reopened(self.tables, self.stores, reopen or cut is not None)
            if at_cut:
                self.step = max(entry["step"] for entry in at_cut)
            eps, beta1, beta2 = optimizer.rule_constants()
            self.cache = _C.EmbeddingCache(
                [(t.name, store._store, t.num_embeddings, int(t.seed), *_cache_init(t), t.first_column)
                 for t, store in zip(self.tables, self.stores)],
                capacity=self.cache_rows, dim=embedding_dim, weight_type=_WEIGHT_TYPES[dtype], kind=optimizer.kind,
                eps=eps, beta1=beta1, beta2=beta2,
                initial_state=optimizer.initial_state(1, embedding_dim).flatten().tolist(), policy=cache_policy,
                staleness=staleness, device=str(device), staging_rows=self.staging_rows,
                write_back_rows=self.write_back_rows)
        except BaseException:
            for store in self.stores:
                store.close()
            raise
        _OPEN_BATCHES.add(self)

    def _entries_at(self, cut: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Each table's entry in a cut record, in table order; ValueError names the tables it lacks."""
        check_cut(cut, "cut")
        missing = [t.name for t in self.tables if t.name not in cut["tables"]]
        if missing:
            raise ValueError(f"the cut {cut.get('label')!r} records tables {sorted(cut['tables'])}, not {missing}")
        return [cut["tables"][t.name] for t in self.tables]

    def begin_checkpoint(self) -> CutPart:
        """Begins this batch's part of a cut at the current step boundary and returns at once: queued
        updates are applied and the cut's rows set aside; the cache's writer thread then writes them
        and checkpoints every store while training goes on (rows changed meanwhile reach the stores
        after the checkpoints). The part's `finish` waits for that and returns each table's
        {"checkpoint": store checkpoint, "step": optimizer step}, by table name; it raises what
        failed (a full disk), and can be called again after a failed write. Whoever owns the tables
        records the result (`mlkv_torch.cut.write_cut`), then calls the part's `commit`; until then
        each store keeps the checkpoint last committed, and a cut begun next replaces this one."""
        if self.cache.cut_pending:  # one begun earlier and never finished (its wait raised): its rows go first
            self.cache.finish_cut(superseded=True)  # never committed: the stores keep the committed cut beside the next
        self.cache.begin_cut()
        step = self.step
        written: List[int] = []

        def finish() -> Dict[str, Dict[str, Optional[int]]]:
            written[:] = self.cache.finish_cut()
            return {t.name: {"checkpoint": sequence or None, "step": step} for t, sequence in zip(self.tables, written)}

        def commit() -> None:
            for store, sequence in zip(self.stores, written):
                if sequence and isinstance(store, KVStore):
                    store.commit_checkpoint(sequence)
        return CutPart(finish, commit)

    def checkpoint(self) -> Dict[str, Dict[str, Optional[int]]]:
        """This batch's part of a cut, taken and written before this returns (`begin_checkpoint`);
        not committed: the caller records it and commits it (`CutPart.commit`), or it is replaced."""
        return self.begin_checkpoint().finish()

    # ---- keys -------------------------------------------------------------------------------------
    def keys(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The cache keys of rows `ids` (int64 CPU) of table `table`; an id outside the table raises."""
        if not 0 <= table < len(self.tables):
            raise ValueError(f"table {table} of {len(self.tables)}")
        n = self.tables[table].num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"id {bad} is out of range [0, {n}) of table {self.tables[table].name!r}")
        return ids | (table << _C.EmbeddingCache.table_shift) if table else ids

    def unique_keys(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Distinct keys of a batch of features (`values` feature after feature, feature_counts[f] ids
        of table feature_tables[f]) and each value's index among them; an id out of its table's range
        raises ValueError naming the table."""
        return self.cache.unique_keys(_as_int64_cpu(values, "ids").reshape(-1).contiguous(), feature_counts,
                                      feature_tables)

    # ---- the step ---------------------------------------------------------------------------------
    def pool(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int], offsets: torch.Tensor,
             per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pools every bag of a batch of features in one call: `offsets` [bags + 1] (include_last_offset)
        over `values`; returns [bags, dim] of `dtype` on `device`. Backward updates the tables whose
        anchor (`anchors[t]`) requires a gradient."""
        self._check_open()
        device_lookup = None
        if self.device.type == "cuda":  # keyed, deduplicated and looked up on the device
            values = _as_int64(values, "ids", self.device).reshape(-1).contiguous()
            unique, inverse, words, slots, version, outside = self.cache.lookup_on_device(values, feature_counts,
                                                                                         feature_tables)
            device_lookup = (slots, version, outside)
        else:
            unique, inverse = self.unique_keys(values, feature_counts, feature_tables)
            words = self.cache.fetch(unique)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device=self.device, dtype=self.dtype)
        return _PooledLookup.apply(self, unique, inverse.to(self.device), offsets.to(self.device, non_blocking=True),
                                   self.weights_of(words), per_sample_weights, device_lookup, *self.anchors)

    def queue_update(self, unique: torch.Tensor, grads: torch.Tensor) -> None:
        """Queues one optimizer step (at the current `lr`) for distinct keys `unique`."""
        self._check_open()
        self.step += 1
        self.cache.queue_update(unique, grads.contiguous(), self.step, self.lr)

    def update_on_device(self, unique: torch.Tensor, slots: torch.Tensor, version: int, outside: int,
                         grads: torch.Tensor) -> None:
        """One optimizer step (at the current `lr`) for the distinct keys of a device lookup, on
        their slots (CUDA): `outside` of them (-1: unknown) are not cached."""
        self._check_open()
        self.step += 1
        self.cache.update_on_device(unique, slots, version, outside, grads.contiguous(), self.step, self.lr)

    def lookahead(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int]) -> None:
        """Starts reading a future batch's rows (as `pool` takes them) into memory; returns at once."""
        self._check_open()
        self.cache.lookahead(self.unique_keys(values, feature_counts, feature_tables)[0])

    # ---- rows -------------------------------------------------------------------------------------
    def weights_of(self, words: torch.Tensor) -> torch.Tensor:
        """[n, dim] weights of `dtype`, viewed in rows of 32-bit words."""
        if self.dtype == torch.float32:
            return words[:, : self.embedding_dim]
        return words.view(self.dtype)[:, : self.embedding_dim]

    def read_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """Current full rows (weights' words, then state) [n, row words] float32 of table `table`."""
        self._check_open()
        return self.cache.read_rows(self.keys(table, ids))

    def write_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._check_open()
        self.cache.write_rows(self.keys(table, ids), rows)

    def synchronize(self) -> None:
        self.cache.drain()

    def flush(self) -> None:
        """Applies queued updates and writes every changed row to the stores."""
        self.cache.write_back()
        for store in self.stores:
            store.flush()

    def stats(self, table: int) -> Dict[str, Any]:
        """Table `table`'s store counters and its part of the cache's (hits, misses, store reads,
        cached rows), beside the counters the tables share (pending updates, staleness, prefetch
        timing)."""
        cache = dict(self.cache.stats(), **self.cache.table_stats()[table])
        looked_up = cache["cache_hits"] + cache["cache_misses"]
        return dict(self.stores[table].stats(), **cache, cache_rows=self.cache_rows, step=self.step,
                    hit_rate=cache["cache_hits"] / looked_up if looked_up else 0.0)

    @property
    def closed(self) -> bool:
        return all(store.closed for store in self.stores)

    def _check_open(self) -> None:
        # Checked here, not by each store: rows still cached would be read (and written, then lost)
        # after the stores closed.
        if self._closed_by_close:
            names = ", ".join(repr(t.name) for t in self.tables)
            raise ValueError(f"table{'s' if len(self.tables) > 1 else ''} {names} "
                             f"{'are' if len(self.tables) > 1 else 'is'} closed")

    def close(self) -> None:
        """Applies queued updates, writes the cache back, checkpoints the stores and releases their directories."""
        if self.closed:
            return
        self._closed_by_close = True
        try:
            self.cache.close()
        finally:
            for store in self.stores:
                store.close()


class DiskRows:
    """Read access by index to the rows of a DiskEmbeddingBag (its ``weight``): every queued
    update applied, rows never written at their initial values, nothing materialised but the rows
    asked for. Indexes as a [num_embeddings, dim] tensor's first dimension: an int, a slice, or
    a 1-D tensor or list of ids."""

    def __init__(self, table: "DiskEmbeddingBag") -> None:
        self._table = table

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self._table.num_embeddings, self._table.embedding_dim])

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self._table.num_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self._table.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # rows are read out to host memory

    def __getitem__(self, index: Union[int, slice, Sequence[int], torch.Tensor]) -> torch.Tensor:
        n = self._table.num_embeddings
        if isinstance(index, slice):  # the slice's ids alone, not an arange over the whole table
            ids = range(n)[index]
            return self._table.export_rows(torch.arange(ids.start, ids.stop, ids.step))
        if is_int(index):
            if not -n <= index < n:
                raise IndexError(f"index {index} is out of range for a table of {n} rows")
            return self._table.export_rows(torch.tensor([index % n]))[0]
        ids = torch.as_tensor(index)
        if ids.dim() != 1:
            raise IndexError(f"index rows with an int, a slice or a 1-D list of ids, got shape {tuple(ids.shape)}")
        return self._table.export_rows(ids)

    def to_dense(self) -> torch.Tensor:
        """Every row (`DiskEmbeddingBag.snapshot`: file-backed when larger than the table's budget)."""
        return self._table.snapshot()

    def __repr__(self) -> str:
        return f"DiskRows(shape={tuple(self.shape)}, dtype={self.dtype}, path={self._table._store.path!r})"


def _as_int64(ids: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what} must be an int64 or int32 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    # To a GPU without blocking (from pinned memory the copy overlaps); to the host, blocking.
    return ids.to(device=device, dtype=torch.int64, non_blocking=device.type != "cpu")


def _as_int64_cpu(ids: torch.Tensor, what: str) -> torch.Tensor:
    return _as_int64(ids, what, torch.device("cpu"))  # the cache's index lives on the host


class DiskEmbeddingBag(nn.Module):
    """An embedding bag over a table larger than memory, trained by a fused sparse optimizer.

    Computes what ``torch.nn.EmbeddingBag`` computes (1-D input with offsets,
    2-D fixed-length bags, sum and mean, per_sample_weights with sum, empty
    bags, repeated ids); ``backward`` updates every touched row with
    `optimizer`, exactly as the matching torch optimizer would on a sparse
    gradient (with ``staleness=0``).

    Args:
        num_embeddings: rows in the table; ids must lie in [0, num_embeddings).
        embedding_dim: elements per row.
        path: the store's directory (created, or reopened with its rows).
        mode: "sum" or "mean".
        optimizer: a `mlkv_torch.optim` rule (SGD, Adagrad, RowWiseAdagrad, Adam).
        cache_rows: rows of the hot cache on `device`. Default (`split_host_memory`):
            what the budget holds after the staging area takes an eighth of it, the
            write-back buffer a thirty-second and the store's in-memory log an eighth
            (at least 16 KiB) on the CPU, each row with what the cache keeps beside it
            (`cache_host_bytes`); as many rows as the budget on a GPU.
        memory_budget_bytes: host memory for rows. On the CPU it holds the
            cache, the staging area and write-back buffer, and the store's
            in-memory log; on a GPU all but the cache (in device memory).
        staleness: updates a forward may miss per row (0: exact).
        dtype: float32, float16, bfloat16 or float64 weights (optimizer state stays float32).
        device: where the cache, the pooling and the output live (CPU or CUDA).
        seed: seed of the initial values of rows never written; default read from the state of torch's
            default generator (``torch.manual_seed`` makes runs reproducible). Recorded in the
            table's directory: a reopened table keeps its own.
        include_last_offset: as in nn.EmbeddingBag.
        expected_rows: sizes the store's index; default min(num_embeddings, 4M).
        cache_policy: "lfu" (frequency-based admission, the default) or "lru".
        first_column: this table holds columns [first_column, first_column +
            embedding_dim) of a wider table (a column shard); its initial rows
            are that slice of the wider table's.
        staging_bytes: bytes of rows for the staging area (rows read ahead by
            `lookahead`, rows the cache policy kept out until their update), inside
            the budget; default an eighth of the budget, at most 32 MiB of rows
            (`split_host_memory`).
        backend: the store under the cache: "mlkv" (the log-structured KVStore) or
            "rocksdb" (RocksDBStore, the offloading baseline; same cache, same op).
        reopen: continue from the rows and optimizer state `path` holds from an earlier run;
            without it such a path is refused (FileExistsError). The table reopens at its last
            `checkpoint()` (`close()` takes one), never at a state between two.

    Attributes:
        lr: the learning rate of the next updates; starts at ``optimizer.lr``,
            and a schedule may change it (a fused TorchRec optimizer's
            param_groups set it).

    Example::

        emb = DiskEmbeddingBag(10_000_000, 64, path="/data/t0", optimizer=optim.SGD(lr=0.1),
                               memory_budget_bytes=256 << 20)
        out = emb(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
        out.sum().backward()   # rows 1-4 are updated
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, path: Union[str, os.PathLike], mode: str = "sum",
                 optimizer: Optional[optim_lib.SparseOptimizer] = None, cache_rows: Optional[int] = None,
                 memory_budget_bytes: int = 64 << 20, staleness: int = 0, dtype: torch.dtype = torch.float32,
                 device: Optional[Union[str, torch.device]] = None, seed: Optional[int] = None,
                 include_last_offset: bool = False, expected_rows: Optional[int] = None, cache_policy: str = "lfu",
                 first_column: int = 0, staging_bytes: Optional[int] = None, backend: str = "mlkv",
                 reopen: bool = False) -> None:
        super().__init__()
        path = directory_path(path)
        name = os.path.basename(os.path.normpath(path))
        cut = read_cut(path) if reopen else None
        if cut is not None and len(cut["tables"]) == 1:  # its one table, whatever the directory is called now
            cut = dict(cut, tables={name: next(iter(cut["tables"].values()))})
        batch = DiskTableBatch(
            [DiskTable(name, num_embeddings, path,
                       draw_seed() if seed is None else seed, first_column, expected_rows, seed_drawn=seed is None)],
            embedding_dim, mode=mode, optimizer=optimizer, cache_rows=cache_rows,
            memory_budget_bytes=memory_budget_bytes, staleness=staleness, dtype=dtype, device=device,
            cache_policy=cache_policy, staging_bytes=staging_bytes, backend=backend, reopen=reopen,
            cut=cut)
        self._attach(batch, 0, include_last_offset)
        self._cut_directory: Optional[str] = path  # a table of its own records its cuts beside its store

    @classmethod
    def of_batch(cls, batch: DiskTableBatch, table: int, include_last_offset: bool = True) -> "DiskEmbeddingBag":
        """Table `table` of a DiskTableBatch, as a DiskEmbeddingBag (what a collection's
        ``embedding_bags[name]`` holds). Its forward runs the batch's kernel for this table alone;
        flush, synchronize and close act on the whole batch."""
        bag = cls.__new__(cls)
        nn.Module.__init__(bag)
        bag._attach(batch, table, include_last_offset)
        bag._cut_directory = None  # its owner records the batch's cuts
        return bag

    def _attach(self, batch: DiskTableBatch, table: int, include_last_offset: bool) -> None:
        spec = batch.tables[table]
        self._batch, self._table = batch, table
        self.num_embeddings = spec.num_embeddings
        self.embedding_dim = batch.embedding_dim
        self.mode = batch.mode
        self.optimizer = batch.optimizer
        self.staleness = batch.staleness
        self.dtype = batch.dtype
        self.device = batch.device
        self.seed = spec.seed
        self.memory_budget_bytes = batch.memory_budget_bytes
        self.cache_rows = batch.cache_rows
        self.backend = batch.backend
        self.include_last_offset = include_last_offset
        self._anchor = batch.anchors[table]
        self._store = batch.stores[table]
        self._cache = batch.cache

    @property
    def lr(self) -> float:
        """The learning rate of the next updates (shared by the tables of a batch); starts at
        ``optimizer.lr``, and a schedule may change it."""
        return self._batch.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._batch.lr = float(value)

    # ---- rows -------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Optimizer steps the table has taken (Adam's bias correction counts them); a restore
        from a checkpoint sets it."""
        return self._batch.step

    @steps.setter
    def steps(self, value: int) -> None:
        if not is_int(value) or value < 0:
            raise ValueError(f"steps must be a non-negative int, got {value!r}")
        self._batch.step = value

    @property
    def state_dim(self) -> int:
        """Optimizer state floats per row (0 for SGD)."""
        return self._batch.state_dim

    def export_rows(self, ids: torch.Tensor, include_state: bool = False
                    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Current weights [n, dim] (of `dtype`, on the CPU) of these rows, every queued update applied;
        with `include_state`, also their optimizer state [n, state_dim] (float32), from the same read."""
        words = self._batch.weight_words
        rows = self._batch.read_rows(self._table, _as_int64_cpu(ids, "ids").reshape(-1).contiguous())
        weights = self._batch.weights_of(rows[:, :words].contiguous()).clone()
        return (weights, rows[:, words:].clone()) if include_state else weights

    def import_rows(self, ids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor] = None) -> None:
        """Sets these rows' weights and optimizer state (default: the state of a row never updated)."""
        ids = _as_int64_cpu(ids, "ids").reshape(-1).contiguous()
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (ids.numel(), self.embedding_dim):
            raise ValueError(f"weights must be a tensor of shape [{ids.numel()}, {self.embedding_dim}]")
        if state is not None and (not isinstance(state, torch.Tensor)
                                  or tuple(state.shape) != (ids.numel(), self.state_dim)):
            raise ValueError(f"state must be a tensor of shape [{ids.numel()}, {self.state_dim}]")
        weights = weights.detach().to(device="cpu", dtype=self.dtype)
        if self.dtype != torch.float32:
            if self.embedding_dim * self.dtype.itemsize % 4:
                weights = torch.cat([weights, weights.new_zeros(ids.numel(), 1)], dim=1)
            weights = weights.contiguous().view(torch.float32)
        if state is None:
            state = self.optimizer.initial_state(ids.numel(), self.embedding_dim)
        state = state.detach().to(device="cpu", dtype=torch.float32)
        self._batch.write_rows(self._table, ids, torch.cat([weights, state], dim=1).contiguous())

    def lookahead(self, input: torch.Tensor) -> None:
        """Starts bringing the rows of `input` (any shape of ids) into memory; returns at once."""
        ids = _as_int64_cpu(input, "ids").reshape(-1).contiguous()
        self._batch.lookahead(ids, [ids.numel()], [self._table])

    @property
    def weight(self) -> "DiskRows":
        """The table's rows, read by index without materialising the table (``weight[ids]``,
        ``weight[a:b]``, ``weight.shape``; ``weight.to_dense()`` reads them all): what
        ``nn.EmbeddingBag.weight`` gives for inspection and export. Not a parameter: the fused
        optimizer trains the rows."""
        return DiskRows(self)

    # ---- all rows at once: snapshots and state_dict (the `weight` key of nn.EmbeddingBag) ------------
    _STATE_CHUNK_ROWS = 1 << 18

    def snapshot(self, include_state: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Every row's current weights [num_embeddings, dim] (with `include_state`, also the optimizer
        state [num_embeddings, state_dim]), read from the store chunk by chunk.

        A snapshot larger than the table's memory budget is written to a file-backed tensor in
        the table's directory (its file already unlinked: the disk space returns when the tensor
        dies), so tables larger than memory save without being materialised in memory.
        """
        weight, state = self._read_all(weights=True, state=include_state)
        return (weight, state) if include_state else weight

    def state_snapshot(self) -> torch.Tensor:
        """Every row's optimizer state [num_embeddings, state_dim], as `snapshot` (the weights
        are read with it but not kept)."""
        return self._read_all(weights=False, state=True)[1]

    def _row_chunks(self) -> Iterator[Tuple[torch.Tensor, slice]]:
        """The ids of every row, a chunk at a time, with the chunk's rows as a slice: a pass over
        the whole table never holds more than a chunk."""
        for start in range(0, self.num_embeddings, self._STATE_CHUNK_ROWS):
            stop = min(start + self._STATE_CHUNK_ROWS, self.num_embeddings)
            yield torch.arange(start, stop), slice(start, stop)

    def _read_all(self, weights: bool, state: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        n = self.num_embeddings
        nbytes = n * ((self.embedding_dim * self.dtype.itemsize if weights else 0)
                      + (4 * self.state_dim if state else 0))
        where = self._store.path if nbytes > self.memory_budget_bytes else None
        weight_out = _empty_rows((n, self.embedding_dim), self.dtype, where) if weights else None
        state_out = _empty_rows((n, self.state_dim), torch.float32, where) if state else None
        if isinstance(self._store, KVStore):
            self._scan_into(weight_out, state_out)
            return weight_out, state_out
        for ids, rows in self._row_chunks():
            if state_out is None:
                weight_out[rows] = self.export_rows(ids)
                continue
            chunk_weight, state_out[rows] = self.export_rows(ids, include_state=True)
            if weight_out is not None:
                weight_out[rows] = chunk_weight
        return weight_out, state_out

    def _scan_into(self, weight_out: Optional[torch.Tensor], state_out: Optional[torch.Tensor]) -> None:
        """Every row into the outputs: the rows never written generated, then the store's rows in one
        sequential pass over its log (`KVStore.scan`), rather than a 4 KiB read per row."""
        self._batch.flush()  # every queued update applied, every changed row in the store
        spec, dim, words = self._batch.tables[self._table], self.embedding_dim, self._batch.weight_words
        generated = torch.float32 if self.dtype == torch.float64 else self.dtype  # float64 rows start as float32's
        for ids, rows in self._row_chunks():
            if weight_out is not None:
                weight_out[rows] = spec.initial_rows(ids, dim, generated)
            if state_out is not None:
                state_out[rows] = self.optimizer.initial_state(ids.numel(), dim)
        for ids, stored in self._store.scan(self._STATE_CHUNK_ROWS):
            if weight_out is not None:
                weight_out[ids] = self._batch.weights_of(stored[:, :words].contiguous())
            if state_out is not None:
                state_out[ids] = stored[:, words:]

    def restore(self, weight: Optional[torch.Tensor] = None, state: Optional[torch.Tensor] = None) -> None:
        """Sets every row's weights from `weight` [num_embeddings, dim] and/or its optimizer state
        from `state` [num_embeddings, state_dim]; the part not given keeps its current value (as
        loading an nn.EmbeddingBag's weight keeps its optimizer's state). Rows go chunk by chunk:
        a file-backed tensor is never read into memory at once."""
        n = self.num_embeddings
        for name, given, width in (("weight", weight, self.embedding_dim), ("state", state, self.state_dim)):
            if given is not None and (not isinstance(given, torch.Tensor) or tuple(given.shape) != (n, width)):
                raise ValueError(f"{name} must be a tensor of shape [{n}, {width}], got "
                                 f"{list(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__}")
        if weight is None and state is None:
            return
        for ids, rows in self._row_chunks():
            if weight is None or (state is None and self.state_dim):
                current_weight, current_state = self.export_rows(ids, include_state=True)
            self.import_rows(ids, current_weight if weight is None else weight[rows],
                             (current_state if self.state_dim else None) if state is None else state[rows])

    def reset_parameters(self) -> None:
        """Every row back to its initial values and initial optimizer state (what a fresh table reads),
        as EmbeddingBagCollection's reset_parameters re-initialises its weights. Writes every row,
        chunk by chunk."""
        spec = self._batch.tables[self._table]
        generated = torch.float32 if self.dtype == torch.float64 else self.dtype  # float64 rows start as float32's
        for ids, _ in self._row_chunks():
            self.import_rows(ids, spec.initial_rows(ids, self.embedding_dim, generated))
        self._batch.flush()

    def populate(self) -> int:
        """Writes every row to the store, rows never written with their initial values (rows
        already written keep theirs), chunk by chunk; returns the rows. Training then reads rows
        from the store as in a table trained for a while, rather than generating fresh ones:
        benchmarks use it."""
        for ids, _ in self._row_chunks():
            weights, state = self.export_rows(ids, include_state=True)
            self.import_rows(ids, weights, state)
        self._batch.flush()
        return self.num_embeddings

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.snapshot()

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        key = prefix + "weight"
        if strict:  # as nn.Module reports keys under its prefix that name nothing of it
            unexpected_keys.extend(name for name in state_dict if name.startswith(prefix) and name != key
                                   and name[len(prefix):].split(".", 1)[0] not in self._modules)
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            self.restore(weight=state_dict[key])
        except ValueError as e:
            error_msgs.append(f"{key}: {e}")

    def synchronize(self) -> None:
        """Returns once every queued update is applied (export_rows and flush wait for them too)."""
        self._batch.synchronize()

    def flush(self) -> None:
        """Applies queued updates and writes every changed row to the store(s)."""
        self._batch.flush()

    def stats(self) -> Dict[str, Any]:
        """The store's counters, this table's part of the cache's (hits, misses, store reads,
        cached rows), the counters its batch shares (evictions, pending updates, largest staleness
        served, prefetch timing) and the optimizer step count."""
        return self._batch.stats(self._table)

    def checkpoint(self) -> Dict[str, Any]:
        """Takes a cut (`mlkv_torch.cut`): queued updates applied, the cache written back, the store
        checkpointed and the optimizer's step recorded beside it; ``reopen=True`` comes back to the
        last one, even after a crash. Returns the cut's record. A table of a collection is
        checkpointed by its collection."""
        if self._cut_directory is None:
            raise RuntimeError(f"table {self._batch.tables[self._table].name!r} shares its kernel with other "
                               f"tables: checkpoint the DiskEmbeddingBagCollection (or module) that holds it")
        return PendingCut(self._cut_directory, None, [self._batch.begin_checkpoint()]).wait()

    def close(self) -> None:
        """Applies queued updates, writes the cache back, checkpoints the store(s) and releases their
        directories; closes every table of the batch. A table of its own takes a last cut first."""
        if self._cut_directory is not None and not self._batch.closed:
            try:
                self.checkpoint()
            finally:
                self._batch.close()
            return
        self._batch.close()

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pools rows per bag, with torch.nn.EmbeddingBag's conventions; returns [bags, dim]."""
        ids = _as_int64_cpu(input, "ids")  # unique_keys checks the range in its pass
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (fixed-length bags)")
            bags, length = ids.shape
            offsets = torch.arange(bags + 1, dtype=torch.int64) * length
            ids = ids.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("offsets are required when input is 1-D")
            if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
                    or offsets.dim() != 1:
                raise TypeError("offsets must be a 1-D int64 or int32 tensor")
            offsets = offsets.to(device="cpu", dtype=torch.int64)
            if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                                    or int(offsets[-1]) > ids.numel()):
                raise ValueError("offsets must start at 0, not decrease, and not exceed the input length "
                                 f"{ids.numel()}")
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([ids.numel()], dtype=torch.int64)])
            elif offsets.numel() == 0 or int(offsets[-1]) != ids.numel():
                raise ValueError("with include_last_offset, the last offset must equal the input length")
        else:
            raise ValueError(f"input must be 1-D or 2-D, got shape {tuple(ids.shape)}")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError("per_sample_weights are only supported with mode='sum'")
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
                raise TypeError("per_sample_weights must be a floating-point tensor")
            if tuple(per_sample_weights.shape) != (ids.numel(),):
                raise ValueError("per_sample_weights must have the input's shape, got "
                                 f"{tuple(per_sample_weights.shape)}")
        ids = ids.contiguous()
        return self._batch.pool(ids, [ids.numel()], [self._table], offsets, per_sample_weights)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer}, "
                f"cache_rows={self.cache_rows}, staleness={self.staleness}, dtype={self.dtype}, device={self.device}, "
                f"path={self._store.path!r}" + (f", backend={self.backend!r}" if self.backend != "mlkv" else ""))
