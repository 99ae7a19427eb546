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

import contextlib
import os
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import _C
from . import optim as optim_lib
from .checks import is_int
from .cut import PendingCut, read_cut
from .disk_table import DiskTable, directory_path, draw_seed
from .store import KVStore
from .opening import open_table_batch
from .table_batch import DiskTableBatch, as_int64_cpu
from .written_through import WrittenThrough
# Names that moved to their own modules, still importable from here.
from .disk_table import TABLE_RECORD, destroy_table  # noqa: F401
from .memory_budget import (HostMemorySplit, MemoryBudgetError, buffer_host_bytes, cache_host_bytes,  # noqa: F401
                            host_memory_for_all_rows, least_host_memory, split_host_memory, stores_min_bytes)
from .table_settings import BACKENDS  # noqa: F401

__all__ = ["DiskEmbeddingBag", "DiskRows", "DiskTable", "DiskTableBatch", "HostMemorySplit", "host_memory_for_all_rows",
           "split_host_memory"]


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
                               f"{e.strerror} (a table of raw ids holds far fewer rows than its id space: declare it "
                               f"virtual, use_virtual_table=True, and its state dict holds its live rows)") from e
    finally:
        os.close(fd)
        os.unlink(name)
    return mapped.view(shape)


# A table's own facts, kept beside its store: the seed its rows never written derive from.


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


