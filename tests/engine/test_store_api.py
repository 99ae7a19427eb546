"""The KVStore API: round trips, upsert semantics, counters, reopen, engines."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import mlkv_torch
from mlkv_torch import KVStore

from conftest import (DIM, HAS_PROMOTE, NO_PROMOTE, SMALL_OPTIONS, assert_reopens_equal, assert_store_equals, put_model,
                      rows_for)

URING = mlkv_torch._C.uring_available()
ENGINES = ["threads", "pread", pytest.param("uring", marks=pytest.mark.skipif(not URING, reason="no io_uring here"))]


def random_rows(n, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_dtypes(open_store, tmp_path, dtype):
    n = 3000
    keys = torch.randperm(n, generator=torch.Generator().manual_seed(1)) * 7 + 3
    values = random_rows(n, DIM, dtype, seed=2)
    store = open_store(dtype=dtype)
    store.put(keys, values)
    got = store.get(keys)
    assert got.dtype == dtype and got.shape == (n, DIM)
    torch.testing.assert_close(got, values, rtol=0, atol=0)
    # Most rows no longer fit in memory: part of the get came from disk.
    stats = store.stats()
    assert stats["disk_rows"] > 0
    assert stats["record_bytes"] == 16 + DIM * torch.tensor([], dtype=dtype).element_size()
    # A shuffled subset in another order.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))[:500]
    torch.testing.assert_close(store.get(keys[perm]), values[perm], rtol=0, atol=0)
    store.close()
    with KVStore(str(tmp_path / "store"), DIM, dtype, **SMALL_OPTIONS) as reopened:
        assert len(reopened) == n
        torch.testing.assert_close(reopened.get(keys), values, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [1, 3, 1020, 1500])
def test_round_trip_odd_and_wide_rows(open_store, tmp_path, dim):
    # dim 1020: a record of exactly one 4 KiB block; 1500: a record spanning two blocks.
    budget = 32 << 10 if dim < 100 else 16 * 8192
    store = open_store(dim=dim, memory_budget_bytes=budget, segment_bytes=4 * budget)
    n = 200 if dim > 100 else 3000
    keys = torch.arange(n) * 3
    values = random_rows(n, dim, torch.float32, seed=dim)
    store.put(keys, values)
    torch.testing.assert_close(store.get(keys), values, rtol=0, atol=0)
    assert store.stats()["disk_rows"] > 0
    store.close()
    with KVStore(str(tmp_path / "store"), dim, memory_budget_bytes=budget, segment_bytes=4 * budget) as reopened:
        torch.testing.assert_close(reopened.get(keys), values, rtol=0, atol=0)


def test_extreme_keys(open_store):
    store = open_store()
    keys = torch.tensor([0, 1, 2**31, 2**32 + 5, 2**62, 2**63 - 1, 2**63 - 2], dtype=torch.int64)
    values = random_rows(len(keys), DIM, torch.float32, seed=4)
    store.put(keys, values)
    torch.testing.assert_close(store.get(keys), values, rtol=0, atol=0)
    assert store.contains(keys).all()
    assert not store.contains(torch.tensor([3, 2**63 - 3])).any()
    assert store.delete(keys[-2:]) == 2
    assert 2**63 - 1 not in store and 2**62 in store


def test_duplicates_last_wins(open_store):
    store = open_store()
    keys = torch.tensor([1, 2, 1, 3, 1, 2])
    values = rows_for(torch.arange(6), tag=0)
    store.put(keys, values)
    assert len(store) == 3
    torch.testing.assert_close(store.get(torch.tensor([1, 2, 3])), values[[4, 5, 3]], rtol=0, atol=0)


def test_duplicates_last_wins_across_pages(open_store):
    # The first copy of key 7 lands in a page that leaves the mutable region
    # (and memory) before the batch ends; the last copy must still win.
    store = open_store()
    n = 2000
    keys = torch.arange(n)
    keys[0] = 7
    keys[-1] = 7
    keys[1000] = 7
    values = rows_for(torch.arange(n), tag=1)
    store.put(keys, values)
    torch.testing.assert_close(store.get(torch.tensor([7])), values[-1:], rtol=0, atol=0)
    assert len(store) == n - 3  # keys 0, 1000 and 1999 were replaced by 7 (7 itself is in range)
    store.put(torch.tensor([7, 7]), values[:2])
    torch.testing.assert_close(store.get(torch.tensor([7])), values[1:2], rtol=0, atol=0)


def test_contains_delete_len_in(open_store):
    store = open_store()
    model = {}
    put_model(store, model, range(0, 3000), rows_for(torch.arange(3000), tag=0))
    assert len(store) == 3000
    assert 0 in store and 2999 in store and 3000 not in store
    found = store.contains(torch.tensor([5, 3000, 10, -0, 99999]))
    assert found.dtype == torch.bool
    assert found.tolist() == [True, False, True, True, False]
    # Delete on-disk and in-memory rows, absent keys and a duplicate.
    assert store.delete(torch.tensor([5, 2998, 5, 123456])) == 2
    del model[5], model[2998]
    assert store.delete([5]) == 0
    assert len(store) == 2998
    assert 5 not in store and 2998 not in store
    with pytest.raises(KeyError, match="5"):
        store.get(torch.tensor([4, 5]))
    # Deleted keys come back on put.
    put_model(store, model, [5], rows_for(torch.tensor([5]), tag=9))
    assert_store_equals(store, model)


def test_get_missing_names_keys(open_store):
    store = open_store()
    store.put(torch.arange(10), rows_for(torch.arange(10), 0))
    with pytest.raises(KeyError) as info:
        store.get(torch.tensor([1, 77, 2, 88]))
    assert "77" in str(info.value) and "88" in str(info.value)
    assert "2 keys" in str(info.value)


def test_empty_keys(open_store):
    store = open_store()
    store.put(torch.arange(5), rows_for(torch.arange(5), 0))
    for keys in (torch.empty(0, dtype=torch.int64), []):
        out = store.get(keys)
        assert out.shape == (0, DIM) and out.dtype == torch.float32
        assert store.contains(keys).shape == (0,)
        assert store.delete(keys) == 0
        store.lookahead(keys)
        store.put(keys, torch.empty(0, DIM))
    store.flush()
    assert len(store) == 5


def test_python_list_keys(open_store):
    store = open_store()
    values = rows_for(torch.tensor([10, 20, 30]), 0)
    store.put([10, 20, 30], values)
    torch.testing.assert_close(store.get([30, 10]), values[[2, 0]], rtol=0, atol=0)
    assert store.contains([20, 21]).tolist() == [True, False]
    store.lookahead([10, 20])
    store.flush()
    assert store.delete([20, 21]) == 1
    assert len(store) == 2


def test_non_contiguous_inputs(open_store):
    store = open_store()
    n = 50
    values = torch.randn(DIM, n).t()  # column-major view
    assert not values.is_contiguous()
    keys = torch.arange(2 * n)[::2]
    assert not keys.is_contiguous()
    store.put(keys, values)
    torch.testing.assert_close(store.get(keys), values.contiguous(), rtol=0, atol=0)
    torch.testing.assert_close(store.get(torch.arange(2 * n).flip(0)[1::2]), values.flip(0), rtol=0, atol=0)
    # Values with a storage offset.
    big = torch.randn(n + 1, DIM + 3)
    store.put(keys, big[1:, 2:2 + DIM])
    torch.testing.assert_close(store.get(keys), big[1:, 2:2 + DIM], rtol=0, atol=0)


def test_get_does_not_alias_input_or_store(open_store):
    store = open_store()
    values = rows_for(torch.arange(4), 0)
    store.put(torch.arange(4), values)
    values.add_(1)  # the store copied them
    torch.testing.assert_close(store.get(torch.arange(4)), rows_for(torch.arange(4), 0), rtol=0, atol=0)
    out = store.get(torch.arange(4))
    out.zero_()
    torch.testing.assert_close(store.get(torch.arange(4)), rows_for(torch.arange(4), 0), rtol=0, atol=0)


def test_counters_memory_disk_lookahead(open_store):
    store = open_store(compaction_ratio=0, **NO_PROMOTE)
    n = 3000
    store.put(torch.arange(n), rows_for(torch.arange(n), 0))
    s0 = store.stats()
    assert s0["rows"] == n and s0["tail_address"] == n and s0["appends"] == n
    assert s0["head_address"] <= s0["read_only_address"] <= s0["tail_address"]
    assert s0["head_address"] > 100  # key k is at slot k: keys below head are on disk only
    assert s0["page_bytes"] == 4096 and s0["record_bytes"] == 48
    assert s0["disk_bytes"] > 0 and s0["memory_bytes"] >= s0["index_bytes"]

    # The newest key is in memory.
    store.get(torch.tensor([n - 1]))
    s1 = store.stats()
    assert s1["memory_hits"] == s0["memory_hits"] + 1 and s1["disk_rows"] == s0["disk_rows"]

    # Old keys come from disk: keys 0..9 lie in one 4 KiB block.
    store.get(torch.arange(10))
    s2 = store.stats()
    assert s2["disk_rows"] == s1["disk_rows"] + 10
    assert s2["disk_reads"] == s1["disk_reads"] + 1
    assert s2["memory_hits"] == s1["memory_hits"]

    # Lookahead brings them into memory; afterwards they are memory hits.
    store.lookahead(torch.arange(20))
    store.flush()
    s3 = store.stats()
    assert s3["lookahead_rows"] == s2["lookahead_rows"] + 20
    torch.testing.assert_close(store.get(torch.arange(20)), rows_for(torch.arange(20), 0), rtol=0, atol=0)
    s4 = store.stats()
    assert s4["memory_hits"] == s3["memory_hits"] + 20 and s4["disk_rows"] == s3["disk_rows"]

    # Lookahead of rows already in memory or absent does nothing.
    store.lookahead(torch.tensor([n - 1, n + 100]))
    store.flush()
    assert store.stats()["lookahead_rows"] == s3["lookahead_rows"]

    # Checkpoints count, and so does the one at creation.
    before = store.stats()["checkpoints"]
    store.checkpoint()
    assert store.stats()["checkpoints"] == before + 1


def test_in_place_updates_and_appends(open_store):
    store = open_store(compaction_ratio=0)
    store.put(torch.arange(10), rows_for(torch.arange(10), 0))
    s0 = store.stats()
    store.put(torch.arange(10), rows_for(torch.arange(10), 1))  # still in the mutable region
    s1 = store.stats()
    assert s1["in_place_updates"] == s0["in_place_updates"] + 10
    assert s1["tail_address"] == s0["tail_address"]
    torch.testing.assert_close(store.get(torch.arange(10)), rows_for(torch.arange(10), 1), rtol=0, atol=0)


def test_compact_counts_and_keeps_contents(open_store):
    store = open_store(compaction_ratio=0)
    model = {}
    for tag in range(4):
        put_model(store, model, range(0, 2000), rows_for(torch.arange(2000), tag))
    store.delete(torch.arange(0, 2000, 3))
    for k in range(0, 2000, 3):
        del model[k]
    before = store.stats()
    assert before["compactions"] == 0
    store.compact()
    after = store.stats()
    assert after["compactions"] == 1
    assert after["checkpoints"] == before["checkpoints"] + 1
    assert after["compacted_rows"] > 0
    assert after["begin_address"] > before["begin_address"]
    assert after["disk_bytes"] < before["disk_bytes"]
    assert_store_equals(store, model)
    assert_reopens_equal(store, model)


def test_automatic_compaction_bounds_disk(open_store):
    store = open_store(compaction_ratio=2.0)
    n = 2000
    model = {}
    put_model(store, model, range(n), rows_for(torch.arange(n), 0))
    g = torch.Generator().manual_seed(5)
    seg = SMALL_OPTIONS["segment_bytes"]
    for tag in range(1, 41):
        keys = torch.randint(0, n, (500,), generator=g)
        put_model(store, model, keys.tolist(), rows_for(keys, tag))
        # Once the background compaction is done (its checkpoint deletes the segments it moved past):
        # the log within the stall's 1.25x of the ratio and a segment being written, and a snapshot
        # (at most the budget). While one runs, its segments and the snapshot before stay too.
        store.flush()
        s = store.stats()
        live = s["rows"] * s["record_bytes"]
        assert s["disk_bytes"] <= 2.5 * live + 2 * seg + SMALL_OPTIONS["memory_budget_bytes"], s
    s = store.stats()
    assert s["compactions"] > 0, s
    assert_store_equals(store, model)
    assert_reopens_equal(store, model)


def test_without_automatic_compaction_disk_grows(open_store):
    store = open_store(compaction_ratio=0)
    n = 2000
    for tag in range(10):
        store.put(torch.arange(n), rows_for(torch.arange(n), tag))
    s = store.stats()
    assert s["compactions"] == 0
    assert s["disk_bytes"] > 5 * s["rows"] * s["record_bytes"]


def test_reopen_with_smaller_budget(tmp_path):
    path = str(tmp_path / "store")
    n = 4000
    model = {}
    # 128 KiB budget: 8 KiB pages, 16 of them.
    with KVStore(path, DIM, memory_budget_bytes=128 << 10, expected_rows=1024, segment_bytes=32 << 10) as store:
        put_model(store, model, range(n), rows_for(torch.arange(n), 0))
        put_model(store, model, range(n - 100, n), rows_for(torch.arange(n - 100, n), 1))  # in-place updates
        store.delete(torch.arange(n - 50, n))
        for k in range(n - 50, n):
            del model[k]
        assert store.stats()["page_bytes"] == 8192
    # 32 KiB: 4 of the same pages. The snapshot (mutable pages) no longer fits in memory.
    with KVStore(path, DIM, memory_budget_bytes=32 << 10, expected_rows=16, segment_bytes=32 << 10) as store:
        s = store.stats()
        assert s["page_bytes"] == 8192 and s["log_memory_bytes"] == 32 << 10
        assert_store_equals(store, model)
        put_model(store, model, range(n, n + 500), rows_for(torch.arange(n, n + 500), 2))
        assert_store_equals(store, model)
    # Back to a large budget.
    with KVStore(path, DIM, memory_budget_bytes=1 << 20, segment_bytes=32 << 10) as store:
        assert_store_equals(store, model)
    # Smaller than 4 pages of the stored page size: refused, contents intact; the store says its least budget.
    assert KVStore.minimum_memory_bytes(path) == 32 << 10
    assert KVStore.minimum_memory_bytes(str(tmp_path / "no store here")) == 0
    with pytest.raises(ValueError, match="fewer than 4 log pages"):
        KVStore(path, DIM, memory_budget_bytes=16 << 10)
    with KVStore(path, DIM, memory_budget_bytes=32 << 10) as store:
        assert_store_equals(store, model)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_io_engines_agree(tmp_path, engine, direct_io):
    path = str(tmp_path / "store")
    n = 3000
    g = torch.Generator().manual_seed(11)
    values = torch.randn(n, DIM, generator=g)
    with KVStore(path, DIM, io_engine=engine, direct_io=direct_io, io_depth=4, io_threads=3, **SMALL_OPTIONS) as store:
        assert store.stats()["io_engine"] == {"threads": "threads", "uring": "io_uring", "pread": "pread"}[engine]
        assert store.stats()["direct_io"] == direct_io
        store.put(torch.arange(n), values)
        perm = torch.randperm(n, generator=g)
        torch.testing.assert_close(store.get(perm), values[perm], rtol=0, atol=0)
        assert store.stats()["disk_rows"] > 0
    # The other engine reads the same files.
    other = "threads" if engine == "uring" else ("uring" if URING else "threads")
    with KVStore(path, DIM, io_engine=other, **SMALL_OPTIONS) as store:
        torch.testing.assert_close(store.get(torch.arange(n)), values, rtol=0, atol=0)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_auto_reads_a_store_in_memory_on_the_calling_thread_and_one_on_disk_through_the_kernels_queue(tmp_path):
    # /dev/shm is tmpfs: a read there is a copy, which a hand-off to io_uring's or the pool's threads only delays.
    in_memory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with KVStore(os.path.join(in_memory, "store"), DIM, **SMALL_OPTIONS) as store:
            assert store.stats()["io_engine"] == "pread"
            store.put(torch.arange(3000), torch.ones(3000, DIM))
            torch.testing.assert_close(store.get(torch.arange(3000)), torch.ones(3000, DIM), rtol=0, atol=0)
            assert store.stats()["disk_rows"] > 0
    finally:
        shutil.rmtree(in_memory)
    on_disk = "pread" if _on_tmpfs(tmp_path) else "io_uring" if URING else "threads"
    with KVStore(str(tmp_path / "store"), DIM, **SMALL_OPTIONS) as store:
        assert store.stats()["io_engine"] == on_disk


def _on_tmpfs(path) -> bool:
    with open("/proc/mounts") as mounts:
        points = [(line.split()[1], line.split()[2]) for line in mounts]
    mount = max((p for p in points if str(path).startswith(p[0].rstrip("/") + "/") or str(path) == p[0]),
                key=lambda p: len(p[0]))
    return mount[1] in ("tmpfs", "ramfs")


def test_large_batch_get_many_blocks(open_store):
    # More disk blocks than one read round holds (4096 units) and more than io_depth.
    store = open_store(memory_budget_bytes=64 << 10, expected_rows=16, segment_bytes=1 << 20, io_depth=8)
    n = 400_000
    values = rows_for(torch.arange(n), 3)
    store.put(torch.arange(n), values)
    keys = torch.randperm(n, generator=torch.Generator().manual_seed(12))
    torch.testing.assert_close(store.get(keys), values[keys], rtol=0, atol=0)
    s = store.stats()
    assert s["disk_reads"] > 4096 and s["rows"] == n


def test_reopen_after_close_equals_dict(tmp_path):
    path = str(tmp_path / "store")
    g = torch.Generator().manual_seed(13)
    model = {}
    for round_ in range(4):
        with KVStore(path, DIM, compaction_ratio=0 if round_ % 2 else 2.0, **SMALL_OPTIONS) as store:
            assert_store_equals(store, model)
            for tag in range(3):
                keys = torch.randint(0, 4000, (700,), generator=g)
                put_model(store, model, keys.tolist(), rows_for(keys, round_ * 10 + tag))
                dead = torch.randint(0, 4000, (100,), generator=g)
                expected = len({k for k in dead.tolist() if k in model})
                assert store.delete(dead) == expected
                for k in dead.tolist():
                    model.pop(k, None)
            if round_ == 2:
                store.compact()
            assert_store_equals(store, model)
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        assert_store_equals(store, model)


def test_fresh_store_files_and_close_idempotent(tmp_path):
    path = tmp_path / "a" / "b" / "store"  # parents are created
    store = KVStore(str(path), DIM, **SMALL_OPTIONS)
    names = set(os.listdir(path))
    assert {"CHECKPOINT", "LOCK"} <= names
    assert os.path.getsize(path / "CHECKPOINT") == 96
    assert store.stats()["checkpoints"] == 1
    assert "rows=0" in repr(store) and store.dim == DIM and store.dtype == torch.float32
    assert store.path == str(path)
    store.close()
    store.close()
    with KVStore(path, DIM, **SMALL_OPTIONS) as reopened:  # os.PathLike
        assert len(reopened) == 0


def test_destroy_removes_a_closed_stores_files_and_nothing_else(tmp_path):
    path = tmp_path / "store"
    store = KVStore(str(path), DIM, **SMALL_OPTIONS)
    store.put(torch.arange(3000), rows_for(torch.arange(3000), 0))  # segment files too
    store.checkpoint()
    (path / "notes.txt").write_text("not the store's")
    with pytest.raises(ValueError, match=r"store at .* is open: close it before destroying it"):
        KVStore.destroy(path)
    assert len(store) == 3000  # refused: nothing touched
    store.close()
    assert any(name.startswith("segment-") for name in os.listdir(path))
    KVStore.destroy(path)
    assert os.listdir(path) == ["notes.txt"]
    with KVStore(path, DIM * 2, **SMALL_OPTIONS) as fresh:  # another layout: nothing of the old store is left
        assert len(fresh) == 0
    KVStore.destroy(tmp_path / "never-created")  # nothing there: nothing to do


def test_context_manager_closes(tmp_path):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        store.put(torch.arange(3), rows_for(torch.arange(3), 0))
    with pytest.raises(ValueError, match="closed"):
        store.get(torch.arange(3))
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:  # the lock was released
        assert len(store) == 3


def test_stats_keys(open_store):
    stats = open_store().stats()
    for name in ("rows", "memory_bytes", "index_bytes", "disk_bytes", "memory_hits", "disk_reads", "disk_rows",
                 "lookahead_rows", "compactions", "checkpoints", "head_address", "read_only_address", "tail_address",
                 "page_bytes", "record_bytes", "direct_io", "io_engine") + (("promoted_rows",) if HAS_PROMOTE else ()):
        assert name in stats, name


def test_index_grows_past_expected_rows(open_store):
    store = open_store(expected_rows=1, memory_budget_bytes=256 << 10, segment_bytes=1 << 20)
    n = 40_000  # more than the smallest index holds at four keys per bucket
    store.put(torch.arange(n) * 1_000_003, rows_for(torch.arange(n), 0))
    assert len(store) == n
    torch.testing.assert_close(store.get(torch.arange(n) * 1_000_003), rows_for(torch.arange(n), 0), rtol=0, atol=0)
    assert not store.contains(torch.arange(n) * 1_000_003 + 1).any()
    assert store.delete(torch.arange(0, n, 2) * 1_000_003) == n // 2
    assert len(store) == n // 2
    torch.testing.assert_close(store.get(torch.arange(1, n, 2) * 1_000_003), rows_for(torch.arange(1, n, 2), 0),
                               rtol=0, atol=0)


def test_get_with_duplicate_keys_from_memory_and_disk(open_store):
    store = open_store(**NO_PROMOTE)
    n = 3000
    store.put(torch.arange(n), rows_for(torch.arange(n), 0))
    keys = torch.tensor([41, 41, 2999, 41, 2999, 42, 0, 0])
    torch.testing.assert_close(store.get(keys), rows_for(keys, 0), rtol=0, atol=0)
    store.lookahead(keys)
    store.flush()
    assert store.stats()["lookahead_rows"] == 3  # 41, 42 and 0, once each
    torch.testing.assert_close(store.get(keys), rows_for(keys, 0), rtol=0, atol=0)


def test_missing_keys_message_names_each_missing_key(open_store):
    """KeyError must name the missing keys; a repeated missing key must not crowd out the others.

    Engine bug: the message lists missing keys per occurrence, first ten only,
    so get([5] * 20 + [6]) says "21 keys not in store ...: 5, 5, 5, ..., ..."
    and never names 6.
    """
    store = open_store()
    store.put(torch.arange(3), rows_for(torch.arange(3), 0))
    with pytest.raises(KeyError) as info:
        store.get(torch.tensor([5] * 20 + [1, 6]))
    message = str(info.value)
    named = message.strip("'\"").rsplit(": ", 1)[-1].split(", ")
    assert "5" in named and "6" in named, message


def test_many_segment_files_within_open_file_limit(open_store):
    """A log of more segment files than the process may hold open still works.

    Engine bug: the store keeps one open descriptor per segment file for its
    whole life (KVStore::segments_), so a store of more than RLIMIT_NOFILE
    segments fails with OSError "Too many open files" on put, get or reopen;
    with the default 64 MiB segments and a 1024 soft limit that is a ~64 GiB table.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    limit = in_use + 64
    segments = 300  # one 4 KiB page (85 rows) per segment file
    n = 85 * segments
    path = None
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        store = open_store(segment_bytes=4096, compaction_ratio=0, io_engine="threads", io_threads=2)
        path = store.path
        store.put(torch.arange(n), rows_for(torch.arange(n), 0))
        torch.testing.assert_close(store.get(torch.arange(0, n, 7)), rows_for(torch.arange(0, n, 7), 0),
                                   rtol=0, atol=0)
        store.close()
        with KVStore(path, DIM, **dict(SMALL_OPTIONS, segment_bytes=4096, io_engine="threads", io_threads=2)) as again:
            assert len(again) == n
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_layout_options_are_fixed_at_creation(tmp_path):
    path = str(tmp_path / "store")
    n = 3000
    with KVStore(path, DIM, **dict(SMALL_OPTIONS, page_bytes=8192)) as store:
        store.put(torch.arange(n), rows_for(torch.arange(n), 0))
        assert store.stats()["page_bytes"] == 8192
    # Other page and segment sizes on reopen: the stored layout wins.
    with KVStore(path, DIM, memory_budget_bytes=64 << 10, page_bytes=4096, segment_bytes=1 << 20) as store:
        assert store.stats()["page_bytes"] == 8192
        torch.testing.assert_close(store.get(torch.arange(n)), rows_for(torch.arange(n), 0), rtol=0, atol=0)
        store.put(torch.arange(n, 2 * n), rows_for(torch.arange(n, 2 * n), 1))
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        torch.testing.assert_close(store.get(torch.arange(2 * n)),
                                   torch.cat([rows_for(torch.arange(n), 0), rows_for(torch.arange(n, 2 * n), 1)]),
                                   rtol=0, atol=0)


