"""How a job's memory budget is spent across its tables: which tables stay in memory, and what share
of each disk table's bytes its cache holds (its ``CacheParams.load_factor`` in the plan).

The cost a table's memory saves is disk reads: a batch reads each distinct row its cache does not
hold, and a read costs the calibrated seconds of a missed lookup at the table's width
(`Calibration.table_cost`). The budget goes to the rows that save the most read seconds per byte,
across all tables at once (`TableAccess` ranks each table's rows by the chance a step reads them):
a threshold on seconds saved per byte, searched so the tables' memory fills the budget. A table
whose cache would hold all its rows stays in memory (TorchRec's fused kernel: no store, no misses)
when that takes no more bytes. A table given no rows still takes the least a disk table opens with.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

from ..memory_budget import (host_memory_for_cache, least_host_memory, shard_memory_budget,
                             split_host_memory)
from ..planning.calibration import Calibration
from ..planning.hit_rates import TableAccess

__all__ = ["TableShape", "TableMemory", "choose_table_memory", "BudgetTooSmallError"]


class BudgetTooSmallError(ValueError):
    """The budget does not hold the least every table needs (the message says how much more)."""


class TableShape(NamedTuple):
    """What the choice needs of a table: its rows, width and bytes a row (weights and optimizer
    state), and whether it may stay in memory / go to disk (the user's constraints)."""
    name: str
    rows: int
    dim: int
    row_bytes: int
    may_stay_in_memory: bool = True
    may_go_to_disk: bool = True


@dataclasses.dataclass(frozen=True)
class TableMemory:
    """One table's share of the budget and what it is predicted to bring."""
    name: str
    in_memory: bool
    memory_bytes: int
    cache_rows: int
    load_factor: Optional[float]        # the disk table's share of its bytes (None: in memory)
    row_hit_rate: float                 # of a step's distinct rows, the share its memory holds
    reads_per_step: float               # distinct rows a step reads from disk
    read_seconds_per_step: float        # those reads at the calibrated cost of a missed lookup


def _cache_rows_at(access: TableAccess, threshold: float, saving_per_row: float, row_bytes: int) -> int:
    """Rows of `access`'s table worth caching at `threshold` seconds saved per byte: those a step
    reads with a chance of at least threshold * row_bytes / saving_per_row."""
    rows, chance = access.read_chances()
    needed = threshold * row_bytes / saving_per_row if saving_per_row > 0 else math.inf
    return int(rows[chance >= needed].sum())


def _memory(table: TableShape, cache_rows: int) -> "tuple[int, bool]":
    """(bytes, in memory) of `table` with `cache_rows` of its rows cached: in memory where allowed
    and a disk table would take as many bytes (or cache every row); a disk table at most its bytes."""
    in_memory_bytes = table.rows * table.row_bytes
    if not table.may_go_to_disk:
        return in_memory_bytes, True
    disk_bytes = least_host_memory(1, table.rows, table.row_bytes) if cache_rows <= 0 else \
        host_memory_for_cache(1, table.rows, table.row_bytes, cache_rows)
    if table.may_stay_in_memory and (cache_rows >= table.rows or disk_bytes >= in_memory_bytes):
        return in_memory_bytes, True
    return min(disk_bytes, in_memory_bytes), False


def choose_table_memory(tables: Sequence[TableShape], access: Mapping[str, TableAccess], calibration: Calibration,
                        memory_budget_bytes: int) -> Dict[str, TableMemory]:
    """Each table's memory under a job-wide `memory_budget_bytes` (see the module's docstring);
    `access` is each table's popularity per training step (all ranks' batches together).
    BudgetTooSmallError names the least budget that opens the tables."""
    missing = [t.name for t in tables if t.name not in access]
    if missing:
        raise ValueError(f"the sample predicts nothing of tables {missing}: give batches that look them up")
    saving = {t.name: calibration.table_cost("miss_s", t.dim) for t in tables}
    least = sum(_memory(t, 0)[0] for t in tables)
    if least > memory_budget_bytes:
        raise BudgetTooSmallError(f"memory_budget_bytes={memory_budget_bytes:,} is {least - memory_budget_bytes:,} "
                                  f"bytes short of the least the {len(tables)} tables need ({least:,}: each disk "
                                  f"table's store log, staging area and write-back buffer, each table kept in memory "
                                  f"whole)")

    # A disk table's cache holds at most what a budget of its bytes caches (its load factor at most 1).
    most = [t.rows if t.may_stay_in_memory else
            split_host_memory(t.rows * t.row_bytes, 1, t.rows, t.row_bytes, True).cache_rows for t in tables]

    def spend(threshold: float) -> "tuple[int, List[int]]":
        rows = [min(top, _cache_rows_at(access[t.name], threshold, saving[t.name], t.row_bytes))
                if t.may_go_to_disk else t.rows for t, top in zip(tables, most)]
        return sum(_memory(t, r)[0] for t, r in zip(tables, rows)), rows

    low, high = 1e-18, 1.0  # seconds saved per byte: from (almost) every row worth it to none
    if spend(low)[0] <= memory_budget_bytes:
        high = low
    for _ in range(64):
        if high / low < 1.0001:
            break
        middle = math.sqrt(low * high)
        low, high = (low, middle) if spend(middle)[0] <= memory_budget_bytes else (middle, high)
    rows = _fill_margin(tables, spend(high)[1], spend(low)[1], memory_budget_bytes)
    return {t.name: _table_memory(t, r, access[t.name], saving[t.name]) for t, r in zip(tables, rows)}


def _fill_margin(tables: Sequence[TableShape], rows: List[int], more: List[int], budget: int) -> List[int]:
    """What is left of the budget at the threshold, to the rows just below it (`more` than `rows`):
    rows of equal worth (a flat table's, a tail bucket's) are cached in part rather than not at all."""
    rows = list(rows)
    for i, table in enumerate(tables):
        low, high = rows[i], more[i]
        while low < high:  # the most of table i's marginal rows that still fit
            middle = (low + high + 1) // 2
            trial = rows[:i] + [middle] + rows[i + 1:]
            fits = sum(_memory(t, r)[0] for t, r in zip(tables, trial)) <= budget
            low, high = (middle, high) if fits else (low, middle - 1)
        rows[i] = low
    return rows


def _table_memory(table: TableShape, cache_rows: int, access: TableAccess, miss_seconds: float) -> TableMemory:
    memory_bytes, in_memory = _memory(table, cache_rows)
    if in_memory:
        return TableMemory(table.name, True, memory_bytes, table.rows, None, 1.0, 0.0, 0.0)
    load_factor = min(1.0, max(memory_bytes / (table.rows * table.row_bytes), 1e-9))
    # The rows the kernel's budget caches (the budget rule's, which the search above inverted).
    memory_bytes = shard_memory_budget(table.rows, table.row_bytes, load_factor)
    cache_rows = split_host_memory(memory_bytes, 1, table.rows, table.row_bytes, True).cache_rows
    reads = access.misses_per_batch(cache_rows)
    return TableMemory(table.name, False, memory_bytes, cache_rows, load_factor, access.row_hit_rate(cache_rows),
                       reads, reads * miss_seconds)

