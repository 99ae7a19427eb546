"""Disk tables under DistributedModelParallel: a sharder whose tables may live on disk.

TorchRec's plug-in point for a third-party kernel is the compute kernel
``customized_kernel``. `DiskEmbeddingBagCollectionSharder` offers it beside
TorchRec's own kernels for table-wise, column-wise and table-column-wise
sharding; the planner (`DiskAwarePlanner`) decides which tables take it. A
table planned on it becomes, on each rank that holds a shard, a
DiskEmbeddingBag in ``storage_dir/rank<r>/<table>_rows<r0>_cols<c0>``.

- Forward: `DiskEmbeddingKernel` pools the shard's features after TorchRec's
  input distribution, exactly as TorchRec's fused kernel would.
- Lookahead: ``ShardedDiskEmbeddingBagCollection.lookahead(features)`` runs the
  input distribution of a future batch (a collective) and starts reading, on each
  rank, the rows of its shards that the batch will look up (LookaheadPipeline).
- Training: the fused optimizer comes from ``apply_optimizer_in_backward`` or
  the sharder's ``fused_params`` (TorchRec's way) or its ``optimizer`` (an
  mlkv_torch.optim rule, which the in-memory tables of the plan then share).
  ``dmp.fused_optimizer`` holds the disk tables: its ``param_groups`` set their
  learning rate, and its ``state_dict()`` holds their optimizer state.
- Checkpoints: ``dmp.state_dict()`` holds every disk table as a ShardedTensor
  under EmbeddingBagCollection's key (``embedding_bags.<table>.weight``),
  read from the stores; a shard larger than its memory budget is file-backed,
  so torch.distributed.checkpoint saves it without materialising it.
  ``load_state_dict`` writes the rows back, from ShardedTensors or from an
  unsharded collection's full tensors.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import (EmbeddingComputeKernel, GroupedEmbeddingConfig, KJTList,
                                                  ShardedEmbeddingTable)
from torchrec.distributed.embeddingbag import (EmbeddingBagCollectionContext, EmbeddingBagCollectionSharder,
                                              ShardedEmbeddingBagCollection)
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .. import optim as optim_lib
from ..cut import CutPart, PendingCut, read_cut, write_cut
from ..disk_table import DiskTable, draw_seed
from ..embedding import DiskEmbeddingBag
from ..table_batch import BACKENDS, DiskTableBatch
from .tables import (DATA_TYPES, MIN_TABLE_BUDGET, POOLING_MODES, DiskFusedOptimizer, KernelRouting,
                     TableOptimizerState, disk_tables_in_state_dict, disk_tables_left_out, fused_params_of,
                     initial_distribution_of, optimizer_from_fused_params, table_seed)
from ..row_layout import row_bytes

__all__ = ["DISK_KERNEL", "DiskEmbeddingBagCollectionSharder", "DiskEmbeddingKernel", "DiskTableOptions",
           "ShardedDiskEmbeddingBagCollection", "disk_tables_left_out", "resolve_optimizer", "shard_memory_budget"]

DISK_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
"""The compute kernel of disk tables in a sharding plan."""

_DISK_SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                        ShardingType.TABLE_COLUMN_WISE.value)


def on_host(shard: ShardMetadata) -> ShardMetadata:
    """`shard` placed in its rank's host memory: a disk table's rows reach a state dict as CPU (or
    file-backed) tensors, whatever device the plan computes on (a ShardedTensor refuses local
    shards off their placement's device)."""
    rank = shard.placement.rank() if shard.placement is not None else 0
    return ShardMetadata(shard_offsets=list(shard.shard_offsets), shard_sizes=list(shard.shard_sizes),
                         placement=f"rank:{rank}/cpu")


# Set while DiskAwarePlanner plans: only then does the sharder offer its disk kernel.
_planning_with_disk: contextvars.ContextVar[bool] = contextvars.ContextVar("mlkv_planning_with_disk", default=False)


@contextlib.contextmanager
def planning_with_disk() -> Iterator[None]:
    """The planner that estimates the disk kernel (DiskAwarePlanner) plans inside this."""
    token = _planning_with_disk.set(True)
    try:
        yield
    finally:
        _planning_with_disk.reset(token)


@dataclass(frozen=True)
class DiskTableOptions:
    """How the sharder builds disk tables (see DiskEmbeddingBagCollectionSharder)."""

    storage_dir: str
    optimizer: Optional[optim_lib.SparseOptimizer] = None
    memory_fraction: float = 0.1
    staleness: int = 0
    cache_policy: str = "lfu"
    seed: int = 0
    backend: str = "mlkv"
    seed_drawn: bool = False
    reopen: bool = False
    # The cut each rank's tables reopen at ({rank: record}, a training checkpoint's); without it a
    # reopen goes to the cut the rank's directory records.
    cuts: Optional[Dict[int, Any]] = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {self.staleness!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, optim_lib.SparseOptimizer):
            raise TypeError(f"optimizer must be a mlkv_torch.optim rule, got {type(self.optimizer).__name__}")


def shard_memory_budget(rows: int, cols: int, dtype: torch.dtype, optimizer: optim_lib.SparseOptimizer,
                        memory_fraction: float) -> int:
    """Host memory (cache and store log) a disk shard of rows x cols is given: `memory_fraction`
    of its stored bytes, at least MIN_TABLE_BUDGET. The planner's storage estimate uses this too."""
    return max(MIN_TABLE_BUDGET, int(memory_fraction * rows * row_bytes(cols, dtype, optimizer)))


def resolve_optimizer(fused_params: Optional[Dict[str, Any]], table: str, options: DiskTableOptions
                      ) -> optim_lib.SparseOptimizer:
    """A disk table's optimizer: from TorchRec's fused parameters (where apply_optimizer_in_backward
    and the sharder's fused_params arrive), else the sharder's rule, else TorchRec's default SGD."""
    return optimizer_from_fused_params(fused_params, table) or options.optimizer or optim_lib.SGD()


class DiskEmbeddingKernel(BaseEmbedding, FusedOptimizerModule):
    """The disk tables of one group of a TorchRec lookup on this rank, behind one table-batched kernel
    per row layout (a DiskTableBatch; in DLRM one for all); each shard viewed as a DiskEmbeddingBag.

    ``forward(KJT) -> Tensor [batch, sum of feature dims]``, the features in the group's order,
    as TorchRec's fused kernel.
    """

    def __init__(self, config: GroupedEmbeddingConfig, options: DiskTableOptions,
                 pg: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self._config = config
        self._device = torch.device(device if device is not None else "cpu")
        rank = dist.get_rank(pg) if pg is not None and dist.is_initialized() else 0
        self._rank_dir = os.path.join(options.storage_dir, f"rank{rank}")
        self._pg = pg
        self._shards: List[ShardedEmbeddingTable] = list(config.embedding_tables)
        # Shards of one row layout (columns, data type, pooling, optimizer) share one table-batched kernel.
        Layout = Tuple[int, torch.dtype, str, optim_lib.SparseOptimizer]
        layouts: Dict[Layout, List[int]] = {}
        budgets: Dict[Layout, int] = defaultdict(int)
        for i, table in enumerate(self._shards):
            if table.pooling not in POOLING_MODES:
                raise ValueError(f"table {table.name!r}: pooling {table.pooling} is not supported on disk "
                                 "(SUM or MEAN)")
            if table.data_type not in DATA_TYPES:
                raise ValueError(f"table {table.name!r}: data_type {table.data_type} is not supported on disk")
            row_offset, _ = self._offsets(table)
            if row_offset != 0 or table.local_rows != table.num_embeddings:
                raise ValueError(f"table {table.name!r}: disk tables are sharded table-wise or column-wise, "
                                 f"not by rows")
            optimizer = resolve_optimizer(table.fused_params or config.fused_params, table.name, options)
            dtype = DATA_TYPES[table.data_type]
            layout = (table.local_cols, dtype, POOLING_MODES[table.pooling], optimizer)
            layouts.setdefault(layout, []).append(i)
            budgets[layout] += shard_memory_budget(table.local_rows, table.local_cols, dtype, optimizer,
                                                   options.memory_fraction)
        lrs = {layout[3].lr for layout in layouts}
        if len(lrs) > 1:
            raise ValueError(f"the disk tables of one group must share a learning rate, got {sorted(lrs)}")
        self._batches: List[DiskTableBatch] = []
        # Reopened at a cut: the one a training checkpoint names for this rank, else the one recorded here.
        cut = (options.cuts or {}).get(rank)
        if cut is None and options.reopen:
            cut = read_cut(self._rank_dir)
        bag_of: Dict[int, DiskEmbeddingBag] = {}
        owners: Dict[int, Tuple[int, int]] = {}
        for (cols, dtype, mode, optimizer), members in layouts.items():
            batch = DiskTableBatch(
                [DiskTable(self._shards[i].name, self._shards[i].num_embeddings,
                           os.path.join(self._rank_dir, self._shard_name(self._shards[i])),
                           table_seed(options.seed, self._shards[i].name), self._offsets(self._shards[i])[1],
                           init=initial_distribution_of(self._shards[i]), seed_drawn=options.seed_drawn)
                 for i in members],
                cols, mode=mode, optimizer=optimizer, memory_budget_bytes=budgets[(cols, dtype, mode, optimizer)],
                staleness=options.staleness, dtype=dtype, device=self._device, cache_policy=options.cache_policy,
                backend=options.backend, reopen=options.reopen or cut is not None, cut=cut)
            for k, i in enumerate(members):
                bag_of[i] = DiskEmbeddingBag.of_batch(batch, k)
                owners[i] = (len(self._batches), k)
            # TorchRec's dense optimizers skip parameters that an in-backward optimizer owns.
            for anchor in batch.anchors:
                anchor._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
            self._batches.append(batch)
        if cut is not None and cut != read_cut(self._rank_dir):
            write_cut(self._rank_dir, cut)  # the newer cut the stores went back from is gone
        self.bags = nn.ModuleList([bag_of[i] for i in range(len(self._shards))])
        self._routing = KernelRouting([owners[i] for i, table in enumerate(self._shards) for _ in table.feature_names])
        self._bags_by_table: Dict[str, List[Tuple[ShardedEmbeddingTable, DiskEmbeddingBag]]] = defaultdict(list)
        for table, bag in zip(self._shards, self.bags):
            self._bags_by_table[table.name].append((table, bag))
        params = {f"{name}.weight": shards[0][1]._anchor for name, shards in self._bags_by_table.items()}
        state = {shards[0][1]._anchor: {f"{name}.optimizer_state": TableOptimizerState(
            functools.partial(self.optimizer_state, name), functools.partial(self.step_of, name),
            functools.partial(self.load_optimizer_state, name))}
                 for name, shards in self._bags_by_table.items() if shards[0][1].state_dim}
        self._optimizer = DiskFusedOptimizer(params, state, lrs.pop() if lrs else 0.01)

    @classmethod
    def _shard_name(cls, table: ShardedEmbeddingTable) -> str:
        row_offset, col_offset = cls._offsets(table)
        return f"{table.name}_rows{row_offset}_cols{col_offset}"

    @staticmethod
    def _offsets(table: ShardedEmbeddingTable) -> Tuple[int, int]:
        offsets = table.local_metadata.shard_offsets if table.local_metadata is not None else [0, 0]
        return int(offsets[0]), int(offsets[1])

    # ---- BaseEmbedding / FusedOptimizerModule -----------------------------------------------------
    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optimizer

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise ValueError("disk tables do not support variable batch sizes per feature")
        self._optimizer.apply_lr(self._batches)  # its param_groups set the learning rate of this step
        return self._routing.pool(self._batches, features, self._config.is_weighted)

    def lookahead(self, features: KeyedJaggedTensor) -> None:
        """Starts reading the rows that `features` (as `forward` receives them) will look up; returns at once."""
        self._routing.lookahead(self._batches, features)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, shards in self._bags_by_table.items():
            yield f"{prefix}{name}.weight", shards[0][1]._anchor

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()

    def named_parameters_by_table(self) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, shards in self._bags_by_table.items():
            yield name, shards[0][1]._anchor

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        # The sharded collection's hook puts each table's ShardedTensor in its state dict.
        return destination if destination is not None else {}

    def flush(self) -> None:
        # TorchRec flushes every lookup before a state_dict; one that leaves the disk tables out
        # must not write them back (nor wait for a cut being written).
        if not disk_tables_in_state_dict():
            return
        for batch in self._batches:
            batch.flush()

    def purge(self) -> None:
        pass

    # ---- rows ---------------------------------------------------------------------------------------
    @property
    def table_names(self) -> List[str]:
        return list(self._bags_by_table)

    def local_weight_shards(self, table: str) -> List[Shard]:
        """This rank's shards of `table`, read from the stores (file-backed beyond their budget)."""
        return [Shard(bag.snapshot(), on_host(shard.local_metadata)) for shard, bag in self._bags_by_table[table]]

    def load_weights(self, table: str, weight: torch.Tensor) -> None:
        """Writes this rank's shards of `table` from a ShardedTensor of the same plan or a full tensor."""
        for shard, bag in self._bags_by_table[table]:
            row_offset, col_offset = self._offsets(shard)
            bag.restore(weight=_local_part(weight, table, row_offset, col_offset, shard.local_rows, shard.local_cols))

    def optimizer_state(self, table: str) -> ShardedTensor:
        """The optimizer state of `table` on this rank: a ShardedTensor [rows, state columns of all shards]."""
        shards = self._bags_by_table[table]
        metadata = self._state_metadata(table)
        local = [Shard(bag.state_snapshot(), metadata.shards_metadata[self._state_shard_index(table, shard)])
                 for shard, bag in shards]
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=self._pg)

    def load_optimizer_state(self, table: str, state: ShardedTensor, step: int) -> None:
        metadata = self._state_metadata(table)
        for shard, bag in self._bags_by_table[table]:
            where = metadata.shards_metadata[self._state_shard_index(table, shard)]
            bag.restore(state=_local_part(state, f"{table} optimizer state", *where.shard_offsets, *where.shard_sizes))
            bag.steps = step

    def step_of(self, table: str) -> int:
        """Optimizer steps `table` has taken (its shards step together)."""
        return max(bag.steps for _, bag in self._bags_by_table[table])

    def _state_metadata(self, table: str) -> ShardedTensorMetadata:
        """The optimizer state's layout: shard k of the weights ([r0, c0], rows x cols) keeps its state
        at columns after the states of the shards left of it."""
        first, bag = self._bags_by_table[table][0]
        weights = first.global_metadata.shards_metadata
        optimizer = bag.optimizer
        state_cols = {int(m.shard_offsets[1]): optimizer.state_dim(int(m.shard_sizes[1])) for m in weights}
        starts, total = {}, 0
        for col in sorted(state_cols):
            starts[col], total = total, total + state_cols[col]
        shards = [ShardMetadata(shard_offsets=[int(m.shard_offsets[0]), starts[int(m.shard_offsets[1])]],
                                shard_sizes=[int(m.shard_sizes[0]), state_cols[int(m.shard_offsets[1])]],
                                placement=on_host(m).placement) for m in weights]
        return ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([first.num_embeddings, total]),
                                     tensor_properties=TensorProperties(dtype=torch.float32))

    @staticmethod
    def _state_shard_index(table: str, shard: ShardedEmbeddingTable) -> int:
        offsets = list(shard.local_metadata.shard_offsets)
        for i, m in enumerate(shard.global_metadata.shards_metadata):
            if list(m.shard_offsets) == offsets:
                return i
        raise ValueError(f"table {table!r}: shard at {offsets} is not in the plan")

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """DiskEmbeddingBag.stats() of each shard, by ``<table>_rows<r0>_cols<c0>``."""
        return {self._shard_name(table): bag.stats() for table, bag in zip(self._shards, self.bags)}

    @property
    def rank_dir(self) -> str:
        """Where this rank's tables live (one store per shard) and its cuts are recorded."""
        return self._rank_dir

    @property
    def closed(self) -> bool:
        return all(batch.closed for batch in self._batches)

    def begin_checkpoint(self) -> List[CutPart]:
        """This kernel's part of a cut, begun (`DiskTableBatch.begin_checkpoint`): one wait per batch."""
        return [batch.begin_checkpoint() for batch in self._batches]

    def populate(self) -> int:
        """Writes every row of this kernel's shards to their stores; returns the rows."""
        return sum(bag.populate() for bag in self.bags)

    def close(self) -> None:
        for batch in self._batches:
            batch.close()


