"""HET across ranks: replicas of the globally hottest rows of sharded tables on every rank, read and
written within per-row bounds, so that most lookups skip TorchRec's all-to-alls.

`replicate_hot_rows(sharded_collection, ReplicaSettings(...))` hooks a ShardedEmbeddingBagCollection
(TorchRec's or the disk sharder's) under DistributedModelParallel. Each training step:

- **Split.** A bag of a replicated table whose ids are all hot is a *hit*: it is pooled on the rank
  from the replica. The other bags (*misses*) go through TorchRec's input and output distribution
  as a variable-batch KeyedJaggedTensor (VBE), so the output all-to-all carries only them.
- **Push and refresh in one.** Each row the step must send to its owner travels as one extra
  single-id bag of the same distribution (a *push bag*): its forward output is the owner's current
  row (the refresh), its gradient is what the rank accumulated for the row plus this step's (the
  push). The owner's fused optimizer sums it with the step's other gradients of the row, as
  without replicas. A row goes when a hit reads it more than `pull_bound` steps after its value
  was read (the owner updates a row at most once a step, so it then misses at most `pull_bound`
  of the owner's updates), when its oldest unpushed gradient is `push_bound` steps old, and every
  row with an unpushed gradient before the hot rows are chosen again or a checkpoint is cut.
  At bounds 0 every row a step reads goes in that step: training is exact.
- **Choice.** The lookups of each replicated table are counted; after `warmup_steps` steps and
  then every `refresh_every` steps, every rank offers its most frequent rows and all take the same
  `fraction` of each table's rows with the most lookups over the ranks.

Tables that are data-parallel in the plan are left alone (every rank holds them whole), as are
evaluations (no gradient): they read the owners' rows.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from .. import wire
from ..checks import is_int
from ..ranks import all_gather_objects

__all__ = ["ReplicaSettings", "HotRowReplicas", "replicate_hot_rows", "replica_memory_bytes"]

_NEVER = -(1 << 62)  # the step a never-read replica row's value is from
_CANDIDATES = 4  # each rank offers this many times a table's share of its most frequent rows


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """How hot rows are replicated (the runner's ``storage.replicas``).

    Args:
        fraction: share of each sharded table's rows replicated on every rank, in [0, 1); 0: none.
        pull_bound: a replica serves a row at most this many of the owner's updates stale.
        push_bound: a rank's gradient of a replicated row reaches its owner at most this many steps late.
        refresh_every: steps between choices of the hot rows (after the first).
        warmup_steps: steps whose lookups are counted before the first choice.
    """

    fraction: float = 0.0
    pull_bound: int = 0
    push_bound: int = 0
    refresh_every: int = 100
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


class _InjectGradient(torch.autograd.Function):
    """Identity forward; backward adds the rank's unpushed gradient of the push bags' rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pending)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (pending,) = ctx.saved_tensors
        return grad + pending, None


