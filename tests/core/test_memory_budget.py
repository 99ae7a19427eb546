"""The memory-budget rule (mlkv_torch.memory_budget): the budget shared between row layouts
(`split_budget`), the least budget a set of tables opens with (`least_host_memory`), and what a rank's
disk shard is given (`shard_memory_budget`), each against the rule its docstring states."""
import random

import pytest

from mlkv_torch.data import CRITEO_KAGGLE_CARDINALITIES
from mlkv_torch.memory_budget import (INDEX_ALLOWANCE, INDEX_BYTES_PER_KEY, MemoryBudgetError, buffer_host_bytes,
                                      cache_host_bytes, host_memory_for_all_rows, index_budgets, least_host_memory,
                                      shard_memory_budget, split_budget, split_host_memory)

ROW = 64  # bytes of a row: 8 float32 weights and 8 of optimizer state


def test_split_budget_follows_traffic_and_caps_at_need():
    assert split_budget(1000, [10_000, 10_000], [1, 3]) == [250, 750]
    # The small table takes only what it needs; the rest splits by traffic.
    assert split_budget(1000, [100, 10_000, 10_000], [4, 1, 1]) == [100, 450, 450]
    assert split_budget(1000, [100, 200], [1, 1]) == [100, 200]  # everything fits
    assert split_budget(1000, [10_000, 10_000], [1, 3], least=[200, 100]) == [375, 625]  # least first, then traffic
    assert split_budget(1000, [300, 10_000], [1, 1], least=[250, 100]) == [300, 700]


def test_split_budget_gives_each_its_least_then_the_rest_by_traffic_never_past_its_need():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 5)
        least = [rng.randint(0, 1000) for _ in range(n)]
        needs = [low + rng.randint(0, 5000) for low in least]
        traffic = [rng.uniform(0.1, 10) for _ in range(n)]
        budget = sum(least) + rng.randint(0, 12_000)
        shares = split_budget(budget, needs, traffic, least)
        assert sum(shares) <= budget
        assert all(low <= share <= need for low, share, need in zip(least, shares, needs))
        uncapped = [i for i in range(n) if shares[i] < needs[i]]
        if not uncapped:
            continue
        # Only an integer's rounding per layout is left over while a layout could take more,
        assert budget - sum(shares) < n
        # and the layouts below their need got the rest beyond their least in proportion to their traffic.
        per_traffic = [(shares[i] - least[i]) / traffic[i] for i in uncapped]
        assert max(per_traffic) - min(per_traffic) <= 1 / min(traffic[i] for i in uncapped) + 1e-9
        # A capped layout is one whose share by traffic would have passed its need.
        capped = [i for i in range(n) if shares[i] == needs[i] and needs[i] > least[i]]
        assert all((needs[i] - least[i]) / traffic[i] <= max(per_traffic) + 1 / min(traffic) + 1e-9 for i in capped)


def test_split_budget_below_the_least_of_every_layout_names_the_least_that_opens():
    with pytest.raises(MemoryBudgetError, match=r"memory_budget_bytes=299 .*\[200, 100\].* use at least 300$"):
        split_budget(299, [1000, 1000], [1, 1], least=[200, 100])
    assert split_budget(300, [1000, 1000], [1, 1], least=[200, 100]) == [200, 100]


@pytest.mark.parametrize("tables, rows, row_bytes, store_min_bytes", [
    (1, 10, 36, 0), (1, 1_000_000, ROW, 0), (3, 500_000, 68, 0), (26, 3_376_254, ROW, 0), (2, 10_000, ROW, 1 << 20)])
def test_least_host_memory_is_the_smallest_budget_the_rule_accepts(tables, rows, row_bytes, store_min_bytes):
    least = least_host_memory(tables, rows, row_bytes, store_min_bytes)
    split = split_host_memory(least, tables, rows, row_bytes, True, store_min_bytes=store_min_bytes)
    assert split.cache_rows == 0  # a cache of no rows: the stores' logs, the staging area and write-back buffer
    assert split.log_bytes >= max(16 << 10, store_min_bytes)
    with pytest.raises(MemoryBudgetError, match="use at least|cannot hold"):
        split_host_memory(least - 1, tables, rows, row_bytes, True, store_min_bytes=store_min_bytes)
    # A reopened store's larger log, and each table more, raise it; caching every row takes more.
    assert least_host_memory(tables, rows, row_bytes, (4 << 20)) > least
    assert least_host_memory(tables + 1, rows, row_bytes, store_min_bytes) > least
    assert host_memory_for_all_rows(tables, rows, row_bytes, store_min_bytes) > least