class _TableRowsOf:
    """A table's weights or optimizer state as a WrittenThrough tensor reads and writes them: a
    chunk of rows at a time, the other part of each row kept."""

    def __init__(self, table: "DiskEmbeddingBag", weights: bool) -> None:
        self._table, self._weights = table, weights

    def read(self, first: int, stop: int) -> torch.Tensor:
        rows = []
        for start in range(first, stop, DiskEmbeddingBag._STATE_CHUNK_ROWS):
            ids = torch.arange(start, min(stop, start + DiskEmbeddingBag._STATE_CHUNK_ROWS))
            weights, state = self._table.export_rows(ids, include_state=True)
            rows.append(weights if self._weights else state)
        return torch.cat(rows)

    def write(self, first: int, stop: int, rows: torch.Tensor) -> None:
        table = self._table
        for start in range(first, stop, table._STATE_CHUNK_ROWS):
            end = min(stop, start + table._STATE_CHUNK_ROWS)
            ids = torch.arange(start, end)
            weights, state = table.export_rows(ids, include_state=True)
            if self._weights:
                weights = rows[start - first:end - first]
            else:
                state = rows[start - first:end - first]
            table.import_rows(ids, weights, state if table.state_dim else None)


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
        expected_rows: pre-sizes the store's index for this many rows; by default it starts at
            a bucket (64 bytes) and grows with the rows written, whatever num_embeddings.
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
        batch = open_table_batch(
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
        rows = self._batch.read_rows(self._table, as_int64_cpu(ids, "ids").reshape(-1).contiguous())
        weights = self._batch.weights_of(rows[:, :words].contiguous()).clone()
        return (weights, rows[:, words:].clone()) if include_state else weights

    def import_rows(self, ids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor] = None) -> None:
        """Sets these rows' weights and optimizer state (default: the state of a row never updated)."""
        ids, words = self._row_words(ids, weights, state)
        self._batch.write_rows(self._table, ids, words)

    def load_rows(self, ids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor] = None) -> None:
        """`import_rows` straight to the store, past the cache (about 3x faster): for filling a table
        before it is trained (a reshard). ValueError once the cache holds rows."""
        ids, words = self._row_words(ids, weights, state)
        self._batch.load_rows(self._table, ids, words)

    @contextlib.contextmanager
    def filling(self) -> Iterator[Callable[..., None]]:
        """A writer of (ids, weights, state=None) chunks, `load_rows` chunk by chunk, for filling
        the table before it is trained: chunks whose ids increase from one to the next (rows read in
        key order, as `KVStore.scan(part="base")` gives them) go into an empty table's store once,
        straight into its base, where `load_rows` writes each twice once the rows outgrow the
        index's budget. The block's end makes them the table's."""
        with self._batch.filling(self._table) as write_words:
            def write(ids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor] = None) -> None:
                write_words(*self._row_words(ids, weights, state))
            yield write

    def _row_words(self, ids: torch.Tensor, weights: torch.Tensor, state: Optional[torch.Tensor]
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, stored rows [n, row words] float32) of weights and optimizer state, checked."""
        ids = as_int64_cpu(ids, "ids").reshape(-1).contiguous()
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
        return ids, torch.cat([weights, state], dim=1).contiguous()

    def lookahead(self, input: torch.Tensor) -> None:
        """Starts bringing the rows of `input` (any shape of ids) into memory; returns at once."""
        ids = as_int64_cpu(input, "ids").reshape(-1).contiguous()
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

    def written_through_snapshot(self, part: str = "weight") -> WrittenThrough:
        """`snapshot` (part "weight") or `state_snapshot` (part "state") as a state dict holds it: a
        tensor whose in-place writes reach the table's rows, as writes to a module's parameter in
        its state dict reach the module (`written_through.WrittenThrough`)."""
        if part not in ("weight", "state"):
            raise ValueError(f"part must be 'weight' or 'state', got {part!r}")
        rows = self.snapshot() if part == "weight" else self.state_snapshot()
        return WrittenThrough.of(rows, _TableRowsOf(self, part == "weight"))

    def state_snapshot(self) -> torch.Tensor:
        """Every row's optimizer state [num_embeddings, state_dim], as `snapshot` (the weights
        are read with it but not kept)."""
        return self._read_all(weights=False, state=True)[1]

    def _row_chunks(self) -> Iterator[Tuple[torch.Tensor, slice]]:
        """The ids of every row, a chunk at a time, with the chunk's rows as a slice: a pass over
        the whole table never holds more than a chunk."""
        self._refuse_if_virtual("a pass over every row")
        for start in range(0, self.num_embeddings, self._STATE_CHUNK_ROWS):
            stop = min(start + self._STATE_CHUNK_ROWS, self.num_embeddings)
            yield torch.arange(start, stop), slice(start, stop)

    def _read_all(self, weights: bool, state: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        self._refuse_if_virtual("a snapshot of every row")
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
        chunk by chunk; a virtual table deletes its live rows instead."""
        if self.virtual:
            self._batch.delete_rows(self._table, self.live_ids())
            return
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
        # Once, after the pass: trimming during training would give back the training thread's
        # free pages too, which it would then fault in again every step.
        _C.return_free_heap()
        return self.num_embeddings

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self.virtual:  # its live ids and their rows, as TorchRec's virtual tables save theirs
            ids = self.live_ids()
            destination[prefix + "weight_id"] = ids
            destination[prefix + "weight"] = self._rows_of(ids)
            return
        destination[prefix + "weight"] = self.written_through_snapshot()

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        key = prefix + "weight"
        keys = (key, prefix + "weight_id") if self.virtual else (key,)
        if strict:  # as nn.Module reports keys under its prefix that name nothing of it
            unexpected_keys.extend(name for name in state_dict if name.startswith(prefix) and name not in keys
                                   and name[len(prefix):].split(".", 1)[0] not in self._modules)
        missing = [k for k in keys if k not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        try:
            if self.virtual:
                self.replace_live_rows(state_dict[prefix + "weight_id"], state_dict[key])
            else:
                self.restore(weight=state_dict[key])
        except ValueError as e:
            error_msgs.append(f"{key}: {e}")

    # ---- a virtual table's live rows -------------------------------------------------------------
    @property
    def virtual(self) -> bool:
        """A virtual table (TorchRec's ``use_virtual_table``): rows only for the ids looked up and
        kept, its state its live ids' rows."""
        return self._batch.tables[self._table].id_policy is not None

    @property
    def follows_ids(self) -> bool:
        """A virtual table whose ids' lookups and ages are kept (an eviction policy or a frequency
        filter)."""
        policy = self._batch.tables[self._table].id_policy
        return policy is not None and policy.tracked

    def restore_id_activity(self, ids: torch.Tensor, counts: torch.Tensor, last: torch.Tensor,
                            holds_row: torch.Tensor, evicted: int = 0) -> None:
        """Sets the lookups counted, the time of the last lookup and whether each holds a row of a
        virtual table's ids (`virtual_tables.IdsActivity`), and the ids its eviction rounds removed
        so far (`stats()["evicted_ids"]`): a table filled from another world's tables keeps its
        ids' history."""
        self._batch.restore_activity(self._table, ids, counts, last, holds_row, evicted)

    def _refuse_if_virtual(self, what: str) -> None:
        if self.virtual:
            raise ValueError(f"table {self._batch.tables[self._table].name!r} is virtual, an id space of "
                             f"{self.num_embeddings:,} rows: {what} is not possible; its rows are its live ids' "
                             f"(live_ids(), export_live(), or state_dict())")

    def live_ids(self) -> torch.Tensor:
        """The ids that hold rows, sorted, every queued update applied first (for a virtual table,
        its live set: the ids trained and not evicted)."""
        if not isinstance(self._store, KVStore):
            raise ValueError(f"live_ids needs the 'mlkv' backend (a scan of the store), not {self.backend!r}")
        self._batch.flush()
        chunks = [keys for keys, _ in self._store.scan(self._STATE_CHUNK_ROWS)]
        return torch.unique(torch.cat(chunks)) if chunks else torch.empty(0, dtype=torch.int64)

    def export_live(self, chunk_rows: int = 1 << 16, include_state: bool = False) -> Iterator[Tuple[torch.Tensor, ...]]:
        """The live ids and their rows in id order, chunk by chunk: (ids [n], weights [n, dim]), with
        `include_state` also (optimizer state [n, state_dim]); what a serving system loads. Only the
        ids (8 bytes each) and one chunk of rows are in memory at once."""
        if not is_int(chunk_rows) or chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        ids = self.live_ids()
        for start in range(0, ids.numel(), chunk_rows):
            chunk = ids[start:start + chunk_rows]
            rows = self.export_rows(chunk, include_state)
            yield (chunk, *rows) if include_state else (chunk, rows)

    def export_changes(self, chunk_rows: int = 1 << 16, include_state: bool = False
                       ) -> Tuple[Iterator[Tuple[torch.Tensor, ...]], torch.Tensor]:
        """What changed since the last cut (`checkpoint`), for a serving copy that holds the table as
        it was there: (chunks of the ids looked up since and holding rows, with their rows, in id
        order, as `export_live` gives them; the tombstones: ids that held rows at the cut and hold
        none now, which the copy deletes). Both are bounded by the ids holding rows, however many
        ids came and went since the cut.
        A virtual table with an eviction policy or a frequency filter only (it follows its ids)."""
        if not is_int(chunk_rows) or chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        self._batch.synchronize()
        ids, tombstones = self._batch.changes(self._table)

        def chunks() -> Iterator[Tuple[torch.Tensor, ...]]:
            for start in range(0, ids.numel(), chunk_rows):
                chunk = ids[start:start + chunk_rows]
                rows = self.export_rows(chunk, include_state)
                yield (chunk, *rows) if include_state else (chunk, rows)
        return chunks(), tombstones

    def _rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of `ids` [n, dim], in a file-backed tensor when larger than the budget."""
        where = self._store.path if ids.numel() * self.embedding_dim * self.dtype.itemsize > \
            self.memory_budget_bytes else None
        out = _empty_rows((ids.numel(), self.embedding_dim), self.dtype, where)
        for start in range(0, ids.numel(), self._STATE_CHUNK_ROWS):
            out[start:start + self._STATE_CHUNK_ROWS] = self.export_rows(ids[start:start + self._STATE_CHUNK_ROWS])
        return out

    def replace_live_rows(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """A virtual table holds exactly `ids` from now on, with rows `weights` (a state dict's
        ``weight_id`` and ``weight``): its other live rows are deleted."""
        ids = as_int64_cpu(ids, "weight_id").reshape(-1).contiguous()
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (ids.numel(), self.embedding_dim):
            raise ValueError(f"weight must be a tensor of shape [{ids.numel()}, {self.embedding_dim}] (one row per "
                             f"weight_id), got {list(weights.shape) if isinstance(weights, torch.Tensor) else weights}")
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError("weight_id holds an id twice")
        self._batch.delete_rows(self._table, self.live_ids())
        for start in range(0, ids.numel(), self._STATE_CHUNK_ROWS):
            self.import_rows(ids[start:start + self._STATE_CHUNK_ROWS], weights[start:start + self._STATE_CHUNK_ROWS])

    def evict(self) -> int:
        """Runs one eviction round of a virtual table's policy now (rounds also run by themselves
        when its trigger is passed); returns the rows evicted."""
        return self._batch.evict(self._table)

    def synchronize(self) -> None:
        """Returns once every queued update is applied (export_rows and flush wait for them too)."""
        self._batch.synchronize()

    def flush(self) -> None:
        """Applies queued updates and writes every changed row to the store(s)."""
        self._batch.flush()

    def stats(self) -> Dict[str, Any]:
        """The store's counters, this table's part of the cache's (hits, misses, store reads,
        cached rows), the counters its batch shares (evictions, pending updates, largest staleness
        served, read-ahead timing) and the optimizer step count."""
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
        ids = as_int64_cpu(input, "ids")  # unique_keys checks the range in its pass
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
        return self._batch.pool(ids, [ids.numel()], [self._table], offsets, per_sample_weights, training=self.training)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer}, "
                f"cache_rows={self.cache_rows}, staleness={self.staleness}, dtype={self.dtype}, device={self.device}, "
                f"path={self._store.path!r}" + (f", backend={self.backend!r}" if self.backend != "mlkv" else ""))