class _TableReplica:
    """One replicated table on this rank: the hot rows, their values, and what is owed to the owner."""

    def __init__(self, name: str, rows: int, dim: int, features: List[int], mean: bool,
                 remote_columns: int, fraction: float) -> None:
        self.name, self.rows, self.dim, self.features, self.mean = name, rows, dim, features, mean
        self.remote_columns = remote_columns  # of each row, the columns other ranks own
        self.hot_count = int(fraction * rows)
        self.hot_ids = torch.empty(0, dtype=torch.int64)
        self.values = torch.empty(0, dim)
        self.pending = torch.empty(0, dim)  # unpushed gradients
        self.has_pending = torch.empty(0, dtype=torch.bool)
        self.pending_since = torch.empty(0, dtype=torch.int64)  # the step of the oldest unpushed gradient
        self.read_at = torch.empty(0, dtype=torch.int64)  # the step whose forward read the value
        self.counted: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (ids, lookups) since the last choice

    def slots_of(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each id's slot among the hot rows, and whether it is hot."""
        if self.hot_ids.numel() == 0:
            return torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
        slots = torch.searchsorted(self.hot_ids, ids).clamp_(max=self.hot_ids.numel() - 1)
        return slots, self.hot_ids[slots] == ids

    def count(self, ids: torch.Tensor) -> None:
        if ids.numel():
            self.counted.append(torch.unique(ids, return_counts=True))

    def candidates(self) -> Tuple[List[int], List[int]]:
        """This rank's most looked-up rows since the last choice, and their lookups."""
        if not self.counted:
            return [], []
        ids = torch.cat([i for i, _ in self.counted])
        counts = torch.cat([c for _, c in self.counted])
        unique, inverse = torch.unique(ids, return_inverse=True)
        totals = torch.zeros(unique.numel(), dtype=torch.int64).index_add_(0, inverse, counts)
        top = _most_frequent(unique, totals, _CANDIDATES * self.hot_count)
        return unique[top].tolist(), totals[top].tolist()

    def choose(self, offered: List[Tuple[List[int], List[int]]]) -> None:
        """Takes the hot rows from every rank's candidates (the same on every rank); rows that stay
        hot keep their value and the step it was read at."""
        ids = torch.tensor([i for o in offered for i in o[0]], dtype=torch.int64)
        counts = torch.tensor([c for o in offered for c in o[1]], dtype=torch.int64)
        unique, inverse = torch.unique(ids, return_inverse=True)
        totals = torch.zeros(unique.numel(), dtype=torch.int64).index_add_(0, inverse, counts)
        hot = unique[_most_frequent(unique, totals, self.hot_count)].sort().values
        values, read_at = torch.zeros(hot.numel(), self.dim), torch.full((hot.numel(),), _NEVER, dtype=torch.int64)
        slots, kept = self.slots_of(hot)
        values[kept], read_at[kept] = self.values[slots[kept]], self.read_at[slots[kept]]
        self.hot_ids, self.values, self.read_at = hot, values, read_at
        self.pending = torch.zeros(hot.numel(), self.dim)
        self.has_pending = torch.zeros(hot.numel(), dtype=torch.bool)
        self.pending_since = torch.zeros(hot.numel(), dtype=torch.int64)
        self.counted = []


def _most_frequent(ids: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k most counted ids, ties to the smaller id (ids sorted ascending)."""
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep the ids' order
    return order[: min(k, order.numel())]


@dataclasses.dataclass
class _StepPlan:
    """What one training step's split left for its merge."""

    batch_size: int
    # per replicated table: hit bags (positions), their pooling inputs, and the push bags' slots
    tables: List[Dict[str, Any]]


class HotRowReplicas:
    """Replicas of hot rows on one rank, hooked into a sharded collection (`replicate_hot_rows`)."""

    def __init__(self, sharded: nn.Module, settings: ReplicaSettings) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            raise ValueError("replicas need several ranks: with one, every row is local (set fraction to 0)")
        self.settings = settings
        self.rank = dist.get_rank()
        self.step = 0  # training steps the collection has run
        self._push_all_in_step: Optional[int] = None
        self._plan: Optional[_StepPlan] = None
        self.last_step: Dict[str, int] = {}  # the last training step's rows served by replicas and pushed
        # A list to record in, step by step from the first choice, the ids each table served and pushed.
        self.trace: Optional[List[Dict[str, Dict[str, List[int]]]]] = None
        self.stats: Dict[str, int] = dict.fromkeys(
            ("lookups", "replica_hits", "push_rows", "replica_pushes", "replica_refreshes", "replica_choice"), 0)
        self.tables: List[_TableReplica] = []
        feature_position = {}
        plan = sharded.module_sharding_plan  # table -> ParameterSharding
        for config in sharded._embedding_bag_configs:
            for name in config.feature_names:
                feature_position.setdefault(name, len(feature_position))
        self._features = list(feature_position)
        for config in sharded._embedding_bag_configs:
            sharding = plan[config.name]
            if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            replica = _TableReplica(config.name, config.num_embeddings, config.embedding_dim,
                                    [feature_position[f] for f in config.feature_names],
                                    config.pooling == PoolingType.MEAN, self._remote_columns(sharding),
                                    settings.fraction)
            if replica.hot_count == 0 and settings.fraction > 0:
                raise ValueError(f"table {config.name!r} has {config.num_embeddings} rows: a fraction of "
                                 f"{settings.fraction} replicates none of them (raise fraction)")
            self.tables.append(replica)
        self._dims = [0] * len(self._features)
        for config in sharded._embedding_bag_configs:
            for name in config.feature_names:
                self._dims[feature_position[name]] = config.embedding_dim
        _check_variable_batch_kernels(sharded)
        self._sharded = sharded
        self._handles: List[Any] = []
        self._permuted_for: Optional[List[str]] = None  # the keys the variable output's permutation is for
        _allow_variable_batch(sharded)
        self._handles += _data_parallel_outputs_by_feature(sharded, dict(zip(self._features, self._dims)))
        self._handles += _fixed_batches_for_cpu_kernels(sharded)
        self._lookahead = getattr(sharded, "lookahead", None)
        self._handles += [sharded.register_forward_pre_hook(self._before_forward),
                          sharded.register_forward_hook(self._after_forward)]
        if self._lookahead is not None:
            sharded.lookahead = self._lookahead_misses  # type: ignore[assignment]

    def _remote_columns(self, sharding: Any) -> int:
        shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
        return sum(int(s.shard_sizes[1]) for s in shards if s.placement.rank() != self.rank)

    # ---- the public handle ----------------------------------------------------------------------------
    def push_all_in_next_step(self) -> None:
        """The next training step pushes every unpushed gradient (before a checkpoint's cut)."""
        self._push_all_in_step = self.step

    def hit_rate(self) -> Optional[float]:
        """The share of this rank's lookups into replicated tables that replicas served."""
        return self.stats["replica_hits"] / self.stats["lookups"] if self.stats["lookups"] else None

    def remove(self) -> None:
        """Unhooks the replicas; the collection trains as without them (push every gradient first)."""
        for handle in self._handles:
            handle.remove()
        if self._lookahead is not None:
            del self._sharded.lookahead

    def state_dict(self) -> Dict[str, Any]:
        """The replicas' rows and bookkeeping, for a checkpoint: resuming from it continues exactly."""
        return {"step": self.step, "tables": {t.name: {
            "hot_ids": t.hot_ids.clone(), "values": t.values.clone(), "read_at": t.read_at.clone(),
            "pending": t.pending.clone(), "has_pending": t.has_pending.clone(),
            "pending_since": t.pending_since.clone(),
            "counted": [(i.clone(), c.clone()) for i, c in t.counted]} for t in self.tables}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        for t in self.tables:
            saved = state["tables"][t.name]
            for key in ("hot_ids", "values", "read_at", "pending", "has_pending", "pending_since", "counted"):
                setattr(t, key, saved[key])

    # ---- the step ----------------------------------------------------------------------------------
    def _choice_due(self, step: int) -> bool:
        s = self.settings
        return step >= s.warmup_steps and (step - s.warmup_steps) % s.refresh_every == 0

    def _before_forward(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        features = args[0]
        if not (module.training and torch.is_grad_enabled()) or not isinstance(features, KeyedJaggedTensor):
            return None
        if self._choice_due(self.step):
            candidates = [t.candidates() for t in self.tables]
            offer_bytes = 16 * sum(len(ids) for ids, _ in candidates)  # an id and its count, int64 each
            self.stats["replica_choice"] += offer_bytes
            wire.count("replica_choice", offer_bytes)
            offered = all_gather_objects(candidates)
            for k, table in enumerate(self.tables):
                table.choose([o[k] for o in offered])
        if not any(t.hot_ids.numel() for t in self.tables):  # warming up: only counted
            for table in self.tables:
                for f in table.features:
                    ids = features[self._features[f]].values()
                    table.count(ids)
                    self.stats["lookups"] += ids.numel()
            self.last_step = {"step": self.step}
            self.step += 1
            return None
        push_all = self._choice_due(self.step + 1) or self._push_all_in_step == self.step
        kjt, plan = self._split(features, push_all=push_all, train=True)
        self._plan = plan
        return (kjt,) + tuple(args[1:])

    def _lookahead_misses(self, features: KeyedJaggedTensor) -> None:
        """The sharded collection's lookahead, for the bags that will miss the replicas."""
        if not any(t.hot_ids.numel() for t in self.tables):
            return self._lookahead(features)  # type: ignore[misc]
        self._lookahead(self._split(features, push_all=False, train=False)[0])  # type: ignore[misc]

    def _split(self, features: KeyedJaggedTensor, push_all: bool, train: bool
               ) -> Tuple[KeyedJaggedTensor, _StepPlan]:
        """The variable-batch input of the misses and push bags, and what the merge needs."""
        B = features.stride()
        step = self.step
        lengths_by_feature = features.lengths().view(len(features.keys()), B)
        values_by_feature = list(torch.split(features.values(), features.length_per_key()))
        weights = features.weights_or_none()
        weights_by_feature = list(torch.split(weights, features.length_per_key())) if weights is not None else None
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        new_lengths: List[torch.Tensor] = [lengths_by_feature[i] for i in range(len(keys))]
        new_values: List[torch.Tensor] = list(values_by_feature)
        new_weights = list(weights_by_feature) if weights_by_feature is not None else None
        kept_bags: List[Optional[torch.Tensor]] = [None] * len(keys)  # None: every bag
        extra = [0] * len(keys)  # push bags (and a placeholder) after the kept bags
        plan = _StepPlan(B, [])
        if train:
            self.last_step = {"step": step, "served_locally": 0, "pushed": 0}
            if self.trace is not None:
                self.trace.append({})
        for table in self.tables:
            info: Dict[str, Any] = {"table": table, "features": []}
            used_slots = []
            for f in table.features:
                i = position[self._features[f]]
                ids, lengths = values_by_feature[i], lengths_by_feature[i]
                if train:
                    table.count(ids)
                slots, hot = table.slots_of(ids)
                bag_of_id = torch.repeat_interleave(torch.arange(B), lengths)
                cold_per_bag = torch.zeros(B, dtype=torch.int64).index_add_(0, bag_of_id, (~hot).long())
                hit = cold_per_bag == 0
                if table.hot_ids.numel() == 0:
                    hit = torch.zeros(B, dtype=torch.bool)
                id_hit = hit[bag_of_id]
                miss_bags = (~hit).nonzero().squeeze(1)
                kept_bags[i] = miss_bags
                new_lengths[i] = lengths[miss_bags]
                new_values[i] = ids[~id_hit]
                if new_weights is not None:
                    new_weights[i] = weights_by_feature[i][~id_hit]  # type: ignore[index]
                info["features"].append({"key": keys[i], "hit_bags": hit.nonzero().squeeze(1),
                                         "hit_lengths": lengths[hit], "hit_slots": slots[id_hit],
                                         "hit_weights": weights_by_feature[i][id_hit] if weights_by_feature else None})
                used_slots.append(slots[id_hit])
                if train:
                    self.stats["lookups"] += ids.numel()
                    self.stats["replica_hits"] += int(id_hit.sum())
            if train and table.hot_ids.numel():
                used = torch.unique(torch.cat(used_slots))
                stale = used[(step - table.read_at[used]) > self.settings.pull_bound]
                since = table.pending_since.clone()
                fresh_use = used[~table.has_pending[used]]
                since[fresh_use] = step
                owing = table.has_pending.clone()
                owing[used] = True
                due = owing & (since + self.settings.push_bound <= step) if not push_all else owing
                push = torch.unique(torch.cat([stale, due.nonzero().squeeze(1)]))
                local = used[~torch.isin(used, push)]
                self.last_step["served_locally"] += local.numel()
                self.last_step["pushed"] += push.numel()
                if self.trace is not None:
                    self.trace[-1][table.name] = {"served": table.hot_ids[local].tolist(),
                                                  "pushed": table.hot_ids[push].tolist()}
                # Bookkeeping for the rows this step reads locally: its gradient will be owed.
                table.pending_since[fresh_use] = step
                table.has_pending[local] = True
                info.update(push=push, local=local, pending=table.pending[push].clone())
                table.pending[push] = 0
                table.has_pending[push] = False
                first = table.features[0]
                i = position[self._features[first]]
                new_values[i] = torch.cat([new_values[i], table.hot_ids[push]])
                new_lengths[i] = torch.cat([new_lengths[i], torch.ones(push.numel(), dtype=new_lengths[i].dtype)])
                if new_weights is not None:
                    new_weights[i] = torch.cat([new_weights[i], torch.ones(push.numel(), dtype=new_weights[i].dtype)])
                extra[i] = push.numel()
                self.stats["push_rows"] += push.numel()
                nbytes = push.numel() * table.remote_columns * 4  # float32 columns other ranks own
                self.stats["replica_pushes"] += nbytes
                self.stats["replica_refreshes"] += nbytes
                wire.reattribute("gradients", "replica_pushes", nbytes)
                wire.reattribute("outputs", "replica_refreshes", nbytes)
            plan.tables.append(info)
        # Every feature keeps at least one bag: the output distribution indexes into each.
        strides = []
        for i in range(len(keys)):
            n = new_lengths[i].numel()
            if n == 0:
                new_lengths[i] = torch.zeros(1, dtype=features.lengths().dtype)
                extra[i] = 0
                n = 1
            strides.append([n])
        wide = B + max(extra)  # the output's batch: the samples, then the push bags' rows
        inverse = torch.zeros(len(keys), wide, dtype=torch.int64)
        for i in range(len(keys)):
            kept = kept_bags[i]
            if kept is None:
                inverse[i, :B] = torch.arange(B)
            else:
                inverse[i, kept] = torch.arange(kept.numel())
                inverse[i, B:B + extra[i]] = kept.numel() + torch.arange(extra[i])
        if self._permuted_for != keys:  # TorchRec sets it up only if its first batch is a variable one
            self._sharded._create_inverse_indices_permute_indices((keys, inverse))
            self._permuted_for = list(keys)
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(new_values), lengths=torch.cat(new_lengths),
                                weights=torch.cat(new_weights) if new_weights is not None else None,
                                stride_per_key_per_rank=strides, inverse_indices=(keys, inverse))
        return kjt, plan

    def _after_forward(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        plan, self._plan = self._plan, None
        if plan is None:
            return None
        self.step += 1
        out = output.wait() if hasattr(output, "wait") and not isinstance(output, KeyedTensor) else output
        values = out.values()
        B = plan.batch_size
        # Split, not sliced: each slice's backward would build a gradient of the whole output.
        samples, push_rows = values.split([B, values.shape[0] - B])
        columns = list(samples.split(out.length_per_key(), dim=1))
        push_columns = push_rows.split(out.length_per_key(), dim=1)
        column_of = {key: i for i, key in enumerate(out.keys())}  # the output's order, not the input's
        for info in plan.tables:
            table: _TableReplica = info["table"]
            if "push" not in info:
                continue
            push, local = info["push"], info["local"]
            i0 = column_of[info["features"][0]["key"]]
            fresh = push_columns[i0][: push.numel()]
            table.values[push] = fresh.detach()
            table.read_at[push] = self.step - 1
            rows = [_InjectGradient.apply(fresh, info["pending"])]
            row_of = torch.empty(table.hot_ids.numel(), dtype=torch.int64)
            row_of[push] = torch.arange(push.numel())
            if local.numel():
                leaf = table.values[local].detach().requires_grad_()
                leaf.register_hook(_owe(table, local))
                rows.append(leaf)
                row_of[local] = push.numel() + torch.arange(local.numel())
            weight = torch.cat(rows) if len(rows) > 1 else rows[0]
            for feature in info["features"]:
                hit_bags = feature["hit_bags"]
                if hit_bags.numel() == 0:
                    continue
                offsets = torch.zeros(hit_bags.numel() + 1, dtype=torch.int64)
                torch.cumsum(feature["hit_lengths"], 0, out=offsets[1:])
                pooled = F.embedding_bag(row_of[feature["hit_slots"]], weight, offsets, mode="mean" if table.mean
                                         else "sum", per_sample_weights=feature["hit_weights"],
                                         include_last_offset=True)
                i = column_of[feature["key"]]
                columns[i] = columns[i].index_put((hit_bags,), pooled)
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(), values=torch.cat(columns, dim=1))


def _check_variable_batch_kernels(sharded: nn.Module) -> None:
    """Replicas send TorchRec a variable batch per feature, which fbgemm's in-memory kernels on a GPU
    take only with some optimizers: refuses the others by table, before training."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    supported = {EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM, EmbOptimType.NONE}
    for lookup, sharding_type in zip(getattr(sharded, "_lookups", []), getattr(sharded, "_sharding_types", [])):
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            continue
        for kernel in getattr(lookup, "_emb_modules", []):
            emb_module = getattr(kernel, "_emb_module", None)
            optimizer = getattr(emb_module, "optimizer", None)
            # On the CPU a variable batch reaches them as a fixed one (_fixed_batches_for_cpu_kernels).
            if optimizer is not None and optimizer not in supported and not getattr(emb_module, "use_cpu", False):
                tables = [t.name for t in kernel.config.embedding_tables]
                raise ValueError(f"replicas: tables {tables} are in memory with fbgemm's {optimizer.name}, which "
                                 f"takes no variable batch per feature (what replicas send); fbgemm takes SGD, "
                                 f"row-wise Adagrad and Adam, and disk tables every optimizer")


def _allow_variable_batch(sharded: nn.Module) -> None:
    """Builds the variable-batch output all-to-alls TorchRec builds only when a collection's first
    batch is a variable one (this one's first batches may not be)."""
    for output_dist in getattr(sharded, "_output_dists", []):
        if getattr(output_dist, "_variable_dist", False) is None and hasattr(output_dist, "_create_output_dist_module"):
            output_dist._create_output_dist_module(SimpleNamespace(variable_batch_per_feature=True))


def _data_parallel_outputs_by_feature(sharded: nn.Module, dims: Dict[str, int]) -> List[Any]:
    """Hooks the data-parallel lookups so that, given a variable batch, they return what the
    variable-batch output expects of every sharding: 1-D, feature after feature (TorchRec's dense
    kernel returns [batch, columns] whatever the batch)."""
    def by_feature(module: nn.Module, args: Tuple[Any, ...], output: torch.Tensor) -> Optional[torch.Tensor]:
        features = args[0]
        if not (isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key()) or output.dim() != 2:
            return None
        columns = output.split([dims[k] for k in features.keys()], dim=1)
        return torch.cat([c.reshape(-1) for c in columns]) if columns else output.reshape(-1)

    handles = []
    for lookup, sharding_type in zip(getattr(sharded, "_lookups", []), getattr(sharded, "_sharding_types", [])):
        if sharding_type != ShardingType.DATA_PARALLEL.value:
            continue
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        handles.append(lookup.register_forward_hook(by_feature))
    return handles


def _fixed_batches_for_cpu_kernels(sharded: nn.Module) -> List[Any]:
    """Hooks fbgemm's in-memory kernels on the CPU so that a variable batch reaches them as a fixed
    one (each feature's bags, then empty ones up to the most any feature has) and leaves them in
    the variable layout: fbgemm's CPU kernel runs a variable batch 8-10x slower (docs/benchmarks.md)."""
    from .routing import variable_batch_layout

    def to_fixed(module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        features = args[0]
        if not (isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key()):
            return None
        bags = features.stride_per_key()
        most = max(max(bags, default=0), 1)
        lengths = features.lengths()
        padded = torch.zeros(len(bags), most, dtype=lengths.dtype)
        padded[torch.arange(most).expand(len(bags), most) < torch.tensor(bags).unsqueeze(1)] = lengths
        module._mlkv_variable_batch = features.stride_per_key_per_rank()  # type: ignore[assignment]
        fixed = KeyedJaggedTensor(keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
                                  lengths=padded.reshape(-1), stride=most)
        return (fixed,) + tuple(args[1:])

    def to_variable(module: nn.Module, args: Tuple[Any, ...], output: torch.Tensor) -> Optional[torch.Tensor]:
        per_rank = getattr(module, "_mlkv_variable_batch", None)
        if per_rank is None:
            return None
        module._mlkv_variable_batch = None  # type: ignore[assignment]
        dims = module.config.embedding_dims()
        columns = output.split(dims, dim=1)
        return variable_batch_layout([c[: sum(counts)] for c, counts in zip(columns, per_rank)], per_rank)

    handles = []
    for lookup in getattr(sharded, "_lookups", []):
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        for kernel in getattr(lookup, "_emb_modules", []):
            emb_module = getattr(kernel, "_emb_module", None)
            if emb_module is not None and hasattr(emb_module, "optimizer") and getattr(emb_module, "use_cpu", False):
                handles += [kernel.register_forward_pre_hook(to_fixed), kernel.register_forward_hook(to_variable)]
    return handles


def _owe(table: _TableReplica, slots: torch.Tensor) -> Any:
    def add(grad: torch.Tensor) -> None:
        table.pending.index_add_(0, slots, grad)
    return add


def replicate_hot_rows(sharded: nn.Module, settings: ReplicaSettings) -> HotRowReplicas:
    """Replicates hot rows of a ShardedEmbeddingBagCollection's sharded tables on this rank (every
    rank calls it, after DistributedModelParallel is built); returns the handle."""
    return HotRowReplicas(sharded, settings)
