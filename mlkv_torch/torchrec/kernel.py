"""The disk kernel of a sharding plan: `DiskEmbeddingKernel` pools a rank's shards of the tables
planned on ``customized_kernel`` (`DISK_KERNEL`), each a DiskEmbeddingBag, after TorchRec's input
distribution (or, for an EmbeddingCollection's, looks up one embedding per id), and serves their
rows to state dicts as ShardedTensor shards."""
from __future__ import annotations

import functools
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..checks import is_int
from ..cut import CutPart
from ..embedding import DiskEmbeddingBag
from ..memory_budget import shard_memory_budget
from ..table_settings import DiskTableSettings
from ..virtual_tables import IdPolicy, activity_bytes, id_policy_of
from .read_aheads import ReadAheads
from .fused_optimizer import DiskFusedOptimizer, TableOptimizerState, optimizer_from_fused_params
from .state_dicts import disk_tables_in_state_dict
from .tables import DATA_TYPES, disk_table_spec, open_disk_tables, table_seed

DISK_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
# Shardings whose ranks pool partial sums of a bag, which TorchRec reduces and, for mean pooling,
# divides by the bag's length afterwards: their kernels pool by sum.
_PARTIAL_SUM_SHARDINGS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
"""The compute kernel of disk tables in a sharding plan."""


def on_host(shard: ShardMetadata, device: Optional[torch.device] = None) -> ShardMetadata:
    """`shard` placed in its rank's host memory: a disk table's rows reach a state dict as CPU (or
    file-backed) tensors, whatever device the plan computes on (a ShardedTensor refuses local
    shards off their placement's device); on the meta device (a model sharded on meta), on meta."""
    rank = shard.placement.rank() if shard.placement is not None else 0
    where = "meta" if device is not None and device.type == "meta" else "cpu"
    return ShardMetadata(shard_offsets=list(shard.shard_offsets), shard_sizes=list(shard.shard_sizes),
                         placement=f"rank:{rank}/{where}")


def rank_storage_dir(storage_dir: str, rank: int) -> str:
    """Where rank `rank` keeps its shards of the disk tables under a sharder's storage_dir."""
    return os.path.join(storage_dir, f"rank{rank}")


