"""Whole-table snapshots and restores of a DiskEmbeddingBag, learning-rate changes, column shards.

A snapshot larger than the table's memory budget lives in a file-backed
tensor (the disk, not memory); restore writes weights and/or optimizer state
back, keeping the part not given.
"""
import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch

from mlkv_torch import DiskEmbeddingBag, initial_rows, optim


def _train(table: DiskEmbeddingBag, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, table.num_embeddings, (64,), generator=g)
        table(ids, torch.arange(0, 64, 4)).pow(2).sum().backward()


def _rss_anon_bytes() -> int:
    """Anonymous memory the process holds, after glibc returns what was freed (transient buffers
    freed into the heap would count otherwise, however the suite's earlier tests left malloc)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no RssAnon in /proc/self/status")


def test_snapshot_in_memory_when_it_fits_the_budget(tmp_path):
    table = DiskEmbeddingBag(500, 8, path=tmp_path / "t", optimizer=optim.Adagrad(lr=0.1), memory_budget_bytes=1 << 20)
    _train(table, 5)
    weight, state = table.snapshot(include_state=True)
    assert weight.untyped_storage().filename is None
    ids = torch.arange(500)
    expected_weight, expected_state = table.export_rows(ids, include_state=True)
    torch.testing.assert_close(weight, expected_weight, rtol=0, atol=0)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)
    assert tuple(state.shape) == (500, table.state_dim) == (500, 8)
    table.close()


def test_snapshot_larger_than_the_budget_is_file_backed_and_not_in_memory(tmp_path):
    rows, dim = 400_000, 64  # 100 MiB of weights, a 4 MiB budget
    table = DiskEmbeddingBag(rows, dim, path=tmp_path / "t", memory_budget_bytes=4 << 20, cache_rows=0)
    ids = torch.arange(rows)
    for start in range(0, rows, 100_000):
        chunk = ids[start:start + 100_000]
        table.import_rows(chunk, chunk.float().unsqueeze(1).expand(-1, dim) / rows)
    before = _rss_anon_bytes()
    weight = table.snapshot()
    grown = _rss_anon_bytes() - before
    assert weight.untyped_storage().filename is not None
    assert grown < 32 << 20, f"the snapshot took {grown >> 20} MiB of anonymous memory"
    torch.testing.assert_close(weight[::997, 0], ids[::997].float() / rows)
    assert not [p for p in (tmp_path / "t").iterdir() if p.name.startswith(".snapshot")], "the file must be unlinked"
    # Restore from the file-backed tensor into a fresh table, chunk by chunk.
    other = DiskEmbeddingBag(rows, dim, path=tmp_path / "u", memory_budget_bytes=4 << 20, cache_rows=0)
    other.restore(weight=weight)
    torch.testing.assert_close(other.export_rows(ids[::1013]), weight[::1013], rtol=0, atol=0)
    table.close()
    other.close()


@pytest.mark.parametrize("optimizer", [optim.Adagrad(lr=0.1), optim.RowWiseAdagrad(lr=0.1), optim.Adam(lr=0.05)],
                         ids=lambda o: type(o).__name__)
def test_restore_of_weights_and_state_continues_training_identically(tmp_path, optimizer):
    table = DiskEmbeddingBag(300, 8, path=tmp_path / "a", optimizer=optimizer, cache_rows=50)
    _train(table, 6)
    weight, state = table.snapshot(include_state=True)
    copy = DiskEmbeddingBag(300, 8, path=tmp_path / "b", optimizer=optimizer, cache_rows=50)
    copy.restore(weight=weight, state=state)
    copy.steps = table.steps  # Adam's bias correction counts the table's steps
    _train(table, 3, seed=1)
    _train(copy, 3, seed=1)
    torch.testing.assert_close(copy.snapshot(), table.snapshot(), rtol=0, atol=0)
    table.close()
    copy.close()


def test_restore_of_weights_alone_keeps_the_optimizer_state(tmp_path):
    table = DiskEmbeddingBag(200, 4, path=tmp_path / "t", optimizer=optim.Adagrad(lr=0.1))
    _train(table, 4)
    _, state = table.snapshot(include_state=True)
    new_weight = torch.randn(200, 4)
    table.restore(weight=new_weight)
    weight_after, state_after = table.snapshot(include_state=True)
    torch.testing.assert_close(weight_after, new_weight, rtol=0, atol=0)
    torch.testing.assert_close(state_after, state, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"weight must be a tensor of shape \[200, 4\]"):
        table.restore(weight=torch.zeros(200, 5))
    table.close()


def test_learning_rate_changes_apply_to_the_next_updates(tmp_path):
    table = DiskEmbeddingBag(100, 4, path=tmp_path / "t", optimizer=optim.SGD(lr=0.5), cache_rows=30)
    reference = torch.nn.EmbeddingBag(100, 4, mode="sum", sparse=True)
    with torch.no_grad():
        reference.weight.copy_(table.snapshot())
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for step in range(8):
        lr = 0.5 * 0.7 ** step  # a decaying schedule
        table.lr = lr
        for group in sgd.param_groups:
            group["lr"] = lr
        ids = torch.randint(0, 100, (40,), generator=g)
        offsets = torch.arange(0, 40, 5)
        table(ids, offsets).pow(2).sum().backward()
        sgd.zero_grad()
        reference(ids, offsets).pow(2).sum().backward()
        sgd.step()
    torch.testing.assert_close(table.snapshot(), reference.weight.detach())
    table.close()


def test_an_update_still_queued_keeps_the_learning_rate_of_its_step(tmp_path):
    table = DiskEmbeddingBag(50, 4, path=tmp_path / "t", optimizer=optim.SGD(lr=0.5), staleness=4)
    start = table.snapshot()
    ids, offsets = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 2])
    table._cache.pause_applier(True)  # hold the update in the queue
    table(ids, offsets).sum().backward()
    table.lr = 1e-4  # changed while the step's update is still queued
    table._cache.pause_applier(False)
    table.synchronize()
    expected = start.clone()
    expected[1] -= 0.5
    expected[2] -= 0.5 * 2
    expected[7] -= 0.5
    torch.testing.assert_close(table.snapshot(), expected)
    table.close()


def test_a_column_shard_starts_as_its_slice_of_the_full_table(tmp_path):
    ids = torch.tensor([0, 5, 99, 12345])
    full = initial_rows(ids, 12, seed=7, num_embeddings=50_000)
    torch.testing.assert_close(initial_rows(ids, 4, seed=7, num_embeddings=50_000, first_column=8), full[:, 8:])
    shard = DiskEmbeddingBag(50_000, 4, path=tmp_path / "c", seed=7, first_column=4)
    torch.testing.assert_close(shard.export_rows(ids), full[:, 4:8], rtol=0, atol=0)
    shard.close()
    with pytest.raises(ValueError, match="first_column"):
        DiskEmbeddingBag(10, 4, path=tmp_path / "d", first_column=-1)


def test_a_snapshot_that_finds_no_space_raises_and_loses_nothing(tmp_path):
    child = textwrap.dedent("""
        import resource, signal, sys, torch
        from mlkv_torch import DiskEmbeddingBag
        table = DiskEmbeddingBag(200_000, 16, path=sys.argv[1], memory_budget_bytes=1 << 20, cache_rows=0)
        ids = torch.arange(0, 200_000, 7)
        table.import_rows(ids, torch.ones(ids.numel(), 16))
        table.flush()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, hard))  # the snapshot needs 12.8 MB
        try:
            table.snapshot()
        except OSError as e:
            print("ERROR", e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        assert bool((table.export_rows(ids) == 1).all())
        table.close()
        print("INTACT")
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "t")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "snapshot" in out.stdout and "INTACT" in out.stdout, out.stdout
