"""What DiskEmbeddingBagCollection and DiskEmbeddingCollection share: a collection of TorchRec
tables on disk in one process, behind one table-batched kernel per row layout, with its fused
optimizer, cuts, meta-device construction and statistics. The two differ in what a batch gives
back (pooled bags, or one embedding per id)."""
from __future__ import annotations

import itertools
import os
import warnings
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .. import optim as optim_lib
from ..cut import PendingCut, check_cut, read_cut, remove_cut
from ..disk_modules import DiskTableModule
from ..disk_table import destroy_table, directory_path
from ..embedding import DiskEmbeddingBag
from ..store import KVStore
from ..table_batch import DiskTableBatch
from ..table_settings import DiskTableSettings
from ..virtual_tables import id_policy_of
from .fused_optimizer import DiskFusedOptimizer, TableOptimizerState, optimizer_from_fused_params
from .read_aheads import ReadAheads
from .routing import KernelRouting, select_features
from .tables import disk_table_spec, open_disk_tables, table_seed


def _optimizer_state_of(bag: DiskEmbeddingBag) -> TableOptimizerState:
    """A table's optimizer state for the fused optimizer's state_dict (TableOptimizerState)."""
    def write(rows: torch.Tensor, step: int) -> None:
        bag.restore(state=rows)
        bag.steps = step
    return TableOptimizerState(lambda: bag.written_through_snapshot("state"), lambda: bag.steps, write)


class _TableOnMeta(nn.Module):
    """A table of a collection built on the meta device: its shape, and a meta tensor under the
    `weight` key of a state dict, as TorchRec's collections have on meta."""

    def __init__(self, config: BaseEmbeddingConfig) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = config.num_embeddings, config.embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        """A meta tensor of the table's shape, as TorchRec's table has on meta (not a parameter:
        materialising the model must not allocate the table)."""
        return torch.empty(self.num_embeddings, self.embedding_dim, device="meta")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,  # type: ignore[no-untyped-def]
                              unexpected_keys, error_msgs):
        # No table is open to take the rows (TorchRec's collection on meta would take them with assign=True).
        if prefix + "weight" in state_dict:
            error_msgs.append(f"{prefix}weight: the collection is on the meta device, with no table open to take "
                              f"rows: call to_empty(device=...) first, then load_state_dict")
        elif strict:
            missing_keys.append(prefix + "weight")