@dataclass(frozen=True)
class DiskTableOptions:
    """How a sharder builds disk tables (see DiskEmbeddingBagCollectionSharder): their settings (its
    seed drawn), each shard's memory, and what a reopen and virtual tables need."""

    storage_dir: str
    settings: DiskTableSettings = DiskTableSettings()
    memory_fraction: float = 0.1
    # The cut each rank's tables reopen at ({rank: record}, a training checkpoint's); without it a
    # reopen goes to the cut the rank's directory records.
    cuts: Optional[Dict[int, Any]] = field(default=None, hash=False, compare=False)
    # The ids a table is expected to hold, by name, where far fewer than its rows (raw ids in a
    # table as large as their id space, TorchRec's use_virtual_table): its memory and disk are
    # sized by them (`live_rows`).
    live_ids: Optional[Dict[str, int]] = field(default=None, hash=False, compare=False)
    # The user's config of each table, by name: TorchRec's table-wise shardings hand the kernel
    # shards without the virtual table's eviction policy, so it is read from here.
    table_configs: Optional[Dict[str, Any]] = field(default=None, hash=False, compare=False)

    def config_of(self, shard: Any) -> Any:
        """The user's config of the table `shard` (a config or a ShardedEmbeddingTable) belongs to."""
        return (self.table_configs or {}).get(shard.name, shard)

    def id_policy(self, shard: Any) -> Optional[IdPolicy]:
        """The IdPolicy of the table `shard` belongs to, from the user's config (None: not virtual)."""
        return id_policy_of(self.config_of(shard), self.settings.virtual_tables)

    def live_rows(self, table: str, rows: int, table_rows: int, cap: Optional[int] = None) -> int:
        """The rows a shard of `rows` of `table`'s `table_rows` is sized by: its share of the
        table's expected live ids (ids spread over the rows), else the most ids a virtual table
        keeps on a rank (`cap`, its eviction trigger), at most its rows."""
        live = (self.live_ids or {}).get(table)
        if live is not None:
            return min(rows, -(-live * rows // max(1, table_rows)))
        return rows if cap is None else min(rows, cap)

    def virtual_cap(self, config: Any) -> Optional[int]:
        """The rows a rank's shard of a virtual table is sized by (its policy's cap), None for a
        table that is not virtual; ValueError names a virtual table with neither a cap nor live_ids
        (it would be sized by its whole id space)."""
        policy = self.id_policy(config)
        if policy is None:
            return None
        if policy.cap is None and config.name not in (self.live_ids or {}):
            raise ValueError(f"table {config.name!r} is virtual ({config.num_embeddings:,} ids) with nothing to size "
                             f"it by: give its virtual_table_eviction_policy a training_id_eviction_trigger_count (the "
                             f"most ids a rank keeps), or the sharder live_ids={{{config.name!r}: <ids>}}")
        return policy.cap

    def shard_budget(self, config: Any, rows: int, row_bytes: int, load_factor: Optional[float] = None) -> int:
        """The host memory of a rank's shard of `rows` rows of the table `config` describes, each of
        `row_bytes` (`memory_budget.shard_memory_budget` of the rows it holds, and what a virtual
        table keeps of its ids): what the planner charges the shard and what its kernel opens with.
        `load_factor`, the plan's for this table (TorchRec's ``CacheParams.load_factor``), takes the
        place of `memory_fraction`."""
        config = self.config_of(config)
        held = self.live_rows(config.name, rows, config.num_embeddings, self.virtual_cap(config))
        fraction = self.memory_fraction if load_factor is None else _checked_load_factor(config.name, load_factor)
        return shard_memory_budget(held, row_bytes, fraction, activity_bytes(self.id_policy(config)))

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if not isinstance(self.settings, DiskTableSettings):
            raise TypeError(f"settings must be a DiskTableSettings, got {type(self.settings).__name__}")
        if any(not is_int(n) or n < 1 for n in (self.live_ids or {}).values()):
            raise ValueError(f"live_ids must map table names to positive ints, got {self.live_ids!r}")


def _checked_load_factor(table: str, load_factor: Any) -> float:
    if not isinstance(load_factor, (int, float)) or not 0.0 < load_factor <= 1.0:
        raise ValueError(f"table {table!r}: its cache load factor (CacheParams.load_factor, the share of its bytes "
                         f"a disk table holds in memory) must be in (0, 1], got {load_factor!r}")
    return float(load_factor)


def planned_load_factor(shard: Any, group_fused_params: Optional[Dict[str, Any]]) -> Optional[float]:
    """The memory share the plan gives a disk shard: its ``CacheParams.load_factor``, which TorchRec
    hands the kernel as the fused parameter ``cache_load_factor`` (None: the sharder's memory_fraction)."""
    return (shard.fused_params or group_fused_params or {}).get("cache_load_factor")


def bucket_problem(config: Any, world_size: int) -> Optional[str]:
    """Why a virtual table cannot be sharded row-wise by its buckets over `world_size` ranks, or None."""
    buckets = getattr(config, "total_num_buckets", None)
    if not getattr(config, "use_virtual_table", False) or not buckets or buckets % world_size == 0:
        return None
    return (f"table {config.name!r}: total_num_buckets {buckets} is not a multiple of the {world_size} ranks: a "
            f"disk table shards row-wise by whole buckets, as many on each rank")


class DiskEmbeddingKernel(BaseEmbedding, FusedOptimizerModule):
    """The disk tables of one group of a TorchRec lookup on this rank, behind one table-batched kernel
    per row layout (a DiskTableBatch; in DLRM one for all); each shard viewed as a DiskEmbeddingBag.

    ``forward(KJT) -> Tensor [batch, sum of feature dims]``, the features in the group's order,
    as TorchRec's fused kernel; for a group that does not pool (an EmbeddingCollection's,
    ``pooling`` NONE) ``[ids, dim]``, the features' ids one after the other, as TorchRec's
    sequence kernel.
    """

    def __init__(self, config: GroupedEmbeddingConfig, options: DiskTableOptions,
                 pg: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
                 sharding_type: Optional[ShardingType] = None) -> None:
        super().__init__()
        self._config = config
        self._device = torch.device(device if device is not None else "cpu")
        rank = dist.get_rank(pg) if pg is not None and dist.is_initialized() else 0
        self._rank_dir = rank_storage_dir(options.storage_dir, rank)
        self._pg = pg
        self._shards: List[ShardedEmbeddingTable] = list(config.embedding_tables)
        self._pooled = config.pooling != PoolingType.NONE
        specs = []
        world = dist.get_world_size(pg) if pg is not None and dist.is_initialized() else 1
        settings = options.settings
        for shard in self._shards:
            if sharding_type == ShardingType.ROW_WISE and bucket_problem(shard, world):
                raise ValueError(bucket_problem(shard, world))
            # A row shard sees the ids of its block local to it, as TorchRec's bucketization leaves them.
            row_offset, col_offset = self._offsets(shard)
            specs.append(disk_table_spec(
                shard, os.path.join(self._rank_dir, self._shard_name(shard)), table_seed(settings.seed, shard.name),
                optimizer_from_fused_params(shard.fused_params or config.fused_params, shard.name),
                seed_drawn=settings.seed_drawn, embedding_dim=shard.local_cols, first_column=col_offset,
                num_embeddings=shard.local_rows, first_row=row_offset, pooled=self._pooled,
                id_policy=options.id_policy(shard)))
            if sharding_type in _PARTIAL_SUM_SHARDINGS:  # mean pooling divides the reduced sums (TorchRec's callback)
                specs[-1] = replace(specs[-1], mode="sum")
        lrs = {spec.layout.optimizer.lr for spec in specs}
        if len(lrs) > 1:
            raise ValueError(f"the disk tables of one group must share a learning rate, got {sorted(lrs)}")
        # The rank's budget: each shard's, as the planner charged it; its row layouts share it by one rule.
        budget = sum(options.shard_budget(shard, shard.local_rows, spec.layout.row_bytes,
                                          planned_load_factor(shard, config.fused_params))
                     for shard, spec in zip(self._shards, specs))
        self._memory_budget_bytes = budget
        lr = lrs.pop() if lrs else 0.01
        self._read_aheads = ReadAheads()
        if self._device.type == "meta":  # as TorchRec's kernels on meta: shapes alone, nothing opened or written
            self._batches, self._routing, self.bags = [], None, nn.ModuleList()
            self._bags_by_table: Dict[str, List[Tuple[ShardedEmbeddingTable, DiskEmbeddingBag]]] = defaultdict(list)
            self._anchors = {name: nn.Parameter(torch.empty(0, device="meta"))
                             for name in dict.fromkeys(shard.name for shard in self._shards)}
            self._optimizer = DiskFusedOptimizer({f"{n}.weight": a for n, a in self._anchors.items()}, {}, lr)
            return
        opened = open_disk_tables(self._shards, specs, memory_budget_bytes=max(budget, 1), settings=settings.batch,
                                  device=self._device, cut_dir=self._rank_dir, reopen=settings.reopen,
                                  cut=(options.cuts or {}).get(rank),
                                  read_ahead_into_slots=settings.read_ahead_into_slots)
        self._batches, self._routing = opened.batches, opened.routing
        for batch in self._batches:
            # TorchRec's dense optimizers skip parameters that an in-backward optimizer owns.
            for anchor in batch.anchors:
                anchor._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self.bags = nn.ModuleList(opened.bags)
        self._bags_by_table = defaultdict(list)
        for table, bag in zip(self._shards, self.bags):
            self._bags_by_table[table.name].append((table, bag))
        self._anchors = {name: shards[0][1]._anchor for name, shards in self._bags_by_table.items()}
        state = {shards[0][1]._anchor: {f"{name}.optimizer_state": TableOptimizerState(
            functools.partial(self.optimizer_state, name), functools.partial(self.step_of, name),
            functools.partial(self.load_optimizer_state, name))}
                 for name, shards in self._bags_by_table.items() if shards[0][1].state_dim}
        self._optimizer = DiskFusedOptimizer({f"{n}.weight": a for n, a in self._anchors.items()}, state, lr)

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

    def forward(self, features: KeyedJaggedTensor, vbe_output_offsets: Optional[torch.Tensor] = None,
                vbe_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pools the group's features. With TorchRec's variable batch per feature the output is 1-D,
        laid out as fbgemm's kernel lays it out; when the lookup merges several kernels' outputs, it
        passes the merged output and where this kernel's bags go in it (`vbe_output_offsets[r][f]`:
        where feature f's bags from rank r begin), and gets the merged output back."""
        if self._device.type == "meta":
            return self._shapes_on_meta(features)
        self._optimizer.apply_lr(self._batches)  # its param_groups set the learning rate of this step
        read_aheads = self._read_aheads.take(self.training)
        if not self._pooled:
            per_feature = self._routing.look_up(self._batches, features, self.training, read_aheads)
            return torch.cat(per_feature) if per_feature else torch.empty(0, device=self._device)
        pooled = self._routing.pool(self._batches, features, self._config.is_weighted, self.training, read_aheads)
        if vbe_output is None:
            return pooled
        bags, dims = features.stride_per_key_per_rank(), self._config.embedding_dims()
        starts = vbe_output_offsets.tolist()  # type: ignore[union-attr]
        positions = torch.cat([torch.arange(start[f], start[f] + bags[f][r] * dims[f], device=pooled.device)
                               for r, start in enumerate(starts) for f in range(len(dims))]
                              + [torch.empty(0, dtype=torch.int64, device=pooled.device)])
        return vbe_output.reshape(-1).index_copy(0, positions, pooled)

    def _shapes_on_meta(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The output `forward` would give, on meta (nothing read)."""
        if not self._pooled:
            return torch.empty(features.values().numel(), self._config.embedding_dims()[0], device="meta")
        return torch.empty(features.stride(), sum(self._config.embedding_dims()), device="meta")

    def lookahead(self, features: KeyedJaggedTensor, token: Optional[int] = None) -> None:
        """Starts reading the rows that `features` (as `forward` receives them) will look up; returns
        at once. The forward of that batch pools from this read-ahead once named (`read_ahead_next`
        with `token`), or, without a token (TorchRec's prefetch, one batch ahead), as the next
        training forward in order."""
        if self._routing is not None:  # on meta there is nothing to read
            self._read_aheads.add(token, self._routing.lookahead(self._batches, features))

    def read_ahead_next(self, token: Optional[int]) -> None:
        """The next training forward pools the batch read ahead as `token` (`ReadAheads.name_next`)."""
        if self._routing is not None:
            self._read_aheads.name_next(token)

    @property
    def memory_budget_bytes(self) -> int:
        """The host memory this kernel's tables were given: the sum of its shards' budgets
        (`DiskTableOptions.shard_budget`), what the planner charged them."""
        return self._memory_budget_bytes

    @property
    def on_meta(self) -> bool:
        """Built on the meta device: shapes alone, no table opened."""
        return self._device.type == "meta"

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, anchor in self._anchors.items():
            yield f"{prefix}{name}.weight", anchor

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()

    def named_parameters_by_table(self) -> Iterator[Tuple[str, nn.Parameter]]:
        yield from self._anchors.items()

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
        return list(self._anchors)

    def local_weight_shards(self, table: str) -> List[Shard]:
        """This rank's shards of `table`, read from the stores (file-backed beyond their budget);
        written in place, they write through to the stores. On meta, meta tensors of their shape."""
        if self.on_meta:
            return [Shard(torch.empty(shard.local_rows, shard.local_cols, dtype=DATA_TYPES[shard.data_type],
                                      device="meta"), on_host(shard.local_metadata, self._device))
                    for shard in self._shards if shard.name == table]
        return [Shard(bag.written_through_snapshot(), on_host(shard.local_metadata))
                for shard, bag in self._bags_by_table[table]]

    def local_shards(self) -> List[Tuple[str, int, int, DiskEmbeddingBag]]:
        """(table, first row, first column, bag) of each of this rank's shards."""
        return [(shard.name, *self._offsets(shard), bag) for shard, bag in zip(self._shards, self.bags)]

    def load_weights(self, table: str, weight: torch.Tensor) -> None:
        """Writes this rank's shards of `table` from a ShardedTensor of the same plan or a full tensor."""
        for shard, bag in self._bags_by_table[table]:
            row_offset, col_offset = self._offsets(shard)
            bag.restore(weight=_local_part(weight, table, row_offset, col_offset, shard.local_rows, shard.local_cols))

    def optimizer_state(self, table: str) -> ShardedTensor:
        """The optimizer state of `table` on this rank: a ShardedTensor [rows, state columns of all shards]."""
        shards = self._bags_by_table[table]
        metadata = self._state_metadata(table)
        local = [Shard(bag.written_through_snapshot("state"),
                       metadata.shards_metadata[self._state_shard_index(table, shard)]) for shard, bag in shards]
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
