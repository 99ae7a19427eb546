"""DiskTableBatch, the table-batched kernel, against one torch.nn.EmbeddingBag per table: several
tables in one cache far smaller than their rows, with asynchronous updates (staleness > 0), a
small staging area and write-back buffer, and look-ahead, loses no update."""
import pytest
import torch

from conftest import rounding_tolerance
from mlkv_torch import optim
from mlkv_torch.disk_table import DiskTable
from mlkv_torch.opening import open_table_batch
from mlkv_torch.row_layout import row_words, weight_words

ROWS = [700, 40, 300]
DIM = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def feature_batch(step: int):
    g = torch.Generator().manual_seed(step)
    counts = [int(c) for c in torch.randint(20, 120, (len(ROWS),), generator=g)]
    values = torch.cat([torch.randint(0, n, (c,), generator=g) for n, c in zip(ROWS, counts)])
    bag_lengths = torch.cat([torch.full((c // 4,), 4) if c % 4 == 0 else
                             torch.cat([torch.full((c // 4,), 4), torch.tensor([c % 4])]) for c in counts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), bag_lengths.cumsum(0)])
    target = torch.randn(bag_lengths.numel(), DIM, generator=g)
    return values, counts, offsets, target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staleness", [0, 3])
def test_tables_in_one_small_cache_lose_no_update(tmp_path, staleness, device):
    # With SGD and a loss linear in the pooled rows the gradient does not depend on the weights
    # read, so every schedule of asynchronous updates must end at the reference weights.
    batch = open_table_batch([DiskTable(f"t{i}", n, str(tmp_path / f"t{i}"), seed=i) for i, n in enumerate(ROWS)], DIM,
                             optimizer=optim.SGD(lr=0.2), cache_rows=48, memory_budget_bytes=1 << 20,
                             staleness=staleness, staging_bytes=0,  # the smallest staging and write-back buffer
                             device=device)
    references = [torch.nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in ROWS]
    for t, ref in enumerate(references):
        ref.weight.data.copy_(batch.weights_of(batch.read_rows(t, torch.arange(ROWS[t]))))
    opts = [torch.optim.SGD(ref.parameters(), lr=0.2) for ref in references]
    for step in range(40):
        values, counts, offsets, target = feature_batch(step)
        batch.lookahead(*feature_batch(step + 1)[:2], list(range(len(ROWS))))
        out = batch.pool(values, counts, list(range(len(ROWS))), offsets)
        assert out.device.type == device
        (out * target.to(device)).sum().backward()
        # the reference: each feature's bags through its own table
        first_bag, first_value = 0, 0
        for t, (ref, opt) in enumerate(zip(references, opts)):
            bags = (counts[t] + 3) // 4
            ids = values[first_value:first_value + counts[t]]
            ref_offsets = offsets[first_bag:first_bag + bags] - offsets[first_bag]
            opt.zero_grad()
            (ref(ids, ref_offsets) * target[first_bag:first_bag + bags]).sum().backward()
            opt.step()
            first_bag, first_value = first_bag + bags, first_value + counts[t]
        assert batch.cache.stats()["max_staleness"] <= staleness
    batch.flush()
    stats = batch.cache.stats()
    assert stats["evictions"] > 0 and stats["write_back_rows"] == 0
    per_table = batch.cache.table_stats()  # the tables' counters add up to the cache's
    for counter in ("cache_hits", "cache_misses"):
        assert sum(t[counter] for t in per_table) == stats[counter]
    for t, ref in enumerate(references):
        # torch's coalesce sums a repeated id's gradients in its own order; a row's gradient is at
        # most 25 in size (bags of 4 ids, |target| <= 5, an id repeated within a feature's values)
        torch.testing.assert_close(batch.weights_of(batch.read_rows(t, torch.arange(ROWS[t]))), ref.weight.detach(),
                                   **rounding_tolerance(40, 0.2, 25.0))
    batch.close()


def test_ids_outside_their_table_are_refused_by_name(tmp_path):
    batch = open_table_batch([DiskTable("wide", 10, str(tmp_path / "a")), DiskTable("narrow", 5, str(tmp_path / "b"))],
                             DIM)
    with pytest.raises(ValueError, match=r"id 5 is out of range \[0, 5\) of table 'narrow'"):
        batch.pool(torch.tensor([9, 5]), [1, 1], [0, 1], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"id -1 is out of range \[0, 5\) of table 'narrow'"):
        batch.read_rows(1, torch.tensor([-1]))
    assert batch.read_rows(1, torch.tensor([4])).shape == (1, DIM)
    batch.close()


def test_a_failing_table_holds_back_no_other_table(tmp_path):
    # Table a's store stops taking writes (closed, as a failed device would); updated rows of both
    # tables wait in the write-back buffer (no cache): table b's must still reach its store, and
    # only table a's stay waiting, raised by name.
    batch = open_table_batch([DiskTable("a", 1000, str(tmp_path / "a")), DiskTable("b", 1000, str(tmp_path / "b"))],
                             DIM, optimizer=optim.SGD(lr=0.5), cache_rows=0, memory_budget_bytes=1 << 20)
    ids = torch.arange(100)
    out = batch.pool(torch.cat([ids, ids]), [100, 100], [0, 1], torch.arange(201))
    batch.stores[0].close()  # after the rows were read: their updates are what fails to land
    out.sum().backward()
    with pytest.raises(Exception, match="closed"):
        batch.flush()
    assert batch.cache.stats()["write_back_rows"] == 100  # table a's rows, kept in memory
    updated_b = batch.read_rows(1, ids)
    torch.testing.assert_close(batch.stores[1].get(ids), updated_b, rtol=0, atol=0)  # b's reached its store
    initial_b = open_table_batch([DiskTable("b0", 1000, str(tmp_path / "b0"))], DIM).read_rows(0, ids)
    assert not torch.equal(updated_b, initial_b)  # they are the updated rows, not the initial ones
    with pytest.raises(Exception):
        batch.close()


def test_a_table_holding_rows_reopens_only_when_asked_and_loses_nothing(tmp_path):
    spec = [DiskTable("t", 100, str(tmp_path / "t"), seed=5), DiskTable("u", 100, str(tmp_path / "u"), seed=6)]
    batch = open_table_batch(spec, DIM)
    batch.pool(torch.arange(10), [10], [0], torch.arange(11)).sum().backward()
    trained = batch.read_rows(0, torch.arange(100))
    batch.close()
    with pytest.raises(FileExistsError, match=r"'t' at .*/t \(10 rows\): the directory holds rows .*reopen=True"):
        open_table_batch(spec, DIM)
    reopened = open_table_batch(spec, DIM, reopen=True)  # the refusal touched nothing
    torch.testing.assert_close(reopened.read_rows(0, torch.arange(100)), trained, rtol=0, atol=0)
    reopened.close()


def test_a_reopened_table_keeps_the_seed_it_was_created_with(tmp_path):
    first = open_table_batch([DiskTable("t", 1000, str(tmp_path / "t"), seed=11)], DIM)
    first.pool(torch.arange(3), [3], [0], torch.arange(4)).sum().backward()
    rows = first.read_rows(0, torch.arange(1000))  # rows never written included
    first.close()
    drawn = open_table_batch([DiskTable("t", 1000, str(tmp_path / "t"), seed=99, seed_drawn=True)], DIM, reopen=True)
    assert drawn.tables[0].seed == 11
    torch.testing.assert_close(drawn.read_rows(0, torch.arange(1000)), rows, rtol=0, atol=0)
    drawn.close()
    with pytest.raises(ValueError, match=r"'t' at .* was created with seed 11, not 99"):
        open_table_batch([DiskTable("t", 1000, str(tmp_path / "t"), seed=99)], DIM, reopen=True)
    (tmp_path / "t" / "TABLE.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"TABLE.json is unreadable or corrupted"):
        open_table_batch([DiskTable("t", 1000, str(tmp_path / "t"), seed=11)], DIM, reopen=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("optimizer", [optim.SGD(), optim.Adagrad(), optim.RowWiseAdagrad(), optim.Adam()],
                         ids=["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_the_row_layout_is_the_one_the_cache_uses(tmp_path, dtype, optimizer):
    # Python sizes budgets and stores by mlkv_torch.row_layout; the C++ cache lays rows out itself.
    for dim in (1, 3, 8):
        batch = open_table_batch([DiskTable("t", 10, str(tmp_path / f"t{dim}"))], dim, optimizer=optimizer,
                                 memory_budget_bytes=1 << 20, dtype=dtype)
        assert batch.cache.weight_words == weight_words(dim, dtype)
        assert batch.cache.row_words == row_words(dim, dtype, optimizer)
        batch.close()


def test_one_rule_plans_every_batch_and_the_opened_batches_spend_what_it_planned(tmp_path):
    from mlkv_torch.memory_budget import (LayoutDemand, host_memory_for_all_rows, least_host_memory, plan_host_memory,
                                          split_budget, split_host_memory)
    from mlkv_torch.opening import TableSpec, open_tables
    from mlkv_torch.row_layout import RowLayout

    budget = 4 << 20
    # A lone layout takes the whole budget; an explicit cache size is all its own.
    [(share, split)] = plan_host_memory(budget, [LayoutDemand(2, 10_000, 64, 0, 1.0)], True, cache_rows=500)
    assert share == budget and split == split_host_memory(budget, 2, 10_000, 64, True, 500)
    # Several share it by traffic after each its least, none more than caching all its rows takes.
    narrow, wide = RowLayout(DIM, torch.float32, optim.SGD()), RowLayout(2 * DIM, torch.float32, optim.Adam())
    specs = [TableSpec(DiskTable("a", 100, str(tmp_path / "a")), narrow),
             TableSpec(DiskTable("b", 200_000, str(tmp_path / "b")), wide, lookups_per_sample=3.0),
             TableSpec(DiskTable("c", 50_000, str(tmp_path / "c")), narrow)]
    demands = [LayoutDemand(2, 50_100, narrow.row_bytes, 0, 2.0), LayoutDemand(1, 200_000, wide.row_bytes, 0, 3.0)]
    planned = plan_host_memory(budget, demands, True, cache_rows=8_000)
    shares = split_budget(budget, [host_memory_for_all_rows(*d[:4]) for d in demands], [2.0, 3.0],
                          [least_host_memory(*d[:4]) for d in demands])
    assert [s for s, _ in planned] == shares and sum(shares) <= budget
    assert [split.cache_rows for _, split in planned] == [8_000 * s // budget for s in shares]
    opened = open_tables(specs, memory_budget_bytes=budget, cache_rows=8_000)
    assert opened.places == [(0, 0), (1, 0), (0, 1)]  # grouped by layout, in the order layouts first appear
    for batch, (share, split) in zip(opened.batches, planned):
        assert (batch.memory_budget_bytes, batch.cache_rows, batch.staging_rows, batch.write_back_rows) == (
            share, split.cache_rows, split.staging_rows, split.write_back_rows)
        batch.close()


def test_a_row_shard_starts_as_its_block_of_the_full_table(tmp_path):
    # A row shard's ids are local to its block (TorchRec's bucketization); its rows never written
    # are the full table's rows first_row + id, in the cache as in DiskTable.initial_rows.
    full = DiskTable("t", 1000, str(tmp_path / "full"), seed=3, init=("uniform", -0.5, 0.5))
    block = DiskTable("t", 300, str(tmp_path / "block"), seed=3, init=("uniform", -0.5, 0.5), first_row=600)
    ids = torch.tensor([0, 7, 299])
    expected = full.initial_rows(ids + 600, DIM)
    torch.testing.assert_close(block.initial_rows(ids, DIM), expected, rtol=0, atol=0)
    batch = open_table_batch([block], DIM)
    torch.testing.assert_close(batch.weights_of(batch.read_rows(0, ids)), expected, rtol=0, atol=0)
    batch.close()
    with pytest.raises(ValueError, match="first_row must be a non-negative int, got -1"):
        DiskTable("t", 300, str(tmp_path / "bad"), first_row=-1)
