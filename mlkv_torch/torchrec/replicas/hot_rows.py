"""The replicas of a sharded collection on one rank (`HotRowReplicas`, hooked in by
`replicate_hot_rows`): each step's split, push and refresh, merge, and the choice of hot rows."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ... import _C, wire
from ...cache_keys import table_of
from ...disk_modules import DiskTableModule
from ...ranks import all_gather_objects
from ...virtual_tables import rows_held
from ..variable_batch import VariableOutputLayout, accept_variable_batches, variable_batch_input
from .autograd import HitIds, Owed, PushedHits, ServedHits
from .groups import GroupSplit, GroupStep, ReplicaGroup, ReplicatedTable, keys_of, members_of
from .settings import ReplicaSettings

# The shardings whose tables replicas serve: a push bag reaches each owner of its row through
# TorchRec's own input distribution (by column block, and by row block for row-wise tables).
REPLICATED_SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                             ShardingType.TABLE_COLUMN_WISE.value, ShardingType.ROW_WISE.value,
                             ShardingType.TABLE_ROW_WISE.value)
COUNT_EVERY = 16  # training steps whose lookups are counted together (sorting them once)
KEPT_SPLITS = 16  # batches read ahead whose split is kept for their step


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
        self._steps: Optional[List[Optional[GroupStep]]] = None  # the step in flight
        self._batch_size = 0  # its samples
        # (group, batch) -> the batch's ids, the hot rows' version, its split: from lookaheads
        self._splits: Dict[Tuple[int, int, int], Tuple[torch.Tensor, int, GroupSplit]] = {}
        # A list to record in, step by step from the first choice, the ids each table served and pushed.
        self.trace: Optional[List[Dict[str, Dict[str, List[int]]]]] = None
        # This rank's lookups into replicated tables, those replicas served, and rows sent as push bags
        # (bytes by kind: mlkv_torch.wire).
        self.stats: Dict[str, int] = dict.fromkeys(("lookups", "replica_hits", "push_rows"), 0)
        plan = sharded.module_sharding_plan  # table -> ParameterSharding
        world = dist.get_world_size()
        by_dim: Dict[int, List[ReplicatedTable]] = {}  # the tables replicated here
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
            table = ReplicatedTable(config.name, config.num_embeddings, dim, list(config.feature_names),
                                     config.pooling == PoolingType.MEAN, remote_columns, index, world / counting)
            by_dim.setdefault(dim, []).append(table)
        for dim, names in sharded_by_dim.items():
            if int(settings.fraction * rows_by_dim[dim]) == 0 and settings.fraction > 0:
                raise ValueError(f"a fraction of {settings.fraction} of the {rows_by_dim[dim]:,} rows of the sharded "
                                 f"tables {names} is no row: raise it")
        sharded_tables = sum(len(names) for names in sharded_by_dim.values())
        self.groups = [ReplicaGroup(tables, int(settings.fraction * rows_by_dim[dim]), sharded_tables)
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
                "groups": [{key: getattr(g, key).clone() for key in ReplicaGroup.STATE} for g in self.groups],
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
            for key in ReplicaGroup.STATE:
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
                self._count(group, keys_of(members_of(group, features.keys()), values))
            self.step += 1
            return None
        if self.trace is not None:
            self.trace.append({})
        push_all = self._choice_due(self.step + 1) or self._push_all_in_step == self.step
        kjt, self._steps = self._split(features, push_all=push_all, train=True)
        self._batch_size = features.stride()
        return (kjt,) + tuple(args[1:])

    def _lookahead_misses(self, features: KeyedJaggedTensor) -> None:
        """The sharded collection's lookahead, for the bags that will miss the replicas. No token:
        the step's bags may differ from these (push bags, hot rows chosen meanwhile), so its lookup
        finds its rows among the read-aheads by its ids."""
        if not self._chosen:
            self._lookahead(features)  # type: ignore[misc]
            return
        self._lookahead(self._split(features, push_all=False, train=False)[0])  # type: ignore[misc]

    def _split(self, features: KeyedJaggedTensor, push_all: bool, train: bool
               ) -> Tuple[KeyedJaggedTensor, List[Optional[GroupStep]]]:
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
        steps: List[Optional[GroupStep]] = []
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
                step = GroupStep([keys[p] for p in at], split.hit_bags, split.hit_offsets, hit_slots,
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

    def _group_split(self, group: ReplicaGroup, features: KeyedJaggedTensor, lengths: torch.Tensor,
                     values: List[torch.Tensor], keep: bool) -> Optional["GroupSplit"]:
        """The batch's hits and misses in the group (None: no feature of it in the batch); a
        lookahead's (`keep`) is kept for its step, which takes it if the hot rows are the same."""
        key = (id(group), features.values().data_ptr(), features.values().numel())
        cached = self._splits.pop(key, None)
        # The lookahead's values are kept alive with it, so the same address is the same batch.
        if cached is not None and cached[0] is features.values() and cached[1] == group.version:
            return cached[2]
        split = GroupSplit.of(group, features.keys(), features.stride(), lengths, values)
        if keep and split is not None:
            self._splits[key] = (features.values(), group.version, split)
            while len(self._splits) > KEPT_SPLITS * len(self.groups):
                self._splits.pop(next(iter(self._splits)))
        return split

    def _count(self, group: ReplicaGroup, group_keys: torch.Tensor) -> None:
        """Keeps a training step's lookups of the group's tables, for the next choice."""
        group.uncounted.append(group_keys[group_keys >= 0])  # a bad id (key -1) is no row
        # A step's merge counts its groups' at COUNT_EVERY, while the all-to-alls run; here the
        # others' (warm-up, a group without hot rows).
        if len(group.uncounted) > COUNT_EVERY:
            group.count()
        self.stats["lookups"] += group_keys.numel()

    def _decide(self, group: ReplicaGroup, hit_slots: torch.Tensor, push_all: bool, present: torch.Tensor
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
            if len(group.uncounted) >= COUNT_EVERY:
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
                    from_push = PushedHits.apply(fresh, pushed, step.owed)
                    pooled = from_push if pooled is None else pooled + from_push
                sources.append(pooled.view(-1, layout.unit))
            if owed_alone:
                sources.append(Owed.apply(fresh, step.owed).view(-1, layout.unit))
        merged = torch.cat(sources).index_select(0, flat).view(batch, -1)
        return KeyedTensor(keys=layout.keys, length_per_key=layout.dims, values=merged)

    def _pool_hits(self, group: ReplicaGroup, step: GroupStep
                   ) -> Tuple[Optional[torch.Tensor], Optional[HitIds]]:
        """A step's hits, those of its ids served from the replica pooled now; the ids of rows the
        step pushes, to pool from the push bags' refreshed rows (None: none)."""
        position = torch.full((group.size,), -1, dtype=torch.int64)  # of each slot among the push bags
        position[step.push] = torch.arange(step.push.numel())
        pushed_as = position[step.hit_slots]
        bag_of_id = torch.repeat_interleave(step.hit_offsets.diff())
        pushed = HitIds.of(step, bag_of_id, pushed_as >= 0, pushed_as)
        served = HitIds.of(step, bag_of_id, pushed_as < 0, step.hit_slots, even_none=pushed is None)
        return (ServedHits.apply(self._anchor, group, served) if served is not None else None), pushed


def replicate_hot_rows(sharded: nn.Module, settings: ReplicaSettings) -> HotRowReplicas:
    """Replicates hot rows of a ShardedEmbeddingBagCollection's sharded tables on this rank (every
    rank calls it, after DistributedModelParallel is built); returns the handle."""
    return HotRowReplicas(sharded, settings)
