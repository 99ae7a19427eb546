"""The table-batched disk kernel: DiskTableBatch (the tables of one row layout, one cache, one
lookup and one optimizer pass a batch) and its autograd glue."""
from __future__ import annotations

import atexit
import contextlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import _C
from .cache_keys import cache_key, row_of, table_of
from .checks import is_int
from .cut import CutPart, check_cut
from .disk_table import DiskTable, settle_reopened
from .memory_budget import HostMemorySplit, index_budgets
from .row_layout import RowLayout
from .store import KVStore, RocksDBStore
from .table_settings import BatchSettings
from .virtual_tables import KernelIds

MODES = ("sum", "mean")  # how a bag pools its rows
_WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}  # the cache's codes
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
                device_lookup: Optional[Tuple[torch.Tensor, int, int]], holds_row: Optional[torch.Tensor],
                *anchors: torch.Tensor) -> torch.Tensor:
        ctx.sorted_backward = None  # (offset2bag, bag_size, max_indices) of the forward, for the sorted backward
        if batch.bag_backward == "sorted" and per_sample_weights is None and weights.dtype == torch.float32:
            out, offset2bag, bag_size, max_indices = torch.ops.aten._embedding_bag(
                weights, inverse, offsets, False, MODES.index(batch.mode), False, None, True, -1)
            ctx.sorted_backward = (offset2bag, bag_size, max_indices)
        else:
            out = F.embedding_bag(inverse, weights, offsets, mode=batch.mode, per_sample_weights=per_sample_weights,
                                  include_last_offset=True)
        ctx.batch = batch
        ctx.device_lookup = device_lookup  # (slots, index version, rows not cached) of a device lookup
        ctx.holds_row = holds_row  # keys that hold rows (a virtual table's filter): the others' gradients are dropped
        psw_needs_grad = per_sample_weights is not None and ctx.needs_input_grad[5]
        ctx.save_for_backward(unique, inverse, offsets, weights if psw_needs_grad else None, per_sample_weights)
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        batch: DiskTableBatch = ctx.batch
        unique, inverse, offsets, weights, per_sample_weights = ctx.saved_tensors
        if ctx.sorted_backward is not None:
            # torch's own dense backward: the values sorted by row, each row's gradients summed in one
            # pass, where the other path gathers a gradient row per value and adds them atomically.
            grads = torch.ops.aten._embedding_bag_backward(
                grad_out.contiguous(), inverse, offsets, *ctx.sorted_backward, unique.numel(), False,
                MODES.index(batch.mode), False, None, -1)
            grad_psw = None
        elif grad_out.device.type == "cpu":
            grads, grad_psw = _C.bag_backward(grad_out, offsets, inverse, unique.numel(), batch.mode == "mean",
                                              per_sample_weights, weights)
        else:
            grads, grad_psw = _bag_backward_torch(grad_out, offsets, inverse, unique.numel(), batch.mode == "mean",
                                                  per_sample_weights, weights)
        if grad_psw is not None:
            grad_psw = grad_psw.to(per_sample_weights.dtype)
        trains = ctx.needs_input_grad[8:]
        if ctx.device_lookup is not None:
            slots, version, outside = ctx.device_lookup
            if all(trains):
                batch.update_on_device(unique, slots, version, outside, grads)
            elif any(trains):  # some tables frozen: their rows keep their values
                keep = torch.tensor(trains, device=unique.device).index_select(
                    0, table_of(unique))
                batch.update_on_device(unique[keep], slots[keep], version, -1, grads[keep])
        elif all(trains) and ctx.holds_row is None:
            batch.queue_update(unique, grads)
        elif any(trains):  # some tables frozen (requires_grad_(False)), or keys filtered: their rows stay
            keep = torch.tensor(trains).index_select(0, table_of(unique))
            if ctx.holds_row is not None:
                keep &= ctx.holds_row
            if bool(keep.any()):
                batch.queue_update(unique[keep].contiguous(), grads[keep.to(grads.device)])
        # A training table's anchor gets its (empty) gradient: data-parallel wrappers (DDP) expect
        # every parameter that takes part in the forward to receive one.
        anchor_grads = tuple(torch.zeros(shape, dtype=dtype, device=device) if train else None
                             for train, (shape, dtype, device) in zip(trains, ctx.anchors))
        return (None, None, None, None, None, grad_psw, None, None) + anchor_grads


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


