"""A rank's replicated tables of one width (`ReplicaGroup`): their hot rows in one slot space,
the counts that choose them, and how a batch's bags split into hits and misses (`GroupSplit`,
`GroupStep`)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from ... import _C
from ...cache_keys import cache_key, row_of, table_of

NEVER = -(1 << 62)  # the step a never-read replica row's value is from
CANDIDATES = 2  # each rank offers this many times the replicas' rows of its most frequent rows


class ReplicatedTable:
    """A sharded table replicated on this rank."""

    def __init__(self, name: str, rows: int, dim: int, features: List[str], mean: bool, remote_columns: int,
                 index: int, weight: float) -> None:
        self.name, self.rows, self.dim, self.features, self.mean = name, rows, dim, features, mean
        # Columns one bag's output gets from other ranks: those of the column shards they own (a
        # row-wise table: each other rank's partial sum, a whole row).
        self.remote_columns = remote_columns
        self.index = index  # among the collection's sharded tables, the same on every rank
        self.weight = weight  # ranks over the ranks that count its lookups (those that replicate it)


def summed(ids: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids (ascending) and the sum of their counts."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return unique, torch.zeros(unique.numel(), dtype=counts.dtype).index_add_(0, inverse, counts)


def most_frequent(counts: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest counts, ties to the earlier position (the smaller id)."""
    order = torch.sort(-counts, stable=True).indices
    return order[: min(k, order.numel())]


class ReplicaGroup:
    """The replicated tables of one embedding dimension on this rank, their hot rows in one slot
    space (ordered by table, then row), so a step's bookkeeping is a few tensor operations."""

    def __init__(self, tables: List[ReplicatedTable], hot_count: int, sharded_tables: int) -> None:
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
        values, read_at = torch.zeros(keys.numel(), self.dim), torch.full((keys.numel(),), NEVER, dtype=torch.int64)
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
        keys, totals = summed(torch.cat([k for k, _ in self.counted]), torch.cat([c for _, c in self.counted]))
        scaled = totals * self.weights[table_of(keys)]
        top = most_frequent(scaled, CANDIDATES * self.hot_count)
        self.counted = [(keys[top], totals[top])]
        keys = keys[top]
        return cache_key(self.global_index[table_of(keys)], row_of(keys)), scaled[top]

    def choose(self, offered: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Chooses the rows with the most lookups over every rank's candidates (the same on every
        rank), and takes those of the tables replicated here."""
        keys, totals = summed(torch.cat([k for k, _ in offered]), torch.cat([c for _, c in offered]))
        chosen = keys[most_frequent(totals, self.hot_count)]
        local = self.local_index[table_of(chosen)]
        mine = local >= 0
        self.set_hot(cache_key(local[mine], row_of(chosen[mine])).sort().values)

    STATE = ("keys", "values", "pending", "has_pending", "pending_since", "read_at")


@dataclasses.dataclass
class GroupSplit:
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
    def of(group: "ReplicaGroup", keys: List[str], batch: int, lengths: torch.Tensor,
           values: List[torch.Tensor]) -> Optional["GroupSplit"]:
        members = members_of(group, keys)
        if not members:
            return None
        at = [p for _, p in members]
        if group.size == 0:
            return GroupSplit(members, at, keys_of(members, values))
        (group_keys, value_hit, hit_bags, hit_offsets, hit_slots, kept_lengths, kept_ids, kept_bags, kept_values,
         inverse) = group.index.split([values[p].long() for p in at], [t for t, _ in members],
                                      lengths[at].reshape(-1).long(), batch)
        return GroupSplit(members, at, group_keys, hit_bags, hit_offsets, hit_slots, value_hit,
                           list(kept_lengths.to(lengths.dtype).split(kept_bags)),
                           [part.to(values[p].dtype) for p, part in zip(at, kept_ids.split(kept_values))],
                           kept_values, inverse)


@dataclasses.dataclass
class GroupStep:
    """What one group's split of a training step leaves for its merge."""

    keys: List[str]  # the group's features in the batch, in order
    hit_bags: torch.Tensor  # of the group's bags (feature after feature), those pooled here
    hit_offsets: torch.Tensor  # their bags' offsets into hit_slots
    hit_slots: torch.Tensor  # the slot of each of their ids
    hit_weights: Optional[torch.Tensor]  # per id: its weight, over the bag's length for mean pooling
    push: torch.Tensor  # slots sent as push bags, ascending (so by table)
    push_per_table: List[int]
    owed: torch.Tensor  # what the rank owed for the pushed rows before this step


def members_of(group: ReplicaGroup, keys: List[str]) -> List[Tuple[int, int]]:
    """The group's (table, feature position) in a batch of features `keys`."""
    position = {k: i for i, k in enumerate(keys)}
    return [(t, position[f]) for t, table in enumerate(group.tables) for f in table.features if f in position]


def keys_of(members: List[Tuple[int, int]], values: List[torch.Tensor]) -> torch.Tensor:
    """The members' ids' keys, member after member."""
    if not members:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([cache_key(t, values[p].long()) for t, p in members])
