"""The memory-budget rule: how one host budget is shared by the row layouts of a set of tables
(`plan_host_memory`, by traffic, `split_budget`), how each layout's share is split between its hot
cache, staging area, write-back buffer and stores' in-memory logs (`split_host_memory`), the least
budgets that hold a given cache (searched from that rule), and what a rank's disk shard is given
(`shard_memory_budget`)."""
from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from . import _C
from .store import KVStore

__all__ = ["MemoryBudgetError", "HostMemorySplit", "LayoutDemand", "plan_host_memory", "split_budget",
           "split_host_memory", "cache_host_bytes", "buffer_host_bytes", "host_memory_for_all_rows",
           "host_memory_for_cache",
           "least_host_memory", "stores_min_bytes", "shard_memory_budget"]

_STORE_MIN_BYTES = 16 << 10  # four 4 KiB log pages, the store's minimum


class MemoryBudgetError(ValueError):
    """memory_budget_bytes cannot hold what the tables need beside their cache (the message says
    the least that can): a configuration error, which the experiment runner reports as one."""


class HostMemorySplit(NamedTuple):
    """How a table batch spends its host memory budget (`split_host_memory`)."""
    cache_rows: int       # rows of the hot cache (in device memory on a GPU)
    log_bytes: int        # each table's store log in memory
    staging_rows: int     # rows of the staging area: rows read ahead, rows kept out of the cache
    write_back_rows: int  # rows the write-back buffer holds before a fetch waits for the writer
    index_bytes: int = 0  # each table's index beyond its allowance (`index_budgets`): past it, rows go to its base run


class LayoutDemand(NamedTuple):
    """What the tables of one row layout (one table batch) ask of a budget."""
    num_tables: int
    total_rows: int
    row_bytes: int        # bytes of a row: weights and optimizer state (`row_layout.row_bytes`)
    store_min_bytes: int  # the least log memory its stores reopen with (`stores_min_bytes`)
    traffic: float        # lookups per sample across its tables


def plan_host_memory(memory_budget_bytes: int, layouts: Sequence[LayoutDemand], on_host: bool,
                     cache_rows: Optional[int] = None, staging_bytes: Optional[int] = None
                     ) -> List[Tuple[int, HostMemorySplit]]:
    """The one rule from a budget to what each table batch spends: a lone layout takes the whole
    budget; several share it by `split_budget` (each its least, then the rest by traffic, none
    more than caching all its rows needs). `cache_rows` and `staging_bytes`, when given for all
    the layouts, are shared in proportion to the bytes. Each share is then split within its
    batch by `split_host_memory`. Returns each layout's (share, split); MemoryBudgetError names
    the least budget that opens them."""
    if len(layouts) == 1:
        shares = [memory_budget_bytes]
    else:
        least = [least_host_memory(d.num_tables, d.total_rows, d.row_bytes, d.store_min_bytes) for d in layouts]
        needs = [host_memory_for_all_rows(d.num_tables, d.total_rows, d.row_bytes, d.store_min_bytes)
                 for d in layouts]
        shares = split_budget(memory_budget_bytes, needs, [d.traffic for d in layouts], least)
    return [(share, split_host_memory(share, d.num_tables, d.total_rows, d.row_bytes, on_host,
                                      None if cache_rows is None else cache_rows * share // memory_budget_bytes,
                                      None if staging_bytes is None else staging_bytes * share // memory_budget_bytes,
                                      d.store_min_bytes))
            for d, share in zip(layouts, shares)]


