"""Primitives the embedding op builds on: deterministic initial rows, and lookup without KeyError."""
import math

import pytest
import torch

from mlkv_torch import KVStore, initial_rows


def test_initial_rows_depend_on_seed_and_id_only():
    ids = torch.tensor([7, 0, 123456789012, 7])
    rows = initial_rows(ids, 16, seed=1, num_embeddings=1000)
    torch.testing.assert_close(rows[0], rows[3], rtol=0, atol=0)
    again = initial_rows(torch.tensor([123456789012, 0]), 16, seed=1, num_embeddings=1000)
    torch.testing.assert_close(again, rows[[2, 1]], rtol=0, atol=0)  # batch order and size do not matter
    assert not torch.equal(initial_rows(ids, 16, seed=2, num_embeddings=1000), rows)
    assert not torch.equal(rows[0], rows[1])


def test_initial_rows_follow_torchrec_default_range_uniformly():
    n = 5000
    rows = initial_rows(torch.arange(n), 32, seed=0, num_embeddings=n)
    bound = math.sqrt(1 / n)
    assert rows.min() >= -bound and rows.max() < bound
    u = (rows.flatten() + bound) / (2 * bound)  # uniform [0, 1) if all is well
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts / u.numel() - 0.1).abs().max() < 0.01


def test_initial_rows_drawn_normal_are_normal_and_deterministic():
    rows = initial_rows(torch.arange(20_000), 16, seed=4, mean=-1.0, std=0.5)
    z = (rows.flatten() - (-1.0)) / 0.5  # standard normal if all is well
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert abs(((z.abs() < 1).float().mean() - 0.6827).item()) < 0.005  # one sigma
    assert abs(((z.abs() < 2).float().mean() - 0.9545).item()) < 0.003  # two sigma
    assert bool(torch.isfinite(rows).all())
    again = initial_rows(torch.tensor([19_999, 3]), 16, seed=4, mean=-1.0, std=0.5)
    torch.testing.assert_close(again, rows[[19_999, 3]], rtol=0, atol=0)
    shard = initial_rows(torch.tensor([3]), 4, seed=4, mean=-1.0, std=0.5, first_column=8)
    torch.testing.assert_close(shard, rows[[3], 8:12], rtol=0, atol=0)  # a column shard: its slice of the row
    with pytest.raises(ValueError, match="both mean and std"):
        initial_rows([1], 4, mean=0.0)
    with pytest.raises(ValueError, match="not both"):
        initial_rows([1], 4, low=0.0, high=1.0, mean=0.0, std=1.0)
    with pytest.raises(ValueError, match="std must be non-negative"):
        initial_rows([1], 4, mean=0.0, std=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_initial_rows_explicit_range_and_dtype(dtype):
    rows = initial_rows([1, 2, 3], 8, seed=5, low=2.0, high=3.0, dtype=dtype)
    assert rows.dtype == dtype and rows.shape == (3, 8)
    assert rows.min() >= 2.0 and rows.max() <= 3.0


def test_initial_rows_refuse_bad_input():
    with pytest.raises(ValueError, match="num_embeddings"):
        initial_rows([1], 4)
    with pytest.raises(ValueError, match="both low and high"):
        initial_rows([1], 4, low=0.0)
    with pytest.raises(TypeError, match="int64"):
        initial_rows(torch.tensor([1], dtype=torch.int32), 4, num_embeddings=10)
    with pytest.raises(ValueError, match="non-negative"):
        initial_rows(torch.tensor([-1]), 4, num_embeddings=10)
    with pytest.raises(TypeError, match="dtype"):
        initial_rows([1], 4, num_embeddings=10, dtype=torch.float64)


def test_lookup_reads_present_rows_from_memory_and_disk_and_marks_absent(tmp_path):
    with KVStore(tmp_path / "t", dim=8, memory_budget_bytes=32 << 10, expected_rows=1024) as store:
        values = torch.randn(3000, 8)
        store.put(torch.arange(0, 6000, 2), values)  # even keys only; most rows end up on disk
        keys = torch.tensor([0, 1, 5998, 3, 2, 100000, 4000])
        rows, found = store.lookup(keys)
        assert found.tolist() == [True, False, True, False, True, False, True]
        torch.testing.assert_close(rows[found], values[keys[found] // 2], rtol=0, atol=0)
        assert rows[~found].abs().sum() == 0
        assert store.stats()["disk_rows"] > 0
        with pytest.raises(ValueError, match="non-negative"):
            store.lookup(torch.tensor([-3]))


def test_lookup_and_get_of_no_keys(tmp_path):
    with KVStore(tmp_path / "e", dim=4) as store:
        rows, found = store.lookup(torch.tensor([], dtype=torch.int64))
        assert rows.shape == (0, 4) and found.shape == (0,)
        assert store.get(torch.tensor([], dtype=torch.int64)).shape == (0, 4)
