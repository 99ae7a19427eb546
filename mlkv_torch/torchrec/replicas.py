"""HET across ranks: replicas of the globally hottest rows of sharded tables on every rank, read and
written within per-row bounds, so that most lookups skip TorchRec's all-to-alls.

`replicate_hot_rows(sharded_collection, ReplicaSettings(...))` hooks a ShardedEmbeddingBagCollection
(TorchRec's or the disk sharder's) under DistributedModelParallel. Each training step:

- **Split.** A bag of a replicated table whose ids are all hot is a *hit*: it is pooled on the rank
  from the replica. The other bags (*misses*) go through TorchRec's input and output distribution
  as a variable-batch KeyedJaggedTensor (VBE), so the output all-to-all carries only them; the
  output is gathered back in batch order from theirs and the hits (`VariableOutputLayout`).
- **Push and refresh in one.** Each row the step must send to its owner travels as one extra
  single-id bag of the same distribution (a *push bag*): its forward output is the owner's current
  row (the refresh), its gradient is what the rank accumulated for the row plus this step's (the
  push). The owner's fused optimizer sums it with the step's other gradients of the row, as
  without replicas. A row goes when a hit reads it more than `pull_bound` steps after its value
  was read (the owner updates a row at most once a step, so it then misses at most `pull_bound`
  of the owner's updates), when its oldest unpushed gradient is `push_bound` steps old, and every
  row with an unpushed gradient before the hot rows are chosen again or a checkpoint is cut.
  At bounds 0 every row a step reads goes in that step: training is exact.
- **Choice.** The lookups of the replicated tables are counted; after `warmup_steps` steps and
  then every `refresh_every` steps, every rank offers its most frequent rows and all choose the
  same ones: the `fraction` of the sharded tables' rows (all together) with the most lookups over
  the ranks. So a small table whose rows are all hot may be replicated whole, and a large one gets
  less than its share (docs/benchmarks.md has what that gains over a share of each table).

A virtual table (TorchRec's ``use_virtual_table``) counts by the ids its ranks keep, not its id
space: each shard at most its eviction trigger (`mlkv_torch.virtual_tables.rows_held`).

A rank replicates only the tables other ranks own part of: its own table's rows are pooled where
they are, so a replica of them would save no byte and cost the split. A table is so counted only
on the ranks that replicate it; its counts are scaled by all ranks over those, so that a table
one rank owns competes on equal terms with one they all share. Tables that are data-parallel in the
plan are left alone (every rank holds them whole), as are evaluations (no gradient): they read the
owners' rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from .. import _C, wire
from ..cache_keys import cache_key, row_of, table_of
from ..checks import is_int
from ..disk_modules import DiskTableModule
from ..ranks import all_gather_objects
from ..virtual_tables import rows_held
from .variable_batch import VariableOutputLayout, accept_variable_batches, variable_batch_input

__all__ = ["ReplicaSettings", "HotRowReplicas", "replicate_hot_rows", "replica_memory_bytes"]

_NEVER = -(1 << 62)  # the step a never-read replica row's value is from
_CANDIDATES = 2  # each rank offers this many times the replicas' rows of its most frequent rows
# The shardings whose tables replicas serve: a push bag reaches each owner of its row through
# TorchRec's own input distribution (by column block, and by row block for row-wise tables).
REPLICATED_SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                             ShardingType.TABLE_COLUMN_WISE.value, ShardingType.ROW_WISE.value,
                             ShardingType.TABLE_ROW_WISE.value)
_COUNT_EVERY = 16  # training steps whose lookups are counted together (sorting them once)
_KEPT_SPLITS = 16  # batches read ahead whose split is kept for their step


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """How hot rows are replicated (the runner's ``storage.replicas``).

    Args:
        fraction: the rows chosen for replicas, a share of the sharded tables' rows (together, the
            hottest of any table), in [0, 1); 0: none. A rank keeps those of the tables it replicates.
        pull_bound: a replica serves a row at most this many of the owner's updates stale.
        push_bound: a rank's gradient of a replicated row reaches its owner at most this many steps late.
        refresh_every: steps between choices of the hot rows (after the first).
        warmup_steps: steps whose lookups are counted before the first choice.
    """

    fraction: float = 0.0
    pull_bound: int = 0
    push_bound: int = 0
    refresh_every: int = 25
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1), got {self.fraction!r}")
        for key in ("pull_bound", "push_bound"):
            value = getattr(self, key)
            if not is_int(value) or value < 0:
                raise ValueError(f"{key} must be a non-negative int, got {value!r}")
        for key in ("refresh_every", "warmup_steps"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")


def replica_memory_bytes(rows: int, dim: int, fraction: float) -> int:
    """Host bytes of one table's replica: its rows and their unpushed gradients (float32), and per
    row its id, the step of its value and of its oldest unpushed gradient."""
    hot = int(fraction * rows)
    return hot * (2 * dim * 4 + 3 * 8 + 1)


@dataclasses.dataclass
class _HitIds:
    """Some ids of a group's hit bags, pooled together: `rows` into the table they are read from,
    `offsets` (one per hit bag, and their count) into `rows`, `weights` per id or None."""

    rows: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]

    def pooled(self, table: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(self.rows, table, self.offsets, mode="sum", per_sample_weights=self.weights,
                               include_last_offset=True)

    def per_id(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of each id, from that of the pooled bags."""
        per_id = grad.repeat_interleave(self.offsets.diff(), dim=0)
        return per_id * self.weights.unsqueeze(1) if self.weights is not None else per_id

    @staticmethod
    def of(step: "_GroupStep", bag_of_id: torch.Tensor, take: torch.Tensor, rows: torch.Tensor,
           even_none: bool = False) -> Optional["_HitIds"]:
        """The hit ids `take` (a mask over them; `bag_of_id` the hit bag of each), read at `rows`;
        None if no id is taken, unless `even_none`."""
        taken = take.nonzero().squeeze(1)
        if taken.numel() == 0 and not even_none:
            return None
        bags = step.hit_offsets.numel() - 1
        per_bag = torch.bincount(bag_of_id[taken], minlength=bags)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(per_bag)
        weights = step.hit_weights[taken] if step.hit_weights is not None else None
        return _HitIds(rows[taken], offsets, weights)