def test_garbage_collected_store_checkpoints_and_unlocks(tmp_path):
    import gc

    path = str(tmp_path / "store")
    store = KVStore(path, DIM, **SMALL_OPTIONS)
    store.put(torch.arange(1000), rows_for(torch.arange(1000), 0))
    del store
    gc.collect()
    with KVStore(path, DIM, **SMALL_OPTIONS) as again:
        torch.testing.assert_close(again.get(torch.arange(1000)), rows_for(torch.arange(1000), 0), rtol=0, atol=0)


@pytest.mark.skipif(not HAS_PROMOTE, reason="this build has no promote_hot_reads")
@pytest.mark.parametrize("promote", [True, False])
def test_hot_reads_promoted_to_memory(open_store, promote):
    store = open_store(compaction_ratio=0, promote_hot_reads=promote)
    n = 3000
    store.put(torch.arange(n), rows_for(torch.arange(n), 0))
    keys = torch.arange(10)  # on disk only
    torch.testing.assert_close(store.get(keys), rows_for(keys, 0), rtol=0, atol=0)
    store.flush()
    assert store.stats()["promoted_rows"] == 0  # read once: not hot yet
    torch.testing.assert_close(store.get(keys), rows_for(keys, 0), rtol=0, atol=0)
    store.flush()  # waits for the background copies
    before = store.stats()
    assert before["promoted_rows"] == (10 if promote else 0)
    assert before["lookahead_rows"] == 0
    torch.testing.assert_close(store.get(keys), rows_for(keys, 0), rtol=0, atol=0)
    after = store.stats()
    if promote:
        assert after["memory_hits"] == before["memory_hits"] + 10 and after["disk_rows"] == before["disk_rows"]
    else:
        assert after["disk_rows"] == before["disk_rows"] + 10
    # A promoted row is a copy: an update after it wins, and reopen holds the update.
    store.put(keys[:3], rows_for(keys[:3], 1))
    torch.testing.assert_close(store.get(keys), torch.cat([rows_for(keys[:3], 1), rows_for(keys[3:], 0)]),
                               rtol=0, atol=0)
    store.close()
    with KVStore(store.path, DIM, **SMALL_OPTIONS) as again:
        torch.testing.assert_close(again.get(keys), torch.cat([rows_for(keys[:3], 1), rows_for(keys[3:], 0)]),
                                   rtol=0, atol=0)