def split_budget(budget: int, needs: List[int], traffic: List[float], least: Optional[List[int]] = None) -> List[int]:
    """Splits `budget` bytes among layouts: each first gets its `least` (what it cannot open
    without), the rest goes in proportion to their `traffic`, giving none more than it `needs`
    (water-filling: the budget a capped layout leaves is split among the rest).
    MemoryBudgetError when the budget does not hold every `least`."""
    least = least if least is not None else [0] * len(needs)
    if sum(least) > budget:
        raise MemoryBudgetError(f"memory_budget_bytes={budget} cannot hold the least each row layout of the tables "
                                f"needs ({least}: the stores' logs, the staging area and write-back buffer); use at "
                                f"least {sum(least)}")
    shares = list(least)
    room = [max(0, need - low) for need, low in zip(needs, least)]
    active, left = list(range(len(needs))), float(budget - sum(least))
    while active:
        weight = sum(traffic[i] for i in active)
        capped = [i for i in active if left * traffic[i] / weight >= room[i]]
        if not capped:
            for i in active:
                shares[i] += int(left * traffic[i] / weight)
            break
        for i in capped:
            shares[i] += room[i]
            left -= room[i]
        active = [i for i in active if i not in capped]
    return shares


def shard_memory_budget(rows: int, row_bytes: int, memory_fraction: float, id_bytes: int = 0) -> int:
    """Host memory a rank's disk shard holding `rows` rows of `row_bytes` is given: `memory_fraction`
    of its stored bytes, but at least what one table opens with (`least_host_memory`: its store's
    log pages, the smallest staging area and write-back buffer; a cache of no rows), plus what a
    virtual table keeps of its ids (`id_bytes`). The planner charges each shard this, and the
    rank's kernel opens with the sum of its shards' (`plan_host_memory` shares it), so a plan the
    planner accepts always opens. A small table's fraction buys a small cache, as a large one's."""
    return max(least_host_memory(1, rows, row_bytes), int(memory_fraction * rows * row_bytes)) + id_bytes


