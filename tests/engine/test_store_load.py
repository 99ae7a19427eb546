"""A load: an empty store filled from rows in key order, each written once, straight into its base
run (`KVStore.begin_load` / `load_rows` / `end_load`), as a reshard fills a table from another's
sorted rows.

Checked against a dict (the model): the rows read back, counted and scanned as loaded, across a
reopen; puts and deletes after the load; each row written once (no log record, one base row); what
a load refuses (a store with rows, keys out of order, writes meanwhile) and what a close or a crash
before its end leaves (the store as it was).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, rows_for

BASE = dict(SMALL_OPTIONS, index_budget_bytes=32 << 10)


def load(store: KVStore, keys: torch.Tensor, tag: int, chunk: int = 1000) -> dict:
    """Loads rows_for(keys, tag) chunk by chunk; returns the model."""
    assert store.begin_load(expected_rows=keys.numel())
    for start in range(0, keys.numel(), chunk):
        store.load_rows(keys[start:start + chunk], rows_for(keys[start:start + chunk], tag))
    assert store.end_load() == keys.numel()
    return dict(zip(keys.tolist(), rows_for(keys, tag)))


def test_loaded_rows_read_back_count_and_scan_in_key_order_each_written_once(tmp_path):
    path = str(tmp_path / "store")
    keys = torch.arange(0, 60_000, 3)  # gaps: the filter and fences tell absent keys
    with KVStore(path, DIM, **BASE) as store:
        model = load(store, keys, 1)
        stats = store.stats()
        assert (stats["appends"], stats["base_rows_written"], stats["base_runs"]) == (0, keys.numel(), 1)
        assert_store_equals(store, model)
        assert not store.contains(keys + 1).any()
        scanned = list(store.scan(chunk_rows=700, part="base"))
        assert torch.equal(torch.cat([k for k, _ in scanned]), keys)
        assert torch.equal(torch.cat([v for _, v in scanned]), rows_for(keys, 1))
        assert list(store.scan(part="log")) == []
    with KVStore(path, DIM, **BASE) as store:  # the checkpoint at close names the loaded run
        assert_store_equals(store, model)


def test_puts_and_deletes_after_a_load_go_on_as_over_any_base(tmp_path):
    path = str(tmp_path / "store")
    g = torch.Generator().manual_seed(0)
    with KVStore(path, DIM, **BASE) as store:
        model = load(store, torch.arange(20_000), 1)
        for step in range(10):  # past the index's budget: merges over the loaded run
            keys = torch.randint(0, 30_000, (900,), generator=g)
            store.put(keys, rows_for(keys, step + 2))
            model.update(zip(keys.tolist(), rows_for(keys, step + 2)))
            gone = torch.randint(0, 30_000, (50,), generator=g)
            store.delete(gone)
            for key in gone.tolist():
                model.pop(key, None)
        assert store.stats()["base_merges"] > 0
        assert_store_equals(store, model)
        log_keys = {k for keys, _ in store.scan(part="log") for k in keys.tolist()}
        base_keys = {k for keys, _ in store.scan(part="base") for k in keys.tolist()}
        assert not log_keys & base_keys and log_keys | base_keys == set(model)
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)


def test_a_load_refuses_a_store_with_rows_keys_out_of_order_and_writes_meanwhile(tmp_path):
    with KVStore(str(tmp_path / "full"), DIM, **BASE) as store:
        store.put(torch.tensor([5]), rows_for(torch.tensor([5]), 0))
        assert store.begin_load() is False  # nothing begun: writes go on
        store.put(torch.tensor([6]), rows_for(torch.tensor([6]), 0))
        with pytest.raises(ValueError, match="no load begun"):
            store.load_rows(torch.tensor([7]), rows_for(torch.tensor([7]), 0))
    with KVStore(str(tmp_path / "empty"), DIM, **BASE) as store:
        assert store.begin_load()
        with pytest.raises(ValueError, match="a load is begun|loading rows"):
            store.begin_load()
        store.load_rows(torch.tensor([1, 2]), rows_for(torch.tensor([1, 2]), 0))
        with pytest.raises(ValueError, match=r"increasing order; keys\[1\] = 2"):
            store.load_rows(torch.tensor([3, 2]), rows_for(torch.tensor([3, 2]), 0))
        for write in (lambda: store.put(torch.tensor([9]), rows_for(torch.tensor([9]), 0)),
                      lambda: store.delete(torch.tensor([1])), store.checkpoint, store.compact):
            with pytest.raises(ValueError, match="is loading rows \\(end the load first\\)"):
                write()
        assert not store.contains(torch.tensor([1])).any()  # not read until the load ends
        assert store.end_load() == 3  # 1, 2 and the 3 before the key out of order
        assert_store_equals(store, dict(zip([1, 2, 3], rows_for(torch.tensor([1, 2, 3]), 0))))
    with KVStore(str(tmp_path / "empty"), DIM, read_only=True, **SMALL_OPTIONS) as store:
        with pytest.raises(ValueError, match="read-only: load refused"):
            store.begin_load()


def test_a_close_before_the_end_leaves_the_store_as_it_was(tmp_path):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **BASE) as store:
        assert store.begin_load()
        store.load_rows(torch.arange(100), rows_for(torch.arange(100), 0))
    assert not [f for f in os.listdir(path) if f.startswith("run-")]
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, {})
        assert store.begin_load()  # still empty: a load begins
        store.end_load()


def test_a_crash_during_a_load_leaves_the_store_as_it_was_and_its_file_goes(tmp_path):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **BASE) as store:
        model = load(store, torch.arange(0, 5000, 2), 1)
    # A second load cannot begin on a store with rows; a crash in the middle of one into a fresh
    # store leaves that one empty.
    fresh = str(tmp_path / "fresh")
    script = (f"import os, torch\nfrom mlkv_torch import KVStore\nfrom conftest import rows_for\n"
              f"s = KVStore({fresh!r}, {DIM}, **{BASE!r})\nassert s.begin_load()\n"
              f"s.load_rows(torch.arange(3000), rows_for(torch.arange(3000), 2))\nos._exit(0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path]))
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    assert [f for f in os.listdir(fresh) if f.startswith("run-")]  # the crash left the unnamed run
    with KVStore(fresh, DIM, **BASE) as store:
        assert_store_equals(store, {})
    assert not [f for f in os.listdir(fresh) if f.startswith("run-")]  # recovery removed it
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)


def test_filling_loads_while_the_keys_increase_then_puts(tmp_path):
    keys = torch.arange(30_000)
    # Increasing, then a chunk increasing within itself but below the last key, then one decreasing.
    chunks = [keys[:10_000], keys[20_000:], keys[10_000:20_000], keys[:100].flip(0)]
    with KVStore(str(tmp_path / "store"), DIM, **BASE) as store:
        with store.filling(expected_rows=30_000) as write:
            for tag, chunk in enumerate(chunks):
                write(chunk, rows_for(chunk, tag))
        model = {}
        for tag, chunk in enumerate(chunks):
            model.update(zip(chunk.tolist(), rows_for(chunk, tag)))
        # The first two chunks increase: loaded, each row written once; the rest put, newer than them.
        assert store.stats()["appends"] == 10_100
        assert_store_equals(store, model)
        with store.filling() as write:  # a store with rows: every chunk put
            write(torch.tensor([40_000]), rows_for(torch.tensor([40_000]), 9))
        assert store.stats()["appends"] == 10_101
