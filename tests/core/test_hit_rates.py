"""Hit rates predicted from a sample of ids (`mlkv_torch.planning.hit_rates`), against the exact
share of a known popularity and against a real disk table's cache."""
from __future__ import annotations

import pytest
import torch

from mlkv_torch import DiskEmbeddingBag, optim
from mlkv_torch.planning.hit_rates import TableAccess, access_from_batches, shared_cache_hit_rates


def zipf_shares(rows: int, exponent: float) -> torch.Tensor:
    """Each row's share of lookups, by rank, under Zipf(exponent)."""
    weight = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    return weight / weight.sum()


def draw(shares: torch.Tensor, lookups: int, generator: torch.Generator, scatter: torch.Tensor) -> torch.Tensor:
    """Ids drawn from `shares`, the ranks scattered over the id space by `scatter` (a permutation)."""
    return scatter[torch.multinomial(shares.float(), lookups, replacement=True, generator=generator)]


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.05, 1.3])
def test_a_sample_of_a_few_batches_predicts_the_share_the_most_popular_rows_serve(exponent):
    rows, lookups = 200_000, 16_384
    shares = zipf_shares(rows, exponent)
    generator = torch.Generator().manual_seed(1)
    scatter = torch.randperm(rows, generator=generator)
    batches = [{"t": draw(shares, lookups, generator, scatter)} for _ in range(8)]
    access = access_from_batches(batches, {"t": rows})["t"]
    assert access.lookups_per_batch == lookups
    for fraction in (0.01, 0.05, 0.2, 0.5):
        cache = int(rows * fraction)
        exact = float(shares[:cache].sum())
        assert access.hit_rate(cache) == pytest.approx(exact, abs=0.05), (fraction, access)
    assert access.hit_rate(0) == 0.0
    assert access.hit_rate(rows) == pytest.approx(1.0)


def test_rows_touched_counts_the_distinct_ids_a_run_looks_up():
    rows, lookups = 100_000, 8192
    shares = zipf_shares(rows, 1.05)
    generator = torch.Generator().manual_seed(2)
    scatter = torch.randperm(rows, generator=generator)
    access = access_from_batches([{"t": draw(shares, lookups, generator, scatter)} for _ in range(4)],
                                 {"t": rows})["t"]
    run = torch.cat([draw(shares, lookups, generator, scatter) for _ in range(40)])
    assert access.rows_touched(40) == pytest.approx(run.unique().numel(), rel=0.1)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_the_predicted_hit_rate_is_what_a_disk_tables_cache_serves_once_warm(tmp_path, policy):
    rows, lookups, cache = 50_000, 4096, 2_500
    shares = zipf_shares(rows, 1.05)
    generator = torch.Generator().manual_seed(3)
    scatter = torch.randperm(rows, generator=generator)
    sample = [{"t": draw(shares, lookups, generator, scatter)} for _ in range(8)]
    access = access_from_batches(sample, {"t": rows})["t"]
    table = DiskEmbeddingBag(rows, 8, path=tmp_path / "t", optimizer=optim.SGD(lr=0.01), cache_rows=cache,
                             memory_budget_bytes=8 << 20, seed=0, cache_policy=policy)
    offsets = torch.arange(0, lookups, 4)
    for step in range(120):
        if step == 60:  # warm: count from here
            warm = table.stats()
        table(draw(shares, lookups, generator, scatter), offsets).sum().backward()
    end = table.stats()
    hits, misses = (end[k] - warm[k] for k in ("cache_hits", "cache_misses"))
    table.close()
    # The cache counts a batch's distinct rows: a row looked up ten times in a batch is read once.
    # The frequency-admitting cache holds the most popular rows less its misjudged few (measured
    # 0.03 below the ideal here, 0.06 at a 1% cache).
    assert hits / (hits + misses) == pytest.approx(access.row_hit_rate(cache, policy), abs=0.05)
    assert misses / 60 == pytest.approx(access.misses_per_batch(cache, policy), rel=0.1)


def test_tables_sharing_a_cache_split_it_by_how_often_their_rows_are_looked_up():
    hot = TableAccess("hot", torch.tensor([1000.0] * 100), 100_000, 1_000)      # 100 rows take every lookup
    flat = TableAccess("flat", torch.full((5_000,), 10.0), 100_000, 5_000)       # 5000 rows, equally
    rates = shared_cache_hit_rates([hot, flat], 1_100)
    assert rates["hot"] == pytest.approx(1.0)  # its rows are looked up 50x more often per row: cached first
    assert rates["flat"] == pytest.approx(1_000 / 5_000)
    assert shared_cache_hit_rates([hot], 50)["hot"] == pytest.approx(hot.hit_rate(50))


def test_a_sample_without_a_tables_ids_or_with_ids_outside_it_is_refused():
    with pytest.raises(ValueError, match=r"table 'b': the sample holds no ids of it"):
        access_from_batches([{"a": torch.tensor([1, 2])}], {"a": 10, "b": 10})
    with pytest.raises(ValueError, match=r"table 'a': the sample's ids lie in \[1, 12\], outside its 10 rows"):
        access_from_batches([{"a": torch.tensor([1, 12])}], {"a": 10})
    with pytest.raises(ValueError, match="no batches"):
        access_from_batches([], {"a": 10})
