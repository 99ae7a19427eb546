"""Hit rates from the data: each table's id frequencies in a sample of the training input, and the
share of its lookups a cache of any size serves.

The model is frequency-based, not reuse-distance: the disk tables' default cache admits a missed row
only when it is seen more often than the coldest of a few residents (TinyLFU's test over a count-min
sketch, `csrc/cache/admission_policy.h`), so on input whose popularity holds still it converges on
the most frequent rows, and a cache of C rows serves the C most frequent rows' share of lookups. A
reuse-distance histogram would model LRU instead (the "lru" policy), which keeps recent rows
whatever their frequency.

A sample sees the head of a table's popularity (the rows seen often enough that their counts are
a measure, `_RELIABLE_COUNT` or more) but not its tail: the rows seen once or never. The tail's
share of lookups is what the head leaves; it is spread over the table's other rows by a power law
fitted to the head's rank-frequency curve (Zipf's law, which recommendation ids follow closely;
uniform ids give a flat head and an exponent near zero), so a cache larger than the rows the sample
saw is still priced. The same model counts the rows a run will touch at least once (`rows_touched`):
rows never written cost no disk read when first looked up (they start from their initial values).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Sequence

import torch

__all__ = ["TableAccess", "shared_cache_hit_rates", "access_from_batches"]

_RELIABLE_COUNT = 8     # a row seen this often has a frequency the sample measures
_TAIL_BUCKETS = 512      # log-spaced groups of the tail's ranks


class TableAccess:
    """A table's popularity: each row's share of its lookups (rows by rank, the most popular first),
    exact for the head the sample measured and a power law over the rest of `num_rows`.

    Args:
        name: the table.
        counts: lookups of each distinct id in the sample (any order).
        lookups_per_batch: the table's lookups per training batch (its traffic).
        num_rows: the rows the table may hold (its rows, or the ids it will keep).
    """

    def __init__(self, name: str, counts: torch.Tensor, lookups_per_batch: float, num_rows: int) -> None:
        counts = counts[counts > 0].to(torch.float64).sort(descending=True).values
        if counts.numel() == 0:
            raise ValueError(f"table {name!r}: the sample holds no ids of it, so nothing predicts its hit rate; "
                             "give batches that look it up")
        if counts.numel() > num_rows:
            raise ValueError(f"table {name!r}: the sample holds {counts.numel()} distinct ids, more than its "
                             f"{num_rows} rows")
        self.name, self.num_rows, self.lookups_per_batch = name, int(num_rows), float(lookups_per_batch)
        self.sampled_lookups, self.sampled_rows = int(counts.sum()), int(counts.numel())
        head = counts[counts >= _RELIABLE_COUNT]
        self.exponent = _zipf_exponent(head)
        self._head = head / self.sampled_lookups
        self._tail_ranks, self._tail_share = _power_law_tail(head.numel(), self.num_rows, self.exponent,
                                                             1.0 - float(self._head.sum()))

    def _shares(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """(rows, share of lookups of each of those rows) per group, the most popular first: the
        head's rows one by one, and the tail's buckets."""
        rows = torch.cat([torch.ones_like(self._head), self._tail_ranks])
        share = torch.cat([self._head, self._tail_share])
        order = share.argsort(descending=True, stable=True)
        return rows[order], share[order]

    def read_chances(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """(rows, the chance a batch looks up each of those rows) per group, the most popular first:
        what caching a row saves, in reads a batch."""
        rows, share = self._shares()
        return rows, self._in_batch(share)

    def scaled(self, batches: float) -> "TableAccess":
        """The same popularity, for `batches` batches looked up together (a step of several ranks'
        batches on a table-wise shard)."""
        copy = object.__new__(TableAccess)
        copy.__dict__.update(self.__dict__, lookups_per_batch=self.lookups_per_batch * batches)
        return copy

    def hit_rate(self, cache_rows: int, policy: str = "lfu") -> float:
        """The share of lookups a cache of `cache_rows` rows serves under `policy`."""
        rows, share = self._shares()
        held = _held_rows(rows, self._in_batch(share), cache_rows, policy)
        return float((held * share).sum().clamp(max=1.0))

    def misses_per_batch(self, cache_rows: int, policy: str = "lfu") -> float:
        """The distinct rows of a batch a cache of `cache_rows` rows does not hold: the rows a
        batch reads from the store (each once, however often the batch looks it up)."""
        return self._distinct_per_batch(cache_rows, policy)[1]

    def row_hit_rate(self, cache_rows: int, policy: str = "lfu") -> float:
        """The share of a batch's distinct rows a cache of `cache_rows` rows holds (what the
        table's ``stats()`` count: ``cache_hits / (cache_hits + cache_misses)``)."""
        held, missed = self._distinct_per_batch(cache_rows, policy)
        return held / (held + missed) if held + missed else 0.0

    def _in_batch(self, share: torch.Tensor, batches: float = 1.0) -> torch.Tensor:
        """The chance that `batches` batches look a row of each share up at least once."""
        return -torch.expm1(batches * self.lookups_per_batch * torch.log1p(-share.clamp(max=1 - 1e-15)))

    def _distinct_per_batch(self, cache_rows: int, policy: str) -> "tuple[float, float]":
        rows, share = self._shares()
        present = self._in_batch(share)
        held = _held_rows(rows, present, cache_rows, policy)
        return float((held * present).sum()), float(((rows - held) * present).sum())

    def rows_touched(self, batches: float) -> float:
        """The expected rows at least one of `batches` batches looks up (each lookup drawn from the
        popularity): the misses of rows never written, which read nothing from disk."""
        rows, share = self._shares()
        return float((rows * self._in_batch(share, batches)).sum())

    def rows_per_lookup_rate(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """(rows, lookups per batch of each of those rows) by group: what a shared cache ranks by."""
        rows, share = self._shares()
        return rows, share * self.lookups_per_batch

    def __repr__(self) -> str:
        return (f"TableAccess({self.name!r}, rows={self.num_rows}, sampled_rows={self.sampled_rows}, "
                f"lookups_per_batch={self.lookups_per_batch:.0f}, exponent={self.exponent:.2f})")


def _zipf_exponent(head: torch.Tensor) -> float:
    """The slope of log(count) over log(rank) across the head (least squares): Zipf's exponent."""
    if head.numel() < 4:
        return 0.0
    ranks = torch.arange(1, head.numel() + 1, dtype=torch.float64).log()
    logs = head.log()
    slope = ((ranks - ranks.mean()) * (logs - logs.mean())).sum() / ((ranks - ranks.mean()) ** 2).sum()
    return max(0.0, -float(slope))


def _power_law_tail(first: int, num_rows: int, exponent: float, mass: float) -> "tuple[torch.Tensor, torch.Tensor]":
    """Ranks first+1 .. num_rows in log-spaced buckets: (rows of each bucket, each row's share),
    the shares falling as rank**-exponent and summing to `mass`."""
    left = num_rows - first
    if left <= 0 or mass <= 0:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    edges = torch.unique(torch.logspace(math.log10(first + 1), math.log10(num_rows + 1), _TAIL_BUCKETS + 1,
                                        dtype=torch.float64).floor())
    edges[0], edges[-1] = first + 1, num_rows + 1
    rows = edges[1:] - edges[:-1]
    middle = (edges[1:] * edges[:-1]).sqrt()
    weight = middle ** -exponent
    per_row = weight * mass / float((weight * rows).sum())
    return rows, per_row


def _held_rows(rows: torch.Tensor, in_batch: torch.Tensor, cache_rows: int, policy: str) -> torch.Tensor:
    """The rows of each group (sorted by popularity) a cache of `cache_rows` rows holds when a batch
    looks them up: "lfu", the most popular; "lru", the rows looked up within the last T batches,
    T such that they fill the cache (Che's characteristic-time approximation, by batch)."""
    if policy == "lfu":
        return torch.minimum(torch.clamp(cache_rows - (torch.cumsum(rows, 0) - rows), min=0.0), rows)
    if policy != "lru":
        raise ValueError(f"policy must be 'lfu' or 'lru', got {policy!r}")
    if cache_rows >= float(rows.sum()):
        return rows.clone()
    miss_log = torch.log1p(-in_batch.clamp(max=1 - 1e-15))

    def resident(batches: float) -> torch.Tensor:
        return rows * -torch.expm1(batches * miss_log)

    low, high = 0.0, 1.0
    while float(resident(high).sum()) < cache_rows and high < 1e15:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if float(resident(middle).sum()) < cache_rows else (low, middle)
    return resident(low)


def shared_cache_hit_rates(accesses: Sequence[TableAccess], cache_rows: int) -> Dict[str, float]:
    """Each table's hit rate when the tables share one cache of `cache_rows` rows, which holds the
    rows looked up most often per batch across them (as one frequency-admitting cache does)."""
    groups = [a.rows_per_lookup_rate() for a in accesses]
    rows = torch.cat([g[0] for g in groups])
    rate = torch.cat([g[1] for g in groups])
    owner = torch.cat([torch.full_like(g[0], i) for i, g in enumerate(groups)])
    order = rate.argsort(descending=True)
    rows, rate, owner = rows[order], rate[order], owner[order]
    held = _held_rows(rows, rate, cache_rows, "lfu")  # one frequency cache: the rows looked up most
    served = torch.zeros(len(accesses), dtype=torch.float64).index_add_(0, owner.long(), held * rate)
    return {a.name: min(1.0, float(served[i]) / a.lookups_per_batch) if a.lookups_per_batch else 0.0
            for i, a in enumerate(accesses)}


def access_from_batches(batches: Iterable[Mapping[str, torch.Tensor]], num_rows: Mapping[str, int]
                        ) -> Dict[str, TableAccess]:
    """Each table's `TableAccess` from a sample of batches, each a mapping of table name to the ids
    it looks up (a KeyedJaggedTensor's ``to_dict()`` values' ``values()``, or plain id tensors)."""
    counts: Dict[str, List[torch.Tensor]] = {name: [] for name in num_rows}
    batches_seen = 0
    for batch in batches:
        batches_seen += 1
        for name, ids in batch.items():
            if name in counts:
                counts[name].append(ids.reshape(-1).to("cpu", torch.int64))
    if not batches_seen:
        raise ValueError("the sample holds no batches")
    accesses = {}
    for name, parts in counts.items():
        ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows[name]):
            raise ValueError(f"table {name!r}: the sample's ids lie in [{int(ids.min())}, {int(ids.max())}], "
                             f"outside its {num_rows[name]} rows")
        _, id_counts = ids.unique(return_counts=True) if ids.numel() else (ids, ids)
        accesses[name] = TableAccess(name, id_counts, ids.numel() / batches_seen, num_rows[name])
    return accesses