class DiskTableCollection(nn.Module, FusedOptimizerModule, DiskTableModule):
    """TorchRec tables on disk in one process (the base of DiskEmbeddingBagCollection and
    DiskEmbeddingCollection, which take its keyword-only arguments after their counterpart's own).

    A subclass names the attribute that holds the tables' views (`tables_attribute`, as its
    TorchRec counterpart names it: state dict keys follow), whether its tables pool (`pooled`),
    and its TorchRec counterpart and sharder (for messages).

    Args:
        tables: the tables' TorchRec configs.
        device: where the caches, pooling and outputs live (default: torch's default device).
        path: a directory; table ``t`` lives in ``path/t``.
        memory_budget_bytes: host memory for rows, for the whole collection. Within a row layout the
            tables share one cache, whose frequency-aware policy gives the hot rows of every table
            their place (`split_host_memory`); several layouts share it by traffic and size
            (`memory_budget.plan_host_memory`).
        cache_rows: rows of hot cache for the whole collection, split the same way (default: what
            the budget holds).
        lookups_per_sample: expected ids per sample of each table (its traffic), by table name;
            default: one per feature of the table. Splits the budget between row layouts.
        cut: reopen at this cut (a record `checkpoint()` returned) rather than the last one recorded
            in `path`: what a training checkpoint that holds the record resumes from.
        settings: how the tables train and are stored (`DiskTableSettings`: optimizer, staleness,
            cache policy, backend, seed, reopen, virtual tables). The model's torch optimizer does
            not reach the tables; without an optimizer they train with SGD(lr=0.01), with a
            warning, and `fused_optimizer` carries their learning rate for schedules and
            CombinedOptimizer. With ``reopen`` they continue from the rows and optimizer state
            `path` holds, at its last cut, every table at the same one, even after a crash. A
            virtual table (``use_virtual_table``) holds a row for any id in [0, num_embeddings) (up
            to 2**40) once looked up and evicts ids by its ``virtual_table_eviction_policy``; its
            state dict holds its live ids (``weight_id``) and their rows (``weight``)
            (docs/torchrec.md).
        **options: fields of `DiskTableSettings` by keyword, replacing those of `settings`.
    """

    tables_attribute: str
    pooled: bool
    counterpart: str  # the TorchRec module it replaces
    sharder: str  # the sharder that puts its counterpart on disk under DistributedModelParallel

    def __init__(self, tables: Sequence[BaseEmbeddingConfig], device: Optional[Union[str, torch.device]] = None, *,
                 path: Union[str, os.PathLike], memory_budget_bytes: int = 256 << 20, cache_rows: Optional[int] = None,
                 lookups_per_sample: Optional[Dict[str, float]] = None, cut: Optional[Dict[str, Any]] = None,
                 settings: Optional[DiskTableSettings] = None, **options: Any) -> None:
        settings = DiskTableSettings.of(settings, options, type(self).__name__).with_seed()
        super().__init__()
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # Each rank would train its own copy of every table: they would drift apart.
            raise RuntimeError(
                f"{type(self).__name__} holds one process's tables, and this process is one of "
                f"{torch.distributed.get_world_size()} ranks. Under DistributedModelParallel build the model with "
                f"{self.counterpart}(tables, device=torch.device('meta')) and pass {self.sharder}(storage_dir) (and "
                f"DiskAwarePlanner) to DistributedModelParallel: it shards the tables and puts on disk those that do "
                f"not fit (docs/torchrec.md, 'Many processes').")
        tables = list(tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be distinct, got {names}")
        for t in tables:
            if not t.feature_names:
                t.feature_names = [t.name]
        # No device given: torch's default, as a module's parameters take it (meta inside `with torch.device("meta")`).
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        self._configs = tables
        traffic = dict(lookups_per_sample or {})
        unknown = sorted(set(traffic) - set(names))
        if unknown:
            raise ValueError(f"lookups_per_sample names tables the collection does not have: {unknown}")
        if any(not v > 0 for v in traffic.values()):
            raise ValueError(f"lookups_per_sample must be positive, got {traffic}")
        if settings.optimizer is None and tables:
            warnings.warn(f"{type(self).__name__} trains its tables with its own fused optimizer, and none was "
                          "given: mlkv_torch.optim.SGD(lr=0.01). The model's torch optimizer does not reach the "
                          "tables; pass optimizer= (e.g. mlkv_torch.optim.Adam(lr=...)) and drive schedules through "
                          ".fused_optimizer", stacklevel=3)
        rule = settings.optimizer if settings.optimizer is not None else optim_lib.SGD()
        self._path = directory_path(path)
        # Each table as a disk table under `rule` (its state sizes the rows): checked now, opened now or
        # when a model built on meta is materialised.
        self._table_specs = [disk_table_spec(t, os.path.join(self._path, t.name), table_seed(settings.seed, t.name),
                                             rule, seed_drawn=settings.seed_drawn,
                                             lookups_per_sample=traffic.get(t.name), pooled=self.pooled,
                                             id_policy=id_policy_of(t, settings.virtual_tables))
                             for t in tables]
        self._memory_budget_bytes, self._cache_rows = memory_budget_bytes, cache_rows
        self._settings, self._read_ahead_into_slots = settings.batch, settings.read_ahead_into_slots
        self._read_aheads, self._read_ahead_tokens = ReadAheads(), itertools.count(1)
        if cut is not None:
            check_cut(cut, "cut")
        elif settings.reopen:
            cut = read_cut(self._path)
        self._cut, self._reopen = cut, settings.reopen or cut is not None
        self._lr = rule.lr
        self._batches: List[DiskTableBatch] = []
        self._routing: Optional[KernelRouting] = None
        self._pending_cut: Optional[PendingCut] = None
        if self._device.type == "meta":  # nothing opened, nothing allocated: to_empty(device=...) does it
            setattr(self, self.tables_attribute, nn.ModuleDict({t.name: _TableOnMeta(t) for t in tables}))
            self._fused_optimizer: Optional[DiskFusedOptimizer] = None
        else:
            self._open_tables()
        self._feature_names: List[List[str]] = [list(t.feature_names) for t in tables]
        self._embedding_names_by_table: List[List[str]] = get_embedding_names_by_table(tables)
        self._embedding_names: List[str] = [n for names in self._embedding_names_by_table for n in names]
        self._known_features = {f for names in self._feature_names for f in names}
        # The features in the tables' order (a feature of two tables twice).
        self._feature_order = [f for names in self._feature_names for f in names]

    @property
    def _table_views(self) -> nn.ModuleDict:
        """Each table viewed as a DiskEmbeddingBag (a `_TableOnMeta` on meta), by name."""
        return getattr(self, self.tables_attribute)

    def _open_tables(self) -> None:
        """Opens the tables' stores and batches on `self._device`, and views each table."""
        tables = self._configs
        opened = open_disk_tables(tables, self._table_specs, memory_budget_bytes=self._memory_budget_bytes,
                                  cache_rows=self._cache_rows, settings=self._settings, device=self._device,
                                  cut_dir=self._path, reopen=self._reopen, cut=self._cut,
                                  read_ahead_into_slots=self._read_ahead_into_slots)
        self._batches, self._routing = opened.batches, opened.routing
        bags = {t.name: bag for t, bag in zip(tables, opened.bags)}
        setattr(self, self.tables_attribute, nn.ModuleDict(bags))
        # Tables with optimizer state keep it in the optimizer's state_dict, as the sharded kernel does.
        state = {bags[t.name]._anchor: {f"{t.name}.optimizer_state": _optimizer_state_of(bags[t.name])}
                 for t in tables if bags[t.name].state_dim}
        self._fused_optimizer = DiskFusedOptimizer({f"{t.name}.weight": bags[t.name]._anchor for t in tables}, state,
                                                   self._lr)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Built on the meta device: `model.to_empty(device=d)` (here or on an enclosing model) opens
        # the tables on d. (`.to()` of a meta model fails in torch itself, pointing at to_empty.)
        if self._device.type == "meta":
            target = fn(torch.empty(0, device="meta")).device
            if target.type != "meta":
                self._device = target
                self._open_tables()
        elif fn(torch.empty(0, device=self._device)).device.type != self._device.type:
            # The tables' caches were opened on this device and stay there: moving only the
            # anchors would leave the outputs behind.
            raise ValueError(f"the collection's tables are open on {self._device} and cannot move: build it with "
                             f"device=... or on the meta device, then to_empty(device=...)")
        return super()._apply(fn, recurse)

    def _adopt_optimizer_in_backward(self) -> None:
        """``apply_optimizer_in_backward(cls, tables' parameters, kwargs)``, TorchRec's way of choosing
        fused tables' optimizer, chooses the disk tables' rule here as under DMP. The rule's state
        is part of each row, so a change reopens tables that hold no rows yet; tables with rows keep
        the rule they were written with."""
        declared: Dict[str, optim_lib.SparseOptimizer] = {}
        for name, bag in self._table_views.items():
            classes = getattr(bag._anchor, "_optimizer_classes", None)
            if classes:
                params = {"optimizer": optimizer_type_to_emb_opt_type(classes[-1]), **bag._anchor._optimizer_kwargs[-1]}
                declared[name] = optimizer_from_fused_params(params, name)
                bag._anchor._optimizer_classes, bag._anchor._optimizer_kwargs = [], []  # taken
        if not declared:
            return
        rules = set(declared.values())
        if len(rules) > 1 or len(declared) != len(self._table_views):
            raise ValueError(f"apply_optimizer_in_backward must give every table of a {type(self).__name__} one "
                             f"optimizer, got {declared} for tables {list(self._table_views)}")
        rule = rules.pop()
        if all(batch.optimizer == rule for batch in self._batches):
            return
        for batch in self._batches:  # rows trained so far reach the stores, where they are counted
            batch.flush()
        written = [f"{name!r} ({len(bag._store):,} rows)" for name, bag in self._table_views.items()
                   if not isinstance(bag._store, KVStore) or len(bag._store) > 0]
        if written:
            raise RuntimeError(
                f"apply_optimizer_in_backward asks for {rule} on tables whose rows were written with "
                f"{self._batches[0].optimizer}: {', '.join(written)}. A row holds its optimizer's state, so the rule "
                f"is chosen before any row is written (or pass the same optimizer= when reopening)")
        self.close()
        for batch in self._batches:
            for table in batch.tables:
                destroy_table(table.path)
        remove_cut(self._path)
        self._cut = None
        self._batches = []
        self._table_specs = [replace(spec, layout=replace(spec.layout, optimizer=rule)) for spec in self._table_specs]
        self._lr = rule.lr
        self._open_tables()

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Loading writes rows: an in-backward optimizer declared before must choose the rule first.
        if self._device.type != "meta":
            self._adopt_optimizer_in_backward()
        super()._load_from_state_dict(*args, **kwargs)

    def _check_materialised(self) -> None:
        if self._device.type == "meta":
            raise RuntimeError(f"this {type(self).__name__} is on the meta device: materialise it with "
                               "to_empty(device=...) (or the model that holds it) first")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The tables' optimizer in TorchRec's protocol: ``param_groups[0]["lr"]`` is their learning
        rate (an LR scheduler over it, or a CombinedOptimizer holding it, reaches the tables);
        step() does nothing, as the tables update in backward."""
        self._check_materialised()
        return self._fused_optimizer

    def _traced_call(self, features: torch.fx.Proxy, run: Any) -> Any:
        """A call traced by torch.fx (TorchRec's tracer): the collection is one call in the graph,
        run as is (a leaf), as the lookup depends on the ids' values. Traced as the root itself, it
        has no path: the graph calls `run`, which it keeps."""
        tracer = features.tracer
        path = tracer.path_of_module(self)
        if path:
            return tracer.create_proxy("call_module", path, (features,), {})
        return tracer.create_proxy("call_function", run, (features,), {})

    def _features_of_tables(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The tables' features of a batch in the tables' order, checked; ready for the kernels (the
        tables' optimizer chosen and its learning rate set)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        self._check_materialised()
        self._adopt_optimizer_in_backward()
        missing = sorted(self._known_features - set(features.keys()))
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks features of the tables: {missing}")
        batch_size = features.stride()
        for name, count in zip(features.keys(), features.stride_per_key()):
            if name in self._known_features and count != batch_size:
                raise ValueError(f"feature {name!r} has {count} bags, the batch has {batch_size}: features of "
                                 "different batch sizes (TorchRec's variable batch per feature) are not supported")
        if not self._batches:  # no tables
            return features
        self._fused_optimizer.apply_lr(self._batches)
        return self._in_table_order(features)

    def _in_table_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The tables' features in the tables' order, others left out (a permute only when the
        batch's differs)."""
        keys = features.keys()
        if keys == self._feature_order:
            return features
        index = {key: i for i, key in enumerate(keys)}
        missing = sorted(set(self._feature_order) - set(index))
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks features of the tables: {missing}")
        return select_features(features, [index[f] for f in self._feature_order])

    @property
    def disk_table_names(self) -> List[str]:
        """Every table of the collection (all on disk)."""
        return [t.name for t in self._configs]

    @property
    def lookahead_process_group(self) -> None:
        """None: one process's tables look ahead on their own."""
        return None

    def lookahead(self, features: KeyedJaggedTensor) -> int:
        """Starts reading the rows of a future batch's features into memory; returns at once, with
        the read-ahead's token (`read_ahead_next`)."""
        token = next(self._read_ahead_tokens)
        self._read_aheads.add(token, self._routing.lookahead(self._batches, self._in_table_order(features)))
        return token

    def read_ahead_next(self, token: Optional[int]) -> None:
        """The next training forward is the batch read ahead as `token` (None: one not read ahead)."""
        self._read_aheads.name_next(token)

    # ---- tables -----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Applies queued updates of every table and writes changed rows to the stores."""
        for batch in self._batches:
            batch.flush()

    def reset_parameters(self) -> None:
        """Every table's rows back to their initial values and optimizer state
        (`DiskEmbeddingBag.reset_parameters`), as TorchRec's collections' reset_parameters."""
        self._check_materialised()
        for bag in self._table_views.values():
            bag.reset_parameters()

    def local_disk_shards(self) -> List[Tuple[str, int, int, Any]]:
        return [(name, 0, 0, bag) for name, bag in self._table_views.items()]

    def populate(self) -> int:
        """Writes every row of every table to its store (`DiskEmbeddingBag.populate`), then takes a
        cut (`checkpoint`), so the rows are durable and the first cut of training writes only what
        training changed; returns the rows."""
        self._check_materialised()
        rows = sum(bag.populate() for bag in self._table_views.values())
        self.checkpoint()
        return rows

    def begin_checkpoint(self, label: Optional[int] = None) -> PendingCut:
        """Begins a cut of every table (`mlkv_torch.cut`) at this step boundary and returns at once,
        while each kernel's writer thread writes it in the background: queued updates applied, the
        cut's rows set aside (copied on write when training changes them meanwhile), written,
        every store checkpointed. ``wait()`` on the result waits for that, commits the record in
        ``path/CUT.json`` and returns it; until then the committed cut is the one before. One cut
        at a time: a cut begun while another is pending waits for and commits that one first.
        `label` (say, the training step) is kept in the record and named in errors. A cut whose
        writing failed (``wait()`` raised: a full disk) is not committed, and the one before it
        stays; the next cut first writes what it could not, and raises while that still fails."""
        self._check_materialised()
        self.wait_checkpoint()
        self._pending_cut = PendingCut(self._path, label,
                                       [batch.begin_checkpoint() for batch in self._batches])
        return self._pending_cut

    def wait_checkpoint(self) -> Optional[Dict[str, Any]]:
        """Waits for the cut begun last (`begin_checkpoint`) and commits it; returns its record
        (None when none is pending)."""
        pending, self._pending_cut = self._pending_cut, None
        return None if pending is None else pending.wait()

    def checkpoint(self, label: Optional[int] = None) -> Dict[str, Any]:
        """Takes a cut of every table (`begin_checkpoint`) and commits it before returning. After a
        crash at any moment, ``reopen=True`` brings every table back to the last committed cut,
        never to a mix. Returns the record; a training checkpoint that stores it resumes from it
        with ``cut=``."""
        return self.begin_checkpoint(label).wait()

    def close(self) -> None:
        """Commits a pending cut, takes a last one (`checkpoint`), then closes every table."""
        open_batches = [batch for batch in self._batches if not batch.closed]
        if not open_batches:
            return
        try:
            if len(open_batches) == len(self._batches):
                self.checkpoint()
        finally:
            for batch in open_batches:
                batch.close()

    def stats(self) -> Dict[str, Dict[str, object]]:
        """Each table's DiskEmbeddingBag.stats(), by table name."""
        self._check_materialised()
        return {name: bag.stats() for name, bag in self._table_views.items()}