class _ServedHits(torch.autograd.Function):
    """The hits' ids served from the replica rows, pooled. Backward adds their gradients to what the
    rank owes. Nothing in the graph needs its backward, so autograd runs it while the gradients' all-to-all
    is in flight: created after TorchRec's request and before its wait, it comes after the wait's
    backward (which sends) and before the request's (which waits). `anchor`, a leaf, puts it in the graph."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, group: "_ReplicaGroup", served: _HitIds) -> torch.Tensor:
        ctx.group, ctx.served = group, served
        return served.pooled(group.values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None]:
        served = ctx.served
        ctx.group.pending.index_add_(0, served.rows, served.per_id(grad))
        return None, None, None


class _PushedHits(torch.autograd.Function):
    """The hits' ids of rows sent as push bags, pooled from the rows the push bags refreshed
    (`fresh`). Backward: each push bag's gradient is its ids' plus what the rank owed for its row."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, pushed: _HitIds, owed: torch.Tensor) -> torch.Tensor:
        ctx.pushed, ctx.owed = pushed, owed
        return pushed.pooled(fresh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        pushed = ctx.pushed
        return ctx.owed.clone().index_add_(0, pushed.rows, pushed.per_id(grad)), None, None


class _Owed(torch.autograd.Function):
    """Identity forward; backward gives the push bags' rows what the rank owed for them (a group
    with no hit in the step)."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, owed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(owed)
        return fresh.view_as(fresh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (owed,) = ctx.saved_tensors
        return grad + owed, None


class _ReplicatedTable:
    """A sharded table replicated on this rank."""

    def __init__(self, name: str, rows: int, dim: int, features: List[str], mean: bool, remote_columns: int,
                 index: int, weight: float) -> None:
        self.name, self.rows, self.dim, self.features, self.mean = name, rows, dim, features, mean
        # Columns one bag's output gets from other ranks: those of the column shards they own (a
        # row-wise table: each other rank's partial sum, a whole row).
        self.remote_columns = remote_columns
        self.index = index  # among the collection's sharded tables, the same on every rank
        self.weight = weight  # ranks over the ranks that count its lookups (those that replicate it)


def _summed(ids: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids (ascending) and the sum of their counts."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return unique, torch.zeros(unique.numel(), dtype=counts.dtype).index_add_(0, inverse, counts)


def _most_frequent(counts: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest counts, ties to the earlier position (the smaller id)."""
    order = torch.sort(-counts, stable=True).indices
    return order[: min(k, order.numel())]


class _ReplicaGroup:
    """The replicated tables of one embedding dimension on this rank, their hot rows in one slot
    space (ordered by table, then row), so a step's bookkeeping is a few tensor operations."""

    def __init__(self, tables: List[_ReplicatedTable], hot_count: int, sharded_tables: int) -> None:
        self.tables = tables
        self.dim = tables[0].dim
        self.hot_count = hot_count  # the rows chosen over every sharded table of this width
        self.global_index = torch.tensor([t.index for t in tables], dtype=torch.int64)
        self.local_index = torch.full((sharded_tables,), -1, dtype=torch.int64)  # -1: not replicated here
        self.local_index[self.global_index] = torch.arange(len(tables))
        self.weights = torch.tensor([t.weight for t in tables], dtype=torch.float64)
        # (keys, lookups): this rank's counts since the last choice, and its most counted keys before it
        self.counted: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.keys = torch.empty(0, dtype=torch.int64)  # cache keys (cache_keys.cache_key), ascending
        self.slot_tables = torch.empty(0, dtype=torch.int64)  # each slot's table index
        self.values = torch.empty(0, self.dim)
        self.pending = torch.empty(0, self.dim)  # gradients not pushed yet
        self.has_pending = torch.empty(0, dtype=torch.bool)
        self.pending_since = torch.empty(0, dtype=torch.int64)  # the step of the oldest unpushed gradient
        self.read_at = torch.empty(0, dtype=torch.int64)  # the step whose forward read the value
        self.index = _C.HotRowIndex(self.keys)  # key -> slot
        self.remote_columns = torch.tensor([t.remote_columns for t in tables], dtype=torch.int64)
        self.uncounted: List[torch.Tensor] = []  # training steps' keys not counted yet (counted in bulk)
        self.version = 0  # of the hot rows: each choice makes a new one

    @property
    def size(self) -> int:
        return self.keys.numel()

    def table_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self.slot_tables[slots]

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        return row_of(self.keys[slots])

    def set_hot(self, keys: torch.Tensor) -> None:
        """Takes the new hot rows' keys (ascending, with nothing owed: the step before pushed it all);
        rows that stay hot keep their value and the step it was read at."""
        values, read_at = torch.zeros(keys.numel(), self.dim), torch.full((keys.numel(),), _NEVER, dtype=torch.int64)
        slots, kept = self.slots_of(keys)
        values[kept], read_at[kept] = self.values[slots[kept]], self.read_at[slots[kept]]
        self.keys, self.values, self.read_at = keys, values, read_at
        self.slot_tables = table_of(keys)
        self.index = _C.HotRowIndex(keys)
        self.version += 1
        self.pending = torch.zeros(keys.numel(), self.dim)
        self.has_pending = torch.zeros(keys.numel(), dtype=torch.bool)
        self.pending_since = torch.zeros(keys.numel(), dtype=torch.int64)

    def slots_of(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each key's slot, and whether it is hot."""
        if self.size == 0:
            return torch.zeros_like(keys), torch.zeros(keys.shape, dtype=torch.bool)
        slots = torch.searchsorted(self.keys, keys).clamp_(max=self.size - 1)
        return slots, self.keys[slots] == keys

    def count(self) -> None:
        """Counts the lookups kept since the last count."""
        if self.uncounted:
            self.counted.append(torch.unique(torch.cat(self.uncounted), return_counts=True))
            self.uncounted = []

    def candidates(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's most looked-up rows, keyed by their table's index among the sharded tables,
        and their scaled lookups; they stay counted for the next choice."""
        self.count()
        if not self.counted:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)
        keys, totals = _summed(torch.cat([k for k, _ in self.counted]), torch.cat([c for _, c in self.counted]))
        scaled = totals * self.weights[table_of(keys)]
        top = _most_frequent(scaled, _CANDIDATES * self.hot_count)
        self.counted = [(keys[top], totals[top])]
        keys = keys[top]
        return cache_key(self.global_index[table_of(keys)], row_of(keys)), scaled[top]

    def choose(self, offered: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Chooses the rows with the most lookups over every rank's candidates (the same on every
        rank), and takes those of the tables replicated here."""
        keys, totals = _summed(torch.cat([k for k, _ in offered]), torch.cat([c for _, c in offered]))
        chosen = keys[_most_frequent(totals, self.hot_count)]
        local = self.local_index[table_of(chosen)]
        mine = local >= 0
        self.set_hot(cache_key(local[mine], row_of(chosen[mine])).sort().values)

    STATE = ("keys", "values", "pending", "has_pending", "pending_since", "read_at")


@dataclasses.dataclass
class _GroupSplit:
    """A batch's bags of one group's tables: the hits, and the misses kept for TorchRec."""

    members: List[Tuple[int, int]]  # (table, feature position in the batch)
    at: List[int]  # the members' feature positions
    group_keys: torch.Tensor  # each id's key, feature after feature
    hit_bags: Optional[torch.Tensor] = None  # the hits among the group's bags (None, and the rest: no hot rows yet)
    hit_offsets: Optional[torch.Tensor] = None  # their offsets into hit_slots
    hit_slots: Optional[torch.Tensor] = None  # the slot of each id of a hit
    value_hit: Optional[torch.Tensor] = None  # per id, whether its bag is a hit
    kept_lengths: List[torch.Tensor] = dataclasses.field(default_factory=list)  # the misses, per feature
    kept_ids: List[torch.Tensor] = dataclasses.field(default_factory=list)
    kept_values: List[int] = dataclasses.field(default_factory=list)  # ids of misses per feature
    inverse: Optional[torch.Tensor] = None  # [features, batch]: each sample's bag among the misses

    @staticmethod
    def of(group: "_ReplicaGroup", keys: List[str], batch: int, lengths: torch.Tensor,
           values: List[torch.Tensor]) -> Optional["_GroupSplit"]:
        members = _members(group, keys)
        if not members:
            return None
        at = [p for _, p in members]
        if group.size == 0:
            return _GroupSplit(members, at, _keys(members, values))
        (group_keys, value_hit, hit_bags, hit_offsets, hit_slots, kept_lengths, kept_ids, kept_bags, kept_values,
         inverse) = group.index.split([values[p].long() for p in at], [t for t, _ in members],
                                      lengths[at].reshape(-1).long(), batch)
        return _GroupSplit(members, at, group_keys, hit_bags, hit_offsets, hit_slots, value_hit,
                           list(kept_lengths.to(lengths.dtype).split(kept_bags)),
                           [part.to(values[p].dtype) for p, part in zip(at, kept_ids.split(kept_values))],
                           kept_values, inverse)


@dataclasses.dataclass
class _GroupStep:
    """What one group's split of a training step leaves for its merge."""

    keys: List[str]  # the group's features in the batch, in order
    hit_bags: torch.Tensor  # of the group's bags (feature after feature), those pooled here
    hit_offsets: torch.Tensor  # their bags' offsets into hit_slots
    hit_slots: torch.Tensor  # the slot of each of their ids
    hit_weights: Optional[torch.Tensor]  # per id: its weight, over the bag's length for mean pooling
    push: torch.Tensor  # slots sent as push bags, ascending (so by table)
    push_per_table: List[int]
    owed: torch.Tensor  # what the rank owed for the pushed rows before this step


class HotRowReplicas:
    """Replicas of hot rows on one rank, hooked into a sharded collection (`replicate_hot_rows`)."""

    def __init__(self, sharded: nn.Module, settings: ReplicaSettings) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            raise ValueError("replicas need several ranks: with one, every row is local (set fraction to 0)")
        device = getattr(sharded, "_device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"replicas run on plans computed on the CPU (gloo) so far, this one on {device}")
        self.settings = settings
        self.rank = dist.get_rank()
        self.step = 0  # training steps the collection has run
        self._push_all_in_step: Optional[int] = None
        self._steps: Optional[List[Optional[_GroupStep]]] = None  # the step in flight
        self._batch_size = 0  # its samples
        # (group, batch) -> the batch's ids, the hot rows' version, its split: from lookaheads
        self._splits: Dict[Tuple[int, int, int], Tuple[torch.Tensor, int, _GroupSplit]] = {}
        # A list to record in, step by step from the first choice, the ids each table served and pushed.
        self.trace: Optional[List[Dict[str, Dict[str, List[int]]]]] = None
        # This rank's lookups into replicated tables, those replicas served, and rows sent as push bags
        # (bytes by kind: mlkv_torch.wire).
        self.stats: Dict[str, int] = dict.fromkeys(("lookups", "replica_hits", "push_rows"), 0)
        plan = sharded.module_sharding_plan  # table -> ParameterSharding
        world = dist.get_world_size()
        by_dim: Dict[int, List[_ReplicatedTable]] = {}  # the tables replicated here
        sharded_by_dim: Dict[int, List[str]] = {}  # every sharded table
        rows_by_dim: Dict[int, int] = {}
        self.dims: Dict[str, int] = {}
        for config in sharded._embedding_bag_configs:
            for name in config.feature_names:
                self.dims[name] = config.embedding_dim
            sharding = plan[config.name]
            if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            if sharding.sharding_type not in REPLICATED_SHARDING_TYPES:
                raise ValueError(f"table {config.name!r} is sharded {sharding.sharding_type}; replicas of hot rows "
                                 f"take tables sharded {list(REPLICATED_SHARDING_TYPES)} (or data-parallel): "
                                 f"constrain it (ParameterConstraints(sharding_types=[...])) or turn replicas off")
            dim, index = config.embedding_dim, sum(len(names) for names in sharded_by_dim.values())
            sharded_by_dim.setdefault(dim, []).append(config.name)
            shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
            row_blocks = {int(s.shard_offsets[0]): int(s.shard_sizes[0]) for s in shards}  # columns share rows
            rows_by_dim[dim] = rows_by_dim.get(dim, 0) + rows_held(config, list(row_blocks.values())
                                                                   or [config.num_embeddings])
            owners = {s.placement.rank() for s in shards}
            remote_columns = sum(int(s.shard_sizes[1]) for s in shards if s.placement.rank() != self.rank)
            if remote_columns == 0:  # this rank owns it whole
                continue
            counting = world - (1 if len(owners) == 1 else 0)  # the ranks that replicate it
            table = _ReplicatedTable(config.name, config.num_embeddings, dim, list(config.feature_names),
                                     config.pooling == PoolingType.MEAN, remote_columns, index, world / counting)
            by_dim.setdefault(dim, []).append(table)
        for dim, names in sharded_by_dim.items():
            if int(settings.fraction * rows_by_dim[dim]) == 0 and settings.fraction > 0:
                raise ValueError(f"a fraction of {settings.fraction} of the {rows_by_dim[dim]:,} rows of the sharded "
                                 f"tables {names} is no row: raise it")
        sharded_tables = sum(len(names) for names in sharded_by_dim.values())
        self.groups = [_ReplicaGroup(tables, int(settings.fraction * rows_by_dim[dim]), sharded_tables)
                       for dim, tables in by_dim.items()]
        self._chosen = False  # whether hot rows were chosen (from then on every batch is split)
        self._anchor = torch.zeros(0, requires_grad=True)  # puts the served hits' pooling in the graph
        self._sharded = sharded
        self._handles = accept_variable_batches(sharded, self.dims)
        self._layout = VariableOutputLayout(sharded)
        if getattr(sharded, "_has_mean_pooling_callback", False):
            raise ValueError("replicas do not take plans TorchRec mean-pools after its output all-to-all (mean "
                             "pooling of a row-wise table) yet")
        self._lookahead = sharded.lookahead if isinstance(sharded, DiskTableModule) else None
        self._handles += [sharded.register_forward_pre_hook(self._before_forward),
                          sharded.register_forward_hook(self._after_forward)]
        if self._lookahead is not None:
            sharded.lookahead = self._lookahead_misses  # type: ignore[assignment]

    # ---- the public handle ----------------------------------------------------------------------------
    def push_all_in_next_step(self) -> None:
        """The next training step pushes every unpushed gradient (before a checkpoint's cut)."""
        self._push_all_in_step = self.step

    def owed_rows(self) -> int:
        """Rows whose gradient this rank has not pushed yet."""
        return sum(int(g.has_pending.sum()) for g in self.groups)

    def hit_rate(self) -> Optional[float]:
        """The share of this rank's lookups into replicated tables that replicas served."""
        return self.stats["replica_hits"] / self.stats["lookups"] if self.stats["lookups"] else None

    def state_dict(self) -> Dict[str, Any]:
        """The replicas' rows and bookkeeping, for a checkpoint: resuming from it continues exactly."""
        for group in self.groups:
            group.count()  # the lookups kept since the last count are in the counts saved
        return {"step": self.step,
                "groups": [{key: getattr(g, key).clone() for key in _ReplicaGroup.STATE} for g in self.groups],
                "counted": [[(k.clone(), c.clone()) for k, c in g.counted] for g in self.groups]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state["groups"]) != len(self.groups) or any(
                saved["values"].shape != (saved["keys"].numel(), group.dim)
                or bool((table_of(saved["keys"]) >= len(group.tables)).any())
                for group, saved in zip(self.groups, state["groups"])):
            raise ValueError("the replicas' state is of another plan or rank: resume with the plan and ranks it was "
                             "saved with")
        self.step = int(state["step"])
        for group, saved in zip(self.groups, state["groups"]):
            for key in _ReplicaGroup.STATE:
                setattr(group, key, saved[key])
            group.slot_tables = table_of(group.keys)
            group.index = _C.HotRowIndex(group.keys)
            group.version += 1
        self._chosen = self.step > self.settings.warmup_steps
        for group, counted in zip(self.groups, state["counted"]):
            group.counted = counted

    # ---- the step ----------------------------------------------------------------------------------
    def _choice_due(self, step: int) -> bool:
        s = self.settings
        return step >= s.warmup_steps and (step - s.warmup_steps) % s.refresh_every == 0

    def _choose(self) -> None:
        candidates = {g.dim: g.candidates() for g in self.groups}  # ranks may replicate other widths
        offer_bytes = 16 * sum(keys.numel() for keys, _ in candidates.values())  # a key and its count, 8 bytes each
        wire.count("replica_choice", offer_bytes)
        offered = all_gather_objects(candidates)
        for group in self.groups:
            group.choose([o[group.dim] for o in offered if group.dim in o])
        self._chosen = True

    def _before_forward(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        features = args[0]
        if not (module.training and torch.is_grad_enabled()) or not isinstance(features, KeyedJaggedTensor):
            return None
        if self._choice_due(self.step):
            self._choose()
        if not self._chosen:  # warming up: only counted
            values = list(torch.split(features.values(), features.length_per_key()))
            for group in self.groups:
                self._count(group, _keys(_members(group, features.keys()), values))
            self.step += 1
            return None
        if self.trace is not None:
            self.trace.append({})
        push_all = self._choice_due(self.step + 1) or self._push_all_in_step == self.step
        kjt, self._steps = self._split(features, push_all=push_all, train=True)
        self._batch_size = features.stride()
        return (kjt,) + tuple(args[1:])

    def _lookahead_misses(self, features: KeyedJaggedTensor) -> None:
        """The sharded collection's lookahead, for the bags that will miss the replicas."""
        if not self._chosen:
            return self._lookahead(features)  # type: ignore[misc]
        self._lookahead(self._split(features, push_all=False, train=False)[0])  # type: ignore[misc]

    def _split(self, features: KeyedJaggedTensor, push_all: bool, train: bool
               ) -> Tuple[KeyedJaggedTensor, List[Optional[_GroupStep]]]:
        """The variable batch of the misses and push bags, and what each group's merge needs."""
        keys = features.keys()
        B = features.stride()
        lengths = features.lengths().view(len(keys), B)
        values = list(torch.split(features.values(), features.length_per_key()))
        weights = features.weights_or_none()
        weights_by_feature = list(torch.split(weights, features.length_per_key())) if weights is not None else None
        new_lengths: List[torch.Tensor] = list(lengths)
        new_values, new_weights = list(values), list(weights_by_feature) if weights_by_feature is not None else None
        inverse = torch.arange(B).expand(len(keys), B)
        inverse_parts: Dict[Tuple[int, ...], torch.Tensor] = {}  # features -> their samples' bags
        extra: Dict[int, torch.Tensor] = {}  # feature -> push bags' ids
        steps: List[Optional[_GroupStep]] = []
        for group in self.groups:
            split = self._group_split(group, features, lengths, values, keep=not train)
            if split is None:
                steps.append(None)
                continue
            if train:
                self._count(group, split.group_keys)
            if split.hit_bags is None:  # no hot rows yet
                steps.append(None)
                continue
            members, at, value_hit = split.members, split.at, split.value_hit
            for p, part in zip(at, split.kept_lengths):
                new_lengths[p] = part
            for p, part in zip(at, split.kept_ids):
                new_values[p] = part
            if new_weights is not None:
                group_weights = torch.cat([weights_by_feature[p] for p in at])  # type: ignore[index]
                for p, part in zip(at, group_weights[~value_hit].split(split.kept_values)):
                    new_weights[p] = part
            inverse_parts[tuple(at)] = split.inverse
            if train:
                hit_slots = split.hit_slots
                self.stats["replica_hits"] += hit_slots.numel()
                hit_weights = None
                mean = [group.tables[t].mean for t, _ in members]
                if new_weights is not None or any(mean):
                    hit_lengths = split.hit_offsets.diff()
                    hit_weights = group_weights[value_hit] if new_weights is not None else torch.ones(
                        hit_slots.numel())
                    per_value_mean = torch.tensor(mean)[torch.repeat_interleave(split.hit_bags // B, hit_lengths)]
                    lengths_of_value = torch.repeat_interleave(hit_lengths, hit_lengths).to(hit_weights.dtype)
                    hit_weights = torch.where(per_value_mean, hit_weights / lengths_of_value, hit_weights)
                present = torch.zeros(len(group.tables), dtype=torch.bool)
                present[[t for t, _ in members]] = True
                push, push_per_table, owed = self._decide(group, hit_slots, push_all, present)
                step = _GroupStep([keys[p] for p in at], split.hit_bags, split.hit_offsets, hit_slots,
                                  hit_weights, push, push_per_table, owed)
                first = {}  # each table's push bags go to its first feature in the batch
                for t, p in members:
                    first.setdefault(t, p)
                push_ids = group.rows_of(step.push).split(step.push_per_table)
                for t, p in first.items():
                    extra[p] = push_ids[t]
                steps.append(step)
            else:
                steps.append(None)
        for p, push_ids in extra.items():
            new_values[p] = torch.cat([new_values[p], push_ids.to(new_values[p].dtype)])
            new_lengths[p] = torch.cat([new_lengths[p], torch.ones(push_ids.numel(), dtype=new_lengths[p].dtype)])
            if new_weights is not None:
                new_weights[p] = torch.cat([new_weights[p], torch.ones(push_ids.numel(), dtype=new_weights[p].dtype)])
        # Every feature keeps a bag: the output's rows index into each (an empty bag costs a row).
        bags = []
        for p in range(len(keys)):
            if new_lengths[p].numel() == 0:
                new_lengths[p] = torch.zeros(1, dtype=lengths.dtype)
            bags.append(new_lengths[p].numel())
        wide = B + max((e.numel() for e in extra.values()), default=0)  # the samples, then the push bags' rows
        full = torch.zeros(len(keys), wide, dtype=torch.int64)
        full[:, :B] = inverse
        for at, part in inverse_parts.items():
            full[list(at), :B] = part
        for p, push_ids in extra.items():
            full[p, B:B + push_ids.numel()] = bags[p] - push_ids.numel() + torch.arange(push_ids.numel())
        kjt = variable_batch_input(self._sharded, keys, torch.cat(new_values), torch.cat(new_lengths),
                                   torch.cat(new_weights) if new_weights is not None else None, bags, full)
        return kjt, steps

    def _group_split(self, group: _ReplicaGroup, features: KeyedJaggedTensor, lengths: torch.Tensor,
                     values: List[torch.Tensor], keep: bool) -> Optional["_GroupSplit"]:
        """The batch's hits and misses in the group (None: no feature of it in the batch); a
        lookahead's (`keep`) is kept for its step, which takes it if the hot rows are the same."""
        key = (id(group), features.values().data_ptr(), features.values().numel())
        cached = self._splits.pop(key, None)
        # The lookahead's values are kept alive with it, so the same address is the same batch.
        if cached is not None and cached[0] is features.values() and cached[1] == group.version:
            return cached[2]
        split = _GroupSplit.of(group, features.keys(), features.stride(), lengths, values)
        if keep and split is not None:
            self._splits[key] = (features.values(), group.version, split)
            while len(self._splits) > _KEPT_SPLITS * len(self.groups):
                self._splits.pop(next(iter(self._splits)))
        return split

    def _count(self, group: _ReplicaGroup, group_keys: torch.Tensor) -> None:
        """Keeps a training step's lookups of the group's tables, for the next choice."""
        group.uncounted.append(group_keys[group_keys >= 0])  # a bad id (key -1) is no row
        # A step's merge counts its groups' at _COUNT_EVERY, while the all-to-alls run; here the
        # others' (warm-up, a group without hot rows).
        if len(group.uncounted) > _COUNT_EVERY:
            group.count()
        self.stats["lookups"] += group_keys.numel()

    def _decide(self, group: _ReplicaGroup, hit_slots: torch.Tensor, push_all: bool, present: torch.Tensor
                ) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        """Which rows the step sends as push bags (ascending, so by table; and how many of each
        table), and what was owed for them (see the module); the other rows its hits read come from
        the replica. Push bags go with a feature of their table, so only tables `present` in the
        batch push."""
        step, s = self.step, self.settings
        used_mask = torch.zeros(group.size, dtype=torch.bool)
        used_mask[hit_slots] = True
        used = used_mask.nonzero().squeeze(1)  # ascending
        stale = used[(step - group.read_at[used]) > s.pull_bound]
        since = group.pending_since.clone()
        first_use = used[~group.has_pending[used]]
        since[first_use] = step
        owing = (group.has_pending | used_mask) & present[group.slot_tables]
        push_mask = owing if push_all else owing & (since + s.push_bound <= step)
        push_mask[stale] = True
        push = push_mask.nonzero().squeeze(1)
        local = used[~push_mask[used]]
        group.pending_since[first_use] = step
        group.has_pending[local] = True
        owed = group.pending[push].clone()
        group.pending[push] = 0
        group.has_pending[push] = False
        per_table = torch.bincount(group.table_of(push), minlength=len(group.tables))
        nbytes = int((per_table * group.remote_columns).sum()) * 4  # float32 columns other ranks own
        self.stats["push_rows"] += push.numel()
        wire.reattribute("gradients", "replica_pushes", nbytes)
        wire.reattribute("outputs", "replica_refreshes", nbytes)
        if self.trace is not None:
            for t, table in enumerate(group.tables):
                self.trace[-1][table.name] = {
                    "served": group.rows_of(local[group.table_of(local) == t]).tolist(),
                    "pushed": group.rows_of(push[group.table_of(push) == t]).tolist()}
        return push, per_table.tolist(), owed

    def _after_forward(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        steps, self._steps = self._steps, None
        if steps is None:
            return None
        # TorchRec's output all-to-alls are in flight until `layout.rows` waits for them: what does
        # not need their rows is done before (the hits served from the replicas above all).
        layout = self._layout
        block_start = layout.block_start(output)
        self.step += 1
        batch = self._batch_size
        keys, inverse = args[0].inverse_indices()
        position = {key: i for i, key in enumerate(keys)}
        index = layout.gather_index(block_start, inverse[[position[f] for f in layout.block_features], :batch])
        flat = index.view(-1)  # each output unit's row among `sources`, the hits' rows put in below
        rows_before = int(block_start[-1])
        merges = []
        for group, step in zip(self.groups, steps):
            if step is None:
                continue
            if len(group.uncounted) >= _COUNT_EVERY:
                group.count()
            group.read_at[step.push] = self.step - 1
            fresh_rows = []  # each table's push bags come back in its first feature's rows
            for table, n in zip(group.tables, step.push_per_table):
                if n:
                    first = next(f for f in table.features if f in position)
                    bags = inverse[position[first], batch:batch + n]
                    fresh_rows.append(layout.feature_rows(block_start, first, bags))
            fresh_index = torch.cat(fresh_rows).reshape(-1) if fresh_rows else None
            units = group.dim // layout.unit
            pool = self._pool_hits(group, step) if step.hit_bags.numel() else None
            if pool is not None:
                # The group's hit bag k is bag k % batch of its feature k // batch.
                starts = torch.tensor([layout.feature_start[k] for k in step.keys])[step.hit_bags // batch]
                at = ((step.hit_bags % batch) * layout.output_units + starts).unsqueeze(1) + torch.arange(units)
                flat[at.reshape(-1)] = rows_before + torch.arange(step.hit_bags.numel() * units)
                rows_before += step.hit_bags.numel() * units
            owed_alone = fresh_index is not None and (pool is None or pool[1] is None)
            if owed_alone:  # in no output unit: its backward pushes what was owed
                rows_before += step.push.numel() * units
            merges.append((group, step, fresh_index, pool, owed_alone))
        src = layout.rows(output)  # the misses' and push bags' rows from TorchRec
        sources = [src]
        for group, step, fresh_index, pool, owed_alone in merges:
            fresh = src.index_select(0, fresh_index).view(-1, group.dim) if fresh_index is not None else None
            if fresh is not None:
                group.values[step.push] = fresh.detach()
            if pool is not None:
                pooled, pushed = pool
                if pushed is not None:
                    from_push = _PushedHits.apply(fresh, pushed, step.owed)
                    pooled = from_push if pooled is None else pooled + from_push
                sources.append(pooled.view(-1, layout.unit))
            if owed_alone:
                sources.append(_Owed.apply(fresh, step.owed).view(-1, layout.unit))
        merged = torch.cat(sources).index_select(0, flat).view(batch, -1)
        return KeyedTensor(keys=layout.keys, length_per_key=layout.dims, values=merged)

    def _pool_hits(self, group: _ReplicaGroup, step: _GroupStep
                   ) -> Tuple[Optional[torch.Tensor], Optional[_HitIds]]:
        """A step's hits, those of its ids served from the replica pooled now; the ids of rows the
        step pushes, to pool from the push bags' refreshed rows (None: none)."""
        position = torch.full((group.size,), -1, dtype=torch.int64)  # of each slot among the push bags
        position[step.push] = torch.arange(step.push.numel())
        pushed_as = position[step.hit_slots]
        bag_of_id = torch.repeat_interleave(step.hit_offsets.diff())
        pushed = _HitIds.of(step, bag_of_id, pushed_as >= 0, pushed_as)
        served = _HitIds.of(step, bag_of_id, pushed_as < 0, step.hit_slots, even_none=pushed is None)
        return (_ServedHits.apply(self._anchor, group, served) if served is not None else None), pushed


def _members(group: _ReplicaGroup, keys: List[str]) -> List[Tuple[int, int]]:
    """The group's (table, feature position) in a batch of features `keys`."""
    position = {k: i for i, k in enumerate(keys)}
    return [(t, position[f]) for t, table in enumerate(group.tables) for f in table.features if f in position]


def _keys(members: List[Tuple[int, int]], values: List[torch.Tensor]) -> torch.Tensor:
    """The members' ids' keys, member after member."""
    if not members:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([cache_key(t, values[p].long()) for t, p in members])


def replicate_hot_rows(sharded: nn.Module, settings: ReplicaSettings) -> HotRowReplicas:
    """Replicates hot rows of a ShardedEmbeddingBagCollection's sharded tables on this rank (every
    rank calls it, after DistributedModelParallel is built); returns the handle."""
    return HotRowReplicas(sharded, settings)