def split_host_memory(memory_budget_bytes: int, num_tables: int, total_rows: int, row_bytes: int, on_host: bool,
                      cache_rows: Optional[int] = None, staging_bytes: Optional[int] = None,
                      store_min_bytes: int = 0) -> HostMemorySplit:
    """The budget rule of a table batch: one budget bounds the cache, the staging area, the
    write-back buffer and the stores' in-memory logs together.

    The stores' indexes take their share first: an eighth of the budget, of which each table's
    index allowance (256 KiB: a fixed cost of each table, as its store's other constants) is beside
    the budget, so only what the indexes get beyond it is charged, and a small budget's cache loses
    nothing to them; the tables pool what they get (`index_budgets`). Past its size a store moves
    the log's rows into its base run, so its memory stays bounded whatever the rows it holds.

    The staging area holds what a look-ahead reads for the batches ahead (and rows the policy kept
    out until their update): an eighth of the budget (`staging_bytes`, when given, sets its bytes
    of rows instead). The write-back buffer only smooths the writer's work: a thirty-second. Each
    holds at most 32 MiB of rows and at least 64 rows; their bytes count their index and entry
    state (`buffer_host_bytes`). The stores' logs only buffer writes (the cache serves the hot
    rows), so they share an eighth, each at least the store's minimum (`store_min_bytes` when larger:
    a reopened store keeps the page size of its first budget). The cache (on the CPU)
    takes the rest, never more rows than the tables have: its rows and what it keeps beside them
    (`cache_host_bytes`). On a GPU the cache lives in device memory and the rest of the host
    budget goes to the logs. An explicit `cache_rows` (at most the tables' rows: more would hold
    nothing more) must leave the others their minimum."""
    if cache_rows is not None:
        cache_rows = min(cache_rows, total_rows)  # a cache larger than the tables would hold nothing more
    most_buffer_rows = max(_BUFFER_MIN_ROWS, _BUFFER_MAX_BYTES // row_bytes)
    if staging_bytes is not None:
        staging_rows = max(_BUFFER_MIN_ROWS, staging_bytes // row_bytes)
    else:
        staging_rows = _most_rows_within(memory_budget_bytes // _STAGING_SHARE, _BUFFER_MIN_ROWS, most_buffer_rows,
                                         lambda r: buffer_host_bytes(r, 0, row_bytes))
    write_back_rows = _most_rows_within(memory_budget_bytes // _WRITE_BACK_SHARE, _BUFFER_MIN_ROWS, most_buffer_rows,
                                        lambda r: buffer_host_bytes(0, r, row_bytes))
    # Not capped by the rows: the planner and the kernel count a table's rows differently (a
    # virtual table's), and both must come to the same split.
    index_bytes = max(0, memory_budget_bytes // (_INDEX_SHARE * num_tables) - INDEX_ALLOWANCE)
    buffers = buffer_host_bytes(staging_rows, write_back_rows, row_bytes) + num_tables * index_bytes
    store_floor = max(_STORE_MIN_BYTES, store_min_bytes)
    log_floor = max(store_floor, memory_budget_bytes // (8 * num_tables))
    if num_tables * store_floor + buffers > memory_budget_bytes:
        why = ("; a reopened store keeps the log pages of the budget it was created with"
               if store_min_bytes > _STORE_MIN_BYTES else "")
        raise MemoryBudgetError(f"memory_budget_bytes={memory_budget_bytes} cannot hold the stores' logs "
                                f"({num_tables} tables, each at least {store_floor} bytes{why}) beside their indexes, "
                                f"the staging area and write-back buffer ({buffers} bytes); use at least "
                                f"{num_tables * store_floor + buffers}")
    if not on_host:
        log_bytes = max(store_floor, (memory_budget_bytes - buffers) // num_tables)
        rows = min(total_rows, memory_budget_bytes // row_bytes) if cache_rows is None else cache_rows
        return HostMemorySplit(rows, log_bytes, staging_rows, write_back_rows, index_bytes)
    if cache_rows is None:
        cache_rows = _most_rows_within(memory_budget_bytes - num_tables * log_floor - buffers, 0, total_rows,
                                       lambda r: cache_host_bytes(r, row_bytes))
    left = memory_budget_bytes - cache_host_bytes(cache_rows, row_bytes) - buffers
    if left < num_tables * log_floor:
        raise MemoryBudgetError(f"cache_rows={cache_rows} takes {cache_host_bytes(cache_rows, row_bytes)} bytes "
                         "(rows and "
                         f"their index) and the stores' indexes, staging area and write-back buffer {buffers} of the "
                         f"{memory_budget_bytes}-byte memory_budget_bytes; each table's store needs at least "
                         f"{log_floor} of them for its log ({num_tables} tables)")
    return HostMemorySplit(cache_rows, max(log_floor, left // num_tables), staging_rows, write_back_rows, index_bytes)


def index_budgets(index_bytes: int, table_rows: Sequence[int]) -> List[int]:
    """Each table's store index budget (`KVStore(index_budget_bytes=)`). The tables' indexes share
    one pool: each table's allowance beside the budget (`INDEX_ALLOWANCE`, a fixed cost of a table)
    and its share beyond it (`index_bytes` each, `split_host_memory`'s). No table gets more than an
    index of all its rows takes (its store's `key_limit` bounds its keys), and the pool is split
    evenly among the rest: a small table never merges and leaves what it does not need to the
    large ones."""
    budgets = [0] * len(table_rows)
    left = len(table_rows) * (INDEX_ALLOWANCE + index_bytes)
    by_need = sorted(range(len(table_rows)), key=lambda i: table_rows[i])
    for done, i in enumerate(by_need):  # the smallest first: each takes its need, at most an even share
        budgets[i] = max(INDEX_BYTES_PER_KEY, min(max(1, table_rows[i]) * INDEX_BYTES_PER_KEY,
                                                  left // (len(table_rows) - done)))
        left -= budgets[i]
    return budgets


# Index bytes a key is charged (KVStore's: a 64-byte bucket's four keys).
INDEX_BYTES_PER_KEY = 16
# Each table's index allowance beside the budget: what an index of 63-bit keys holds at its least
# size (4096 buckets of 64 bytes); the tables pool their allowances (`index_budgets`).
INDEX_ALLOWANCE = 16384 * INDEX_BYTES_PER_KEY
_INDEX_SHARE = 8              # the stores' indexes: an eighth of the budget,
_STAGING_SHARE = 8            # the staging area: an eighth of the budget,
_WRITE_BACK_SHARE = 32        # the write-back buffer: a thirty-second,
_BUFFER_MAX_BYTES = 32 << 20  # each at most this many bytes of rows,
_BUFFER_MIN_ROWS = 64         # and at least this many rows


def _most_rows_within(limit_bytes: int, low: int, high: int, bytes_of: Callable[[int], int]) -> int:
    """The most rows in [low, high] whose `bytes_of` fits `limit_bytes` (`low` when none does):
    bytes grow with the rows, in steps where a sketch doubles, so it is searched, not divided."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if bytes_of(middle) <= limit_bytes else (low, middle - 1)
    return low


def cache_host_bytes(cache_rows: int, row_bytes: int) -> int:
    """Host memory of a CPU cache of `cache_rows` rows: the rows, and the key -> slot index, slot
    state and policy counters the cache keeps beside them (C++'s own count)."""
    return cache_rows * row_bytes + _C.cache_bytes_beside_rows(cache_rows)


def buffer_host_bytes(staging_rows: int, write_back_rows: int, row_bytes: int) -> int:
    """Host memory of a cache's staging area and write-back buffer holding these many rows (C++'s
    own count: rows, index, per-entry state)."""
    return _C.cache_buffer_bytes(staging_rows, write_back_rows, row_bytes // 4)


def host_memory_for_all_rows(num_tables: int, total_rows: int, row_bytes: int, store_min_bytes: int = 0) -> int:
    """The smallest budget with which `split_host_memory` caches every row (the same rule, searched)."""
    return _least_budget(num_tables, total_rows, row_bytes, store_min_bytes, cached_rows=total_rows)


def host_memory_for_cache(num_tables: int, total_rows: int, row_bytes: int, cache_rows: int,
                          store_min_bytes: int = 0) -> int:
    """The smallest budget with which `split_host_memory` gives these tables a cache of at least
    `cache_rows` rows (the same rule, searched)."""
    return _least_budget(num_tables, total_rows, row_bytes, store_min_bytes, cached_rows=min(cache_rows, total_rows))


def least_host_memory(num_tables: int, total_rows: int, row_bytes: int, store_min_bytes: int = 0) -> int:
    """The smallest budget `split_host_memory` accepts for these tables: the stores' least logs
    (`store_min_bytes` for reopened ones) and the smallest staging area and write-back buffer,
    with a cache of no rows (the same rule, searched)."""
    return _least_budget(num_tables, total_rows, row_bytes, store_min_bytes, cached_rows=0)


def stores_min_bytes(paths: Sequence[str], backend: str = "mlkv") -> int:
    """The least log memory any of the stores at `paths` opens with: a table reopened with a smaller
    budget than it was created with keeps its log's page size (`KVStore.minimum_memory_bytes`).
    0 where none is there yet, and for RocksDB."""
    return 0 if backend == "rocksdb" else max((KVStore.minimum_memory_bytes(p) for p in paths), default=0)


@functools.lru_cache(maxsize=1024)  # the planner asks for the same shards' least many times over
def _least_budget(num_tables: int, total_rows: int, row_bytes: int, store_min_bytes: int, cached_rows: int) -> int:
    """The smallest budget `split_host_memory` accepts with a cache of at least `cached_rows` rows.
    The rule's shares grow with the budget, so the answer lies between the stores' least logs plus
    those rows and twice that plus the largest buffers."""
    def enough(budget: int) -> bool:
        try:
            return split_host_memory(budget, num_tables, total_rows, row_bytes, True,
                                     store_min_bytes=store_min_bytes).cache_rows >= cached_rows
        except MemoryBudgetError:
            return False
    low = cache_host_bytes(cached_rows, row_bytes) + num_tables * max(_STORE_MIN_BYTES, store_min_bytes)
    largest = _BUFFER_MAX_BYTES // row_bytes + 1
    high = 2 * low + buffer_host_bytes(largest, largest, row_bytes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle + 1, high)
    return low
