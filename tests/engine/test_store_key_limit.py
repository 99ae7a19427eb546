"""A store's key_limit: its keys lie below it, so its index hashes only the bits they have and takes
no more memory than they fill; a key at or past it is refused by name, and an index image is loaded
only by an index of the same keys."""
from __future__ import annotations

import os
import struct

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, crc32c, rows_for


def put_tagged(store: KVStore, model: dict, keys: torch.Tensor, tag: int) -> None:
    store.put(keys, rows_for(keys, tag))
    model.update(zip(keys.tolist(), rows_for(keys, tag)))


def delete_model(store: KVStore, model: dict, keys: torch.Tensor) -> None:
    store.delete(keys)
    for k in keys.tolist():
        model.pop(k, None)


@pytest.mark.parametrize("key_limit", [1, 2, 3, 8, 1000, 3000])
@pytest.mark.parametrize("index_budget", [0, 64])
def test_a_key_limited_store_holds_what_a_dict_holds(tmp_path, key_limit, index_budget):
    """Writes, deletions, merges into base runs (a 64-byte index budget: 4 keys), compactions and
    reopens, at key widths from 1 bit (the mix without its shifts) to 12."""
    path = str(tmp_path / "store")
    options = dict(SMALL_OPTIONS, key_limit=key_limit, index_budget_bytes=index_budget, compaction_ratio=1.5)
    g = torch.Generator().manual_seed(key_limit)
    model = {}
    with KVStore(path, DIM, **options) as store:
        put_tagged(store, model, torch.arange(key_limit), 0)  # every key the index can hold
        assert_store_equals(store, model)
        for tag in range(1, 6):
            put_tagged(store, model, torch.randint(0, key_limit, (3 * key_limit,), generator=g).unique(), tag)
            delete_model(store, model, torch.randint(0, key_limit, (max(1, key_limit // 3),), generator=g).unique())
            assert_store_equals(store, model)
        store.compact()
        assert_store_equals(store, model)
    with KVStore(path, DIM, **options) as store:
        assert_store_equals(store, model)
        if index_budget and key_limit >= 1000:  # enough rows to leave the log in memory
            assert store.stats()["base_merges"] + store.stats()["base_runs"] > 0


def test_a_small_tables_index_takes_what_its_keys_fill(tmp_path):
    """Ten rows: a few hundred bytes of index, where keys of any width take its least, 256 KiB."""
    sizes = {}
    for key_limit in (10, 0):
        with KVStore(str(tmp_path / f"store-{key_limit}"), DIM, **dict(SMALL_OPTIONS, expected_rows=0),
                     key_limit=key_limit) as store:
            store.put(torch.arange(10), rows_for(torch.arange(10), 0))
            sizes[key_limit] = store.stats()["index_bytes"]
    assert sizes[10] <= 1024 and sizes[0] >= 256 << 10, sizes


def test_keys_at_or_past_the_limit_are_refused_and_nothing_is_lost(tmp_path):
    path = str(tmp_path / "store")
    model = {}
    with KVStore(path, DIM, **SMALL_OPTIONS, key_limit=100) as store:
        put_tagged(store, model, torch.arange(100), 0)
        calls = [lambda k: store.put(k, rows_for(k, 1)), store.get, store.delete, store.contains, store.lookahead]
        for call in calls:
            for key in (100, 1 << 40, -1):
                with pytest.raises(ValueError, match=r"keys must be (in \[0, 100\)|non-negative)"):
                    call(torch.tensor([5, key]))
        assert_store_equals(store, model)
    with pytest.raises(ValueError, match="key_limit must be non-negative"):
        KVStore(str(tmp_path / "other"), DIM, **SMALL_OPTIONS, key_limit=-1)


def _store_with_an_index_image(path: str, key_limit: int) -> dict:
    """A store whose latest checkpoint has an index image (a log large beside it)."""
    options = dict(memory_budget_bytes=256 << 10, expected_rows=1 << 14, segment_bytes=1 << 20,
                   cut_checkpoints=True, key_limit=key_limit)
    model = {}
    g = torch.Generator().manual_seed(1)
    with KVStore(path, DIM, **options) as store:
        for tag in range(6):
            put_tagged(store, model, torch.randint(0, 40000, (12000,), generator=g).unique(), tag)
        delete_model(store, model, torch.arange(0, 40000, 7))
        store.checkpoint()
    assert any(name.startswith("index-") for name in os.listdir(path))
    return model


def test_the_index_image_loads_only_into_an_index_of_the_same_keys(tmp_path):
    """The image places keys by their hash of key_limit's width: a reopen with another width scans
    the log instead (the rows are the same), and one whose limit is below keys the log holds is
    refused by name."""
    path = str(tmp_path / "store")
    model = _store_with_an_index_image(path, 40000)
    options = dict(memory_budget_bytes=256 << 10, segment_bytes=1 << 20, cut_checkpoints=True)
    for key_limit, from_image in ((40000, True), (65536, True), (70000, False), (0, False), (40000, True)):
        with KVStore(path, DIM, **options, key_limit=key_limit) as store:
            assert store.stats()["recovered_from_index_image"] == from_image, key_limit
            assert_store_equals(store, model)
    with pytest.raises(ValueError, match=r"holds key \d+, but keys must be in \[0, 30000\).*key_limit it was written"):
        KVStore(path, DIM, **options, key_limit=30000)


def test_an_index_image_of_version_1_still_loads(tmp_path):
    """Images written before keys had a limit (a 64-byte header, 63-bit keys) load as they are."""
    path = str(tmp_path / "store")
    model = _store_with_an_index_image(path, 0)
    (name,) = [name for name in os.listdir(path) if name.startswith("index-")]
    image = open(os.path.join(path, name), "rb").read()
    assert struct.unpack_from("<I", image, 8)[0] == 2 and struct.unpack_from("<Q", image, 64)[0] == 63
    words, regions = image[16:64], image[72:]  # sequence .. flushed, then the index's regions
    with open(os.path.join(path, name), "wb") as f:
        f.write(image[:8] + struct.pack("<II", 1, crc32c(words + regions)) + words + regions)
    options = dict(memory_budget_bytes=256 << 10, segment_bytes=1 << 20, cut_checkpoints=True)
    with KVStore(path, DIM, **options) as store:
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