def _cache_init(table: DiskTable) -> Tuple[bool, float, float]:
    """The (normal, a, b) a cache table's initial rows take (see EmbeddingCache's table tuple)."""
    kind, a, b = table.initial_distribution()
    return kind == "normal", a, b


def _as_int64(ids: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = str(ids.dtype) if isinstance(ids, torch.Tensor) else type(ids).__name__  # a numpy array has a dtype too
        raise TypeError(f"{what} must be an int64 or int32 tensor, got {got}")
    # To a GPU without blocking (from pinned memory the copy overlaps); to the host, blocking.
    return ids.to(device=device, dtype=torch.int64, non_blocking=device.type != "cpu")


def as_int64_cpu(ids: torch.Tensor, what: str) -> torch.Tensor:
    """`ids` as an int64 CPU tensor; TypeError naming `what` for another dtype."""
    return _as_int64(ids, what, torch.device("cpu"))  # the cache's index lives on the host


@dataclass(frozen=True)
class TableBatchSpec:
    """Everything a DiskTableBatch is opened from but its device and cut: its tables, their row
    layout and pooling, its share of the memory budget and how that share is spent
    (`memory_budget.plan_host_memory`), and the settings it shares. `opening.open_tables` makes
    them."""

    tables: Tuple[DiskTable, ...]
    layout: RowLayout
    mode: str
    memory_budget_bytes: int
    memory: HostMemorySplit
    settings: BatchSettings = BatchSettings()

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("a table batch needs at least one table")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def resolve_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """Where a batch computes: the CPU by default; a CUDA device by index (the current one when
    none is named). ValueError when CUDA is asked for and torch sees none."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DiskTableBatch:
    """The table-batched disk kernel: tables of one row layout (dim, weight type, optimizer,
    pooling) behind one hot cache, as FBGEMM's table-batched embeddings are.

    A batch of every table's features is deduplicated, fetched (misses read from each table's
    store in one batched read per table), pooled in one ``embedding_bag`` call and updated by one
    fused optimizer pass over its distinct rows; one applier and one read-ahead thread serve all
    the tables. A cached row of table t, id i, is keyed ``(t << table_shift) | i``, so admission
    and eviction weigh every table's rows against each other by frequency.

    Opened by `mlkv_torch.opening.open_tables` (or `open_table_batch` for one batch), which plans
    its memory; DiskEmbeddingBag is the one-table case, and DiskEmbeddingBagCollection and the
    sharded disk kernel open one batch per row layout and view each table as a DiskEmbeddingBag.

    `bag_backward` says how backward reduces a batch's gradients to one row per distinct key on a
    GPU (the CPU has its own kernel, `_C.bag_backward`, unless "sorted" is asked for): "index_add"
    (a gradient row gathered per value, added atomically; the default) or
    "sorted" (torch's own embedding-bag backward: values sorted by row, each row summed in one
    pass; float32 weights without per-sample weights). `benchmarks/bench_gpu.py` measures both.

    Args:
        spec: the tables, their layout, the memory plan and the settings (`TableBatchSpec`).
        device: where the cache, the pooling and the output live (CPU or CUDA).
        reopen: continue from the rows and optimizer state that the tables' directories hold
            from an earlier run; without it, a directory holding rows is refused
            (FileExistsError), so a second run of a script never continues silently.
        cut: reopen every table at this cut (a record `checkpoint` returned, `mlkv_torch.cut`):
            each store at the checkpoint it names, the optimizer at its step. ValueError names a
            table whose store has moved past it or is missing from it.
        read_ahead_into_slots: rows read ahead (`lookahead`) go straight into cache slots, through
            pinned buffers and a side stream on CUDA, and stay until their batch is done; each
            `pool` takes the read-aheads in the order they were asked for. Default: on CUDA only
            (there it lets batches read ahead run on the device alone), and never for virtual
            tables (refused: their eviction rounds). Off, they wait in the staging area for their
            fetch.
        transfer_delay_us: on the CPU, each copy into slots lands this many microseconds late
            (tests hold copies in flight with it).
    """

    def __init__(self, spec: TableBatchSpec, *, device: Optional[Union[str, torch.device]] = None,
                 reopen: bool = False, cut: Optional[Dict[str, Any]] = None,
                 read_ahead_into_slots: Optional[bool] = None, transfer_delay_us: int = 0) -> None:
        if not is_int(transfer_delay_us) or transfer_delay_us < 0:
            raise ValueError(f"transfer_delay_us must be a non-negative int, got {transfer_delay_us!r}")
        device = resolve_device(device)
        # A virtual table's eviction round between a read-ahead and its batch would leave the rows
        # of the ids it evicted in the slots they were read into: its rows wait in the staging area.
        follows_ids = any(t.id_policy is not None and t.id_policy.tracked for t in spec.tables)
        if read_ahead_into_slots is None:
            read_ahead_into_slots = device.type == "cuda" and not follows_ids
        elif read_ahead_into_slots and follows_ids:
            raise ValueError("read_ahead_into_slots: virtual tables (tables with an IdPolicy) read ahead into the "
                             "staging area: an eviction round between a read-ahead and its batch would leave the "
                             "evicted ids' rows in their slots")
        layout, settings, optimizer = spec.layout, spec.settings, spec.layout.optimizer
        self.spec = spec
        self.read_ahead_into_slots = bool(read_ahead_into_slots)
        self.bag_backward = "index_add"
        self.tables = list(spec.tables)
        self._closed_by_close = False  # set by close(): every operation refuses from then on
        self.embedding_dim = layout.embedding_dim
        self.mode = spec.mode
        self.optimizer = optimizer
        self.lr = float(optimizer.lr)
        self.staleness = settings.staleness
        self.dtype = layout.dtype
        self.device = device
        self.memory_budget_bytes = spec.memory_budget_bytes
        self.state_dim = layout.state_dim
        self.weight_words = layout.weight_words
        self.row_bytes = layout.row_bytes
        self.cache_rows, self.staging_rows, self.write_back_rows = (
            spec.memory.cache_rows, spec.memory.staging_rows, spec.memory.write_back_rows)
        log_bytes = spec.memory.log_bytes
        self.step = 0
        self.backend = settings.backend
        # One empty parameter per table: autograd runs backward through it and tells which tables train.
        # [0, dim]: TorchRec's row-wise optimizers (apply_optimizer_in_backward) build on it without failing.
        self.anchors = [nn.Parameter(torch.empty(0, self.embedding_dim)) for _ in self.tables]
        at_cut = self._entries_at(cut) if cut is not None else None
        self.stores: List[Union[KVStore, RocksDBStore]] = []
        index_budget = index_budgets(spec.memory.index_bytes, [t.num_embeddings for t in self.tables])
        try:
            for i, t in enumerate(self.tables):
                if self.backend == "rocksdb":
                    self.stores.append(RocksDBStore(t.path, self.weight_words + self.state_dim, torch.float32,
                                                    log_bytes))
                    continue
                checkpoint = at_cut[i]["checkpoint"] if at_cut else None
                try:
                    # Cut checkpoints: the store moves only when its tables' owner takes a cut.
                    self.stores.append(KVStore(t.path, self.weight_words + self.state_dim, torch.float32, log_bytes,
                                               expected_rows=t.expected_rows or 0,
                                               mutable_fraction=_STORE_MUTABLE_FRACTION, cut_checkpoints=True,
                                               checkpoint=checkpoint,
                                               index_budget_bytes=index_budget[i], key_limit=t.num_embeddings))
                except ValueError as e:
                    if checkpoint is None:
                        raise
                    raise ValueError(f"table {t.name!r} cannot reopen at the cut {cut.get('label')!r} (its store's "
                                     f"checkpoint {checkpoint}): {e}") from e
            self.tables = settle_reopened(self.tables, self.stores, reopen or cut is not None)
            if at_cut:
                self.step = max(entry["step"] for entry in at_cut)
            eps, beta1, beta2 = optimizer.rule_constants()
            self.cache = _C.EmbeddingCache(
                [(t.name, store._store, t.num_embeddings, int(t.seed), *_cache_init(t), t.first_column, t.first_row)
                 for t, store in zip(self.tables, self.stores)],
                capacity=self.cache_rows, dim=self.embedding_dim, weight_type=_WEIGHT_TYPES[self.dtype],
                kind=optimizer.kind, eps=eps, beta1=beta1, beta2=beta2,
                initial_state=optimizer.initial_state(1, self.embedding_dim).flatten().tolist(),
                policy=settings.cache_policy, staleness=self.staleness, device=str(device),
                staging_rows=self.staging_rows, write_back_rows=self.write_back_rows,
                read_ahead_into_slots=self.read_ahead_into_slots, transfer_delay_us=transfer_delay_us)
            self.ids = self._open_ids(at_cut[0]["step"] if at_cut else None, reopen or cut is not None)
        except BaseException:
            for store in self.stores:
                store.close()
            raise
        _OPEN_BATCHES.add(self)

    def _open_ids(self, cut_step: Optional[int], reopened: bool) -> Optional[KernelIds]:
        """The ids of the tables with an IdPolicy (virtual tables), as the cut left them: restored
        from the file saved with it; a table reopened without one counts each id it holds as
        looked up once, now."""
        policies = [t.id_policy for t in self.tables]
        if not any(p is not None and p.tracked for p in policies):
            return None
        ids = KernelIds(policies, [(t.name, t.first_row, t.first_column) for t in self.tables])
        if cut_step is not None and ids.saved(self.tables[0].path, cut_step):
            ids.load(self.tables[0].path, cut_step)
        elif reopened:
            for t, (table, store) in enumerate(zip(self.tables, self.stores)):
                if policies[t] is not None and policies[t].tracked and isinstance(store, KVStore):
                    for keys, _ in store.scan():
                        ids.adopt(self.keys(t, keys), policies[t].admit_after, self.step)
        return ids

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
        if self.ids is not None:  # the ids' activity at the same boundary, beside the first table
            self.ids.save(self.tables[0].path, step)
            self.ids.mark()
        written: List[int] = []

        def finish() -> Dict[str, Dict[str, Optional[int]]]:
            written[:] = self.cache.finish_cut()
            return {t.name: {"checkpoint": sequence or None, "step": step} for t, sequence in zip(self.tables, written)}

        def commit() -> None:
            for store, sequence in zip(self.stores, written):
                if sequence and isinstance(store, KVStore):
                    store.commit_checkpoint(sequence)
            if self.ids is not None:
                self.ids.prune(self.tables[0].path, step)
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
        return cache_key(table, ids) if table else ids

    def unique_keys(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Distinct keys of a batch of features (`values` feature after feature, feature_counts[f] ids
        of table feature_tables[f]) and each value's index among them; an id out of its table's range
        raises ValueError naming the table."""
        return self.cache.unique_keys(as_int64_cpu(values, "ids").reshape(-1).contiguous(), feature_counts,
                                      feature_tables)

    # ---- the step ---------------------------------------------------------------------------------
    def pool(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int], offsets: torch.Tensor,
             per_sample_weights: Optional[torch.Tensor] = None, read_ahead: Optional[int] = None,
             training: bool = True) -> torch.Tensor:
        """Pools every bag of a batch of features in one call: `offsets` [bags + 1] (include_last_offset)
        over `values`; returns [bags, dim] of `dtype` on `device`. Backward updates the tables whose
        anchor (`anchors[t]`) requires a gradient.

        `read_ahead`: the ticket `lookahead` returned for this batch, which must have the same ids
        (its features are checked, its ids are not). With `read_ahead_into_slots` the lookup then
        takes the read-ahead's deduplication and slots: no host synchronisation on CUDA, no second
        deduplication on the CPU. Older read-aheads not yet pooled are let go; a ticket no longer
        waiting (pooled already, or dropped after 64 later read-aheads) raises ValueError. Ignored by
        virtual tables and without read-ahead into slots.

        `training` False (the module in eval mode): virtual tables count, admit and evict no id,
        and ids holding no row read zeros (an evaluation leaves the tables as training left them)."""
        self._check_open()
        device_lookup = holds_row = None
        if read_ahead is not None and not is_int(read_ahead):
            raise TypeError(f"read_ahead takes the ticket lookahead returned, got {read_ahead!r}")
        if read_ahead is not None and self.ids is None and self.read_ahead_into_slots:
            if values.numel() != sum(feature_counts):
                raise ValueError(f"the features hold {sum(feature_counts)} ids, values has {values.numel()}")
            unique, inverse, words, slots, version, outside = self.cache.lookup_read_ahead(
                read_ahead, list(feature_counts), list(feature_tables))
            if self.device.type == "cuda":
                device_lookup = (slots, version, outside)
        elif self.ids is not None:  # virtual tables: rounds due first, then the batch's ids counted and filtered
            unique, inverse = self.unique_keys(values, feature_counts, feature_tables)
            if training:
                self.ids.evict_due(self.cache, self.step)
                holds_row = self.ids.observe(unique, self.step)
            else:
                holds_row = self.ids.read(unique)
            if holds_row is None:
                words = self.cache.fetch(unique)
            else:  # ids not yet admitted read zeros and create no row
                words = torch.zeros(unique.numel(), self.weight_words, dtype=torch.float32, device=self.device)
                if bool(holds_row.any()):
                    words[holds_row.to(self.device)] = self.cache.fetch(unique[holds_row].contiguous())
        elif self.device.type == "cuda":  # keyed, deduplicated and looked up on the device
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
                                   self.weights_of(words), per_sample_weights, device_lookup, holds_row, *self.anchors)

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

    def read_ahead_waiting(self, ticket: int) -> bool:
        """Whether the read-ahead with `ticket` still waits for `pool` to take it (not looked up,
        not let go: a pool without a ticket lets go of the read-aheads before its own)."""
        self._check_open()
        return self.cache.read_ahead_waiting(ticket)

    def lookahead(self, values: torch.Tensor, feature_counts: List[int], feature_tables: List[int]) -> int:
        """Starts reading a future batch's rows (as `pool` takes them) into memory; returns at once,
        with the read-ahead's ticket (`pool`'s `read_ahead`). Pools take read-aheads in order: read
        ahead the batches in the order they will be pooled."""
        self._check_open()
        values = as_int64_cpu(values, "ids").reshape(-1).contiguous()
        return self.cache.lookahead(values, feature_counts, feature_tables)

    # ---- rows -------------------------------------------------------------------------------------
    def weights_of(self, words: torch.Tensor) -> torch.Tensor:
        """[n, dim] weights of `dtype`, viewed in rows of 32-bit words."""
        return self.spec.layout.weights_of(words)

    def read_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """Current full rows (weights' words, then state) [n, row words] float32 of table `table`."""
        self._check_open()
        return self.cache.read_rows(self.keys(table, ids))

    def write_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._check_open()
        keys = self.keys(table, ids)
        self.cache.write_rows(keys, rows)
        self._adopt(table, keys)

    def _adopt(self, table: int, keys: torch.Tensor) -> None:
        """Rows written (not trained) to a virtual table are live from now on."""
        policy = self.tables[table].id_policy
        if self.ids is not None and policy is not None and policy.tracked:
            self.ids.adopt(keys, policy.admit_after, self.step)

    def load_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """`write_rows` straight to table `table`'s store, past the cache: for filling tables before
        they are trained. ValueError once the cache holds rows (they would shadow the store's)."""
        self._check_open()
        keys = self.keys(table, ids)
        self._check_untrained(table)
        self.stores[table].put(ids, rows)
        self._adopt(table, keys)

    @contextlib.contextmanager
    def filling(self, table: int) -> Iterator[Callable[[torch.Tensor, torch.Tensor], None]]:
        """A writer of (ids, rows) chunks into table `table`'s store, past the cache, for filling it
        before it is trained (`load_rows` chunk by chunk, the store's `filling`: chunks whose ids
        increase from one to the next go into an empty store once, straight into its base, where
        puts write each row twice past the index's budget). ValueError once the cache holds rows."""
        self._check_open()
        self._check_untrained(table)

        def write(ids: torch.Tensor, rows: torch.Tensor) -> None:
            keys = self.keys(table, ids)
            write_store(ids, rows)
            self._adopt(table, keys)

        with self.stores[table].filling(self.tables[table].num_embeddings) as write_store:
            yield write

    def _check_untrained(self, table: int) -> None:
        """ValueError once the cache holds rows (they would shadow the store's); waits for the rows
        written before to reach the store, so none overwrites a row loaded after."""
        if self.cache.stats()["cached_rows"]:
            raise ValueError(f"table {self.tables[table].name!r}: its cache holds rows; load_rows fills a table "
                             f"before it is trained (write_rows writes through the cache)")
        self.cache.write_back()

    def restore_activity(self, table: int, ids: torch.Tensor, counts: torch.Tensor, last: torch.Tensor,
                         holds_row: torch.Tensor, evicted: int = 0) -> None:
        """Sets the activity of table `table`'s ids (`virtual_tables.IdsActivity`, ids local to the
        table) to a saved one, and the ids its rounds evicted so far: a table filled from another
        world's (a reshard). ValueError for a table that follows no ids."""
        self._check_open()
        policy = self.tables[table].id_policy
        if self.ids is None or policy is None or not policy.tracked:
            raise ValueError(f"table {self.tables[table].name!r} follows no ids (a virtual table with an eviction "
                             f"policy or a frequency filter does)")
        self.ids.replace(table, self.keys(table, as_int64_cpu(ids, "ids").reshape(-1).contiguous()), counts, last,
                         holds_row, evicted)

    def delete_rows(self, table: int, ids: torch.Tensor) -> None:
        """Deletes rows `ids` of table `table` from the cache and the store: they read their initial
        rows again, and a virtual table's ids are forgotten."""
        self._check_open()
        keys = self.keys(table, as_int64_cpu(ids, "ids").reshape(-1).contiguous())
        if not keys.numel():
            return
        deleted = self.cache.delete_rows(keys)
        if self.ids is not None:
            self.ids.activity.forget(keys[deleted].contiguous())

    def changes(self, table: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Ids of table `table` that hold rows and were looked up since the last cut, and ids that
        held rows at the cut and hold none now (sorted): an incremental export's rows and tombstones."""
        policy = self.tables[table].id_policy
        if self.ids is None or policy is None or not policy.tracked:
            raise ValueError(f"table {self.tables[table].name!r} follows no ids (a virtual table with an eviction "
                             f"policy or a frequency filter does): export_live() exports it whole")
        touched, gone = self.ids.changes(lambda keys: table_of(keys) == table)
        return row_of(touched), row_of(gone)

    def evict(self, table: int) -> int:
        """One eviction round of table `table`'s IdPolicy now; returns the rows evicted."""
        self._check_open()
        policy = self.tables[table].id_policy
        if self.ids is None or policy is None or not policy.tracked:
            raise ValueError(f"table {self.tables[table].name!r} has no eviction policy (a virtual table's "
                             f"virtual_table_eviction_policy)")
        return self.ids.evict(self.cache, table, self.step)

    def synchronize(self) -> None:
        self.cache.drain()

    def flush(self) -> None:
        """Applies queued updates and writes every changed row to the stores."""
        self.cache.write_back()
        for store in self.stores:
            store.flush()

    def stats(self, table: int) -> Dict[str, Any]:
        """Table `table`'s store counters and its part of the cache's (hits, misses, store reads,
        cached rows), beside the counters the tables share (pending updates, staleness, read-ahead
        timing)."""
        cache = dict(self.cache.stats(), **self.cache.table_stats()[table])
        if self.ids is not None and self.tables[table].id_policy is not None:
            cache.update(self.ids.stats(table))
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