def _local_part(tensor: torch.Tensor, what: str, row_offset: int, col_offset: int, rows: int, cols: int
                ) -> torch.Tensor:
    """The [rows, cols] block at (row_offset, col_offset) of a full tensor, or of a ShardedTensor that
    holds exactly that block on this rank."""
    if isinstance(tensor, ShardedTensor):
        for shard in tensor.local_shards():
            if list(shard.metadata.shard_offsets) == [row_offset, col_offset]:
                if list(shard.metadata.shard_sizes) != [rows, cols]:
                    break
                return shard.tensor
        raise ValueError(f"{what}: the ShardedTensor holds no [{rows}, {cols}] shard at "
                         f"[{row_offset}, {col_offset}] on this rank (saved under another plan?)")
    if tensor.dim() != 2 or tensor.shape[0] < row_offset + rows or tensor.shape[1] < col_offset + cols:
        raise ValueError(f"{what}: shape {list(tensor.shape)} does not contain the shard "
                         f"[{row_offset}:{row_offset + rows}, {col_offset}:{col_offset + cols}]")
    return tensor[row_offset:row_offset + rows, col_offset:col_offset + cols]


class _DiskPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, with DiskEmbeddingKernel for groups planned on disk."""

    def __init__(self, options: DiskTableOptions, **kwargs: Any) -> None:
        self._disk_options = options  # read by _create_embedding_kernel, which the base __init__ calls
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: Optional[torch.device],
                                 pg: Optional[dist.ProcessGroup], sharding_type: Optional[ShardingType],
                                 env: Optional[ShardingEnv]) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DiskEmbeddingKernel(config, self._disk_options, pg=pg, device=device)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)

    def lookahead(self, features: KeyedJaggedTensor) -> None:
        """Starts reading the rows of the disk groups that `features` (as `forward` receives them) will
        look up; the in-memory groups have nothing to read."""
        for kernel, group in zip(self._emb_modules, features.split(self._feature_splits)):
            if isinstance(kernel, DiskEmbeddingKernel):
                kernel.lookahead(group)


class _DiskLookupMixin:
    """Makes a TorchRec pooled sharding build _DiskPooledEmbeddingsLookup."""

    disk_options: DiskTableOptions

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> GroupedPooledEmbeddingsLookup:
        return _DiskPooledEmbeddingsLookup(
            self.disk_options, grouped_configs=self._grouped_embedding_configs, pg=self._pg,  # type: ignore
            device=device if device is not None else self._device, feature_processor=feature_processor,  # type: ignore
            env=self._env)  # type: ignore


class _DiskTwSharding(_DiskLookupMixin, TwPooledEmbeddingSharding):
    pass


class _DiskCwSharding(_DiskLookupMixin, CwPooledEmbeddingSharding):
    pass


class _DiskTwCwSharding(_DiskLookupMixin, TwCwPooledEmbeddingSharding):
    pass


_DISK_SHARDINGS = {ShardingType.TABLE_WISE.value: _DiskTwSharding, ShardingType.COLUMN_WISE.value: _DiskCwSharding,
                   ShardingType.TABLE_COLUMN_WISE.value: _DiskTwCwSharding}


class ShardedDiskEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """TorchRec's ShardedEmbeddingBagCollection whose ``customized_kernel`` tables live on disk."""

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, options: DiskTableOptions, **kwargs: Any) -> None:
        self._disk_options = options  # read by create_embedding_bag_sharding, which the base __init__ calls
        self._disk_table_names = [name for name, ps in table_name_to_parameter_sharding.items()
                                  if ps.compute_kernel == DISK_KERNEL]
        super().__init__(module, table_name_to_parameter_sharding, env, **kwargs)
        self._input_keys: Optional[List[str]] = None  # of the first input distribution (see input_dist)
        self._register_state_dict_hook(ShardedDiskEmbeddingBagCollection._disk_tables_to_state_dict)
        self._register_load_state_dict_pre_hook(self._disk_tables_from_state_dict, with_module=True)

    def create_embedding_bag_sharding(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                                      device: Optional[torch.device] = None, permute_embeddings: bool = False,
                                      qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        on_disk = [i.param_sharding.compute_kernel == DISK_KERNEL for i in sharding_infos]
        if not any(on_disk):
            return ShardedEmbeddingBagCollection.create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings=permute_embeddings,
                qcomm_codecs_registry=qcomm_codecs_registry)
        if sharding_type not in _DISK_SHARDINGS:
            tables = [i.embedding_config.name for i, d in zip(sharding_infos, on_disk) if d]
            raise ValueError(f"disk tables {tables} are sharded {sharding_type}; disk tables support "
                             f"{list(_DISK_SHARDINGS)}")
        kwargs: Dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type != ShardingType.TABLE_WISE.value:
            kwargs["permute_embeddings"] = permute_embeddings
        sharding = _DISK_SHARDINGS[sharding_type](sharding_infos, env, device, **kwargs)
        sharding.disk_options = self._disk_options
        return sharding

    def reset_parameters(self) -> None:
        # Disk tables start from their stores (initial rows or the rows already there); TorchRec's
        # init_fn must not touch them, and ranks without a shard still need the `weight` attribute.
        for name in getattr(self, "_disk_table_names", []):
            module = self.embedding_bags[name]
            if "weight" not in module._parameters:
                module.register_parameter("weight", nn.Parameter(torch.empty(0)))
                module.weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        super().reset_parameters()

    def _unwrapped_lookups(self) -> Iterator[nn.Module]:
        """The lookups, one per sharding type, without the DistributedDataParallel some are wrapped in."""
        for lookup in self._lookups:
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            yield lookup

    def disk_kernels(self) -> Iterator[DiskEmbeddingKernel]:
        """The kernels of this rank's disk tables."""
        for lookup in self._unwrapped_lookups():
            for module in getattr(lookup, "_emb_modules", []):
                if isinstance(module, DiskEmbeddingKernel):
                    yield module

    @property
    def lookahead_process_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that must call `lookahead` together, batch for batch in the same order (it runs
        the input distribution); None when the plan has no disk table, and `lookahead` does nothing."""
        return self._env.process_group if self._disk_table_names else None

    def lookahead(self, features: KeyedJaggedTensor) -> None:
        """Starts reading, on the ranks that hold them, the disk rows a future batch will look up.

        A collective over `lookahead_process_group`: it runs TorchRec's input distribution of
        `features` (an all-to-all of the ids, which the batch's forward runs again) and waits for
        it; the reads themselves run in the background. Every rank calls it with its part of the
        same future batch, the KeyedJaggedTensor the module's forward will receive.

        Args:
            features: this rank's sparse features of the future batch.
        """
        if not self._disk_table_names:  # the same on every rank: the plan is global
            return
        dist_input = self.input_dist(self.create_context(), features).wait().wait()
        for lookup, sharding_features in zip(self._unwrapped_lookups(), dist_input):
            if isinstance(lookup, _DiskPooledEmbeddingsLookup):
                lookup.lookahead(sharding_features)

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: Union[KeyedJaggedTensor, TensorDict]
                   ) -> Awaitable[Awaitable[KJTList]]:
        # TorchRec fixes the feature permutation on the first call: a lookahead with other keys than
        # the forward's would route ids to the wrong tables.
        if isinstance(features, KeyedJaggedTensor):
            keys = features.keys()
            if self._input_keys is None:
                self._input_keys = list(keys)
            elif keys != self._input_keys:
                raise ValueError(f"the sparse features' keys {keys} differ from those of the first input "
                                 f"distribution {self._input_keys}: lookahead must get the KeyedJaggedTensor "
                                 f"the module's forward gets")
        return super().input_dist(ctx, features)

    def _global_metadata(self, table: str) -> ShardedTensorMetadata:
        config = self._table_name_to_config[table]
        spec = self.module_sharding_plan[table].sharding_spec
        metadata = spec.build_metadata(tensor_sizes=torch.Size([config.num_embeddings, config.embedding_dim]),
                                       tensor_properties=TensorProperties(dtype=DATA_TYPES[config.data_type]))
        metadata.shards_metadata = [on_host(m) for m in metadata.shards_metadata]
        return metadata

    @staticmethod
    def _disk_tables_to_state_dict(module: "ShardedDiskEmbeddingBagCollection", destination: Dict[str, Any],
                                   prefix: str, local_metadata: Dict[str, Any]) -> None:
        if not disk_tables_in_state_dict():  # nor what the base module put under their names
            for table in module._disk_table_names:
                destination.pop(f"{prefix}embedding_bags.{table}.weight", None)
            return
        local: Dict[str, List[Shard]] = defaultdict(list)
        for kernel in module.disk_kernels():
            for table in kernel.table_names:
                local[table].extend(kernel.local_weight_shards(table))
        for table in module._disk_table_names:
            destination[f"{prefix}embedding_bags.{table}.weight"] = \
                ShardedTensor._init_from_local_shards_and_global_metadata(
                    local[table], module._global_metadata(table), process_group=module._env.process_group)

    @staticmethod
    def _disk_tables_from_state_dict(module: "ShardedDiskEmbeddingBagCollection", state_dict: Dict[str, Any],
                                     prefix: str, *args: Any) -> None:
        kernels = {table: kernel for kernel in module.disk_kernels() for table in kernel.table_names}
        for table in module._disk_table_names:
            key = f"{prefix}embedding_bags.{table}.weight"
            if not disk_tables_in_state_dict():  # the tables reopened at their cut
                module._skip_missing_weight_key.append(key)
                continue
            if key not in state_dict:
                continue  # load_state_dict reports it missing
            weight = state_dict.pop(key)
            if table in kernels:
                kernels[table].load_weights(table, weight)
            module._skip_missing_weight_key.append(key)

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """DiskEmbeddingBag.stats() of each disk shard on this rank, by ``<table>_rows<r0>_cols<c0>``."""
        return {name: stats for kernel in self.disk_kernels() for name, stats in kernel.stats().items()}

    def populate(self) -> int:
        """Writes every row of this rank's disk shards to their stores (`DiskEmbeddingBag.populate`),
        so reads come from disk as in tables trained for a while, then takes a cut of them
        (`checkpoint`), so the rows are durable and the first cut of training writes only what
        training changed; returns the rows."""
        rows = sum(kernel.populate() for kernel in self.disk_kernels())
        self.checkpoint()
        return rows

    def begin_checkpoint(self, label: Optional[int] = None) -> Optional[PendingCut]:
        """Begins a cut of this rank's disk tables at this step boundary (as
        `DiskEmbeddingBagCollection.begin_checkpoint`); ``wait()`` commits it in the rank's directory
        (``<storage_dir>/rank<r>/CUT.json``) and returns its record. None on a rank without disk
        tables. Every rank takes its own; a training checkpoint records them together."""
        kernels = list(self.disk_kernels())
        if not kernels:
            return None
        return PendingCut(kernels[0].rank_dir, label,
                          [part for kernel in kernels for part in kernel.begin_checkpoint()])

    def checkpoint(self, label: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """A cut of this rank's disk tables (`begin_checkpoint`), committed before this returns; its
        record (None without disk tables). After a crash, the sharder's ``reopen=True`` reopens each
        rank's tables at the cut its directory records, or at ``cuts={rank: record}``."""
        pending = self.begin_checkpoint(label)
        return None if pending is None else pending.wait()

    def close(self) -> None:
        """Takes a last cut of this rank's disk tables (`checkpoint`), then closes them."""
        try:
            if not any(kernel.closed for kernel in self.disk_kernels()):
                self.checkpoint()
        finally:
            for kernel in self.disk_kernels():
                kernel.close()


class DiskEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """EmbeddingBagCollectionSharder that can put tables on disk (compute kernel ``customized_kernel``).

    Pass it to DistributedModelParallel (and to the planner) in place of TorchRec's sharder;
    the plan says which tables go to disk (`DiskAwarePlanner` decides by memory).

    Args:
        storage_dir: where disk tables live; rank r uses ``storage_dir/rank<r>``.
        optimizer: the fused rule of every table without an in-backward optimizer
            (`apply_optimizer_in_backward` takes precedence); the in-memory tables of the plan
            get the same rule through TorchRec's fused parameters. Default: fused_params's, else
            SGD(lr=0.01), TorchRec's default.
        memory_fraction: host memory of a disk shard (cache and store log), as a fraction of its
            bytes on disk (weights and optimizer state).
        staleness: the per-row staleness bound of disk tables (0: exact).
        cache_policy: "lfu" or "lru".
        seed: seed of the initial rows of disk tables; default read from the state of torch's generator
            when the sharder is built (every rank must build it at the same point after the same
            ``torch.manual_seed``, or pass one). A reopened table keeps its recorded seed.
        backend: the store under disk tables: "mlkv" (KVStore) or "rocksdb" (the baseline).
        reopen: continue from the rows and optimizer state `storage_dir` holds from an earlier run,
            each rank's tables at the last cut its directory records (`checkpoint`); without it,
            disk tables holding rows are refused (FileExistsError).
        cuts: reopen each rank's tables at the cut given for it ({rank: record}, the records a
            training checkpoint holds) instead.
        fused_params: TorchRec's fused parameters, as for EmbeddingBagCollectionSharder.
    """

    def __init__(self, storage_dir: str, *, optimizer: Optional[optim_lib.SparseOptimizer] = None,
                 memory_fraction: float = 0.1, staleness: int = 0, cache_policy: str = "lfu",
                 seed: Optional[int] = None, fused_params: Optional[Dict[str, Any]] = None, backend: str = "mlkv",
                 reopen: bool = False, cuts: Optional[Dict[int, Any]] = None, **kwargs: Any) -> None:
        self._told_planner = False
        self.options = DiskTableOptions(os.fspath(storage_dir), optimizer, memory_fraction, staleness, cache_policy,
                                        draw_seed() if seed is None else seed, backend, seed_drawn=seed is None,
                                        reopen=reopen, cuts=cuts)
        if optimizer is not None:
            fused_params = {**fused_params_of(optimizer), **(fused_params or {})}
        super().__init__(fused_params=fused_params, **kwargs)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type not in _DISK_SHARDING_TYPES:
            return kernels
        if _planning_with_disk.get():
            return kernels + [DISK_KERNEL]
        # Another planner (DistributedModelParallel's default, say) cannot estimate the disk kernel:
        # it plans every table in memory, and says how to put tables on disk.
        if not self._told_planner:
            self._told_planner = True
            warnings.warn("DiskEmbeddingBagCollectionSharder: this plan comes from a planner that does not know the "
                          "disk kernel (DistributedModelParallel's default when no plan= is passed): every table stays "
                          "in memory. To put tables on disk, plan with mlkv_torch.torchrec.DiskAwarePlanner("
                          "topology=Topology(world_size, compute_device, ddr_cap=<host memory per rank>), ...) "
                          "and pass "
                          "plan=planner.collective_plan(model, [sharder]) to DistributedModelParallel", stacklevel=2)
        return kernels

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedDiskEmbeddingBagCollection:
        return ShardedDiskEmbeddingBagCollection(
            module, params, env, self.options, fused_params=self.fused_params, device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    @property
    def sharded_module_type(self) -> Type[ShardedDiskEmbeddingBagCollection]:
        return ShardedDiskEmbeddingBagCollection