def test_shard_memory_budget_is_its_fraction_of_the_stored_bytes_at_least_what_one_table_opens_with():
    rows, fraction = 4_000_000, 0.05
    assert least_host_memory(1, rows, ROW) < fraction * rows * ROW
    assert shard_memory_budget(rows, ROW, fraction) == int(fraction * rows * ROW)
    # A small shard's fraction would not open it: it gets the least that does, and it opens.
    small = 1000
    assert fraction * small * ROW < least_host_memory(1, small, ROW)
    assert shard_memory_budget(small, ROW, fraction) == least_host_memory(1, small, ROW)
    split_host_memory(shard_memory_budget(small, ROW, fraction), 1, small, ROW, True)
    # What a virtual table keeps of its ids comes on top, whichever term won.
    assert shard_memory_budget(rows, ROW, fraction, id_bytes=12_345) == int(fraction * rows * ROW) + 12_345
    assert shard_memory_budget(small, ROW, fraction, id_bytes=7) == least_host_memory(1, small, ROW) + 7
    # A larger fraction buys a larger cache, for a small table as for a large one.
    for shard_rows in (small, rows):
        caches = [split_host_memory(shard_memory_budget(shard_rows, ROW, f), 1, shard_rows, ROW, True).cache_rows
                  for f in (0.05, 0.5, 1.0)]
        assert caches == sorted(caches) and caches[0] < caches[-1]


def test_index_budgets_pool_the_allowances_small_tables_leave_to_large_ones():
    """Criteo Kaggle's 26 tables, tenfold smaller: the 21 of at most 28,618 rows get what an index
    of all their rows takes (16 bytes a row), the five larger split the rest evenly (with a share
    beyond the allowances, a 220,260-row table's whole index too), and the pool is every table's
    allowance and its share beyond it."""
    rows = [max(2, n // 10) for n in CRITEO_KAGGLE_CARDINALITIES]
    for each in (0, 4 * INDEX_ALLOWANCE):
        budgets = index_budgets(each, rows)
        pool = len(rows) * (INDEX_ALLOWANCE + each)
        assert pool - len(rows) <= sum(budgets) <= pool
        whole = [b == r * INDEX_BYTES_PER_KEY for r, b in zip(rows, budgets)]
        assert sum(whole) == 21 + (each > 0)
        assert len({b for b, w in zip(budgets, whole) if not w}) == 1  # the rest split evenly
        assert all(INDEX_ALLOWANCE < b < r * INDEX_BYTES_PER_KEY for r, b, w in zip(rows, budgets, whole) if not w)
    # Room for every table's whole index: each gets just that, the rest of the pool unused.
    assert index_budgets(0, [10, 100, 0]) == [160, 1600, INDEX_BYTES_PER_KEY]
    # Tables of equal rows share the pool evenly.
    assert index_budgets(0, [10 ** 6] * 3) == [INDEX_ALLOWANCE] * 3


@pytest.mark.parametrize("budget", [12 << 20, 1 << 30])
def test_the_budget_holds_its_parts_charging_indexes_only_beyond_their_allowance(budget):
    tables, rows = 26, 3_000_000
    split = split_host_memory(budget, tables, rows, ROW, True)
    # An eighth of the budget for the indexes, each table's allowance (a fixed cost) beside it.
    assert split.index_bytes == max(0, budget // (8 * tables) - INDEX_ALLOWANCE)
    assert (split.index_bytes == 0) == (budget == 12 << 20)
    parts = (cache_host_bytes(split.cache_rows, ROW) + buffer_host_bytes(split.staging_rows, split.write_back_rows, ROW)
             + tables * (split.index_bytes + split.log_bytes))
    assert budget - tables <= parts <= budget  # the logs take what is left, divided among the tables
