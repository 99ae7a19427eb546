"""A store opened read-only: a checkpoint read as it is (the latest or the committed one kept
beside it) without one byte of its directory changing, its writes refused by name, and the path
shared by readers but never with a writer."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, rows_for

OPTIONS = dict(SMALL_OPTIONS, cut_checkpoints=True, index_budget_bytes=8 << 10, key_limit=6000)


def directory_state(path: str) -> dict:
    """Every file's name, size, modification time and contents' digest."""
    state = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        with open(full, "rb") as f:
            state[name] = (os.stat(full).st_size, os.stat(full).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return state


def put_tagged(store: KVStore, model: dict, keys: torch.Tensor, tag: int) -> None:
    store.put(keys, rows_for(keys, tag))
    model.update(zip(keys.tolist(), rows_for(keys, tag)))


def two_checkpoints(path: str) -> tuple:
    """A store whose committed checkpoint is kept beside a later one, with rows in base runs, in
    segments and in the last checkpoint's snapshot, and a deletion: (first, its model, latest, its model)."""
    model = {}
    g = torch.Generator().manual_seed(3)
    with KVStore(path, DIM, **OPTIONS) as store:
        for tag in range(4):
            put_tagged(store, model, torch.randint(0, 6000, (1500,), generator=g).unique(), tag)
        first = store.checkpoint()
        store.commit_checkpoint(first)
        at_first = dict(model)
        put_tagged(store, model, torch.randint(0, 6000, (800,), generator=g).unique(), 9)
        store.delete(torch.arange(0, 6000, 5))
        for key in range(0, 6000, 5):
            model.pop(key, None)
        latest = store.checkpoint()
        assert store.stats()["base_runs"] > 0 and first != latest
    return first, at_first, latest, model


def test_a_read_only_open_reads_either_checkpoint_and_changes_nothing(tmp_path):
    path = str(tmp_path / "store")
    first, at_first, latest, model = two_checkpoints(path)
    open(os.path.join(path, "CHECKPOINT.tmp"), "wb").close()  # a leftover a writable open removes
    before = directory_state(path)
    for checkpoint, expected in ((first, at_first), (latest, model), (None, model), (first, at_first)):
        with KVStore(path, DIM, **OPTIONS, checkpoint=checkpoint, read_only=True) as store:
            assert_store_equals(store, expected)
            scanned = {}
            for keys, values in store.scan(chunk_rows=1000):
                scanned.update(zip(keys.tolist(), values))
            assert sorted(scanned) == sorted(expected)
            assert all(torch.equal(scanned[k], v) for k, v in expected.items())
        assert directory_state(path) == before, checkpoint
    # The writer that opens it after the readers finds both checkpoints: reading discarded nothing.
    with KVStore(path, DIM, **OPTIONS, checkpoint=first) as store:
        assert_store_equals(store, at_first)


def test_rows_read_again_from_disk_are_not_promoted(tmp_path):
    """A writable store copies rows it reads from disk again and again to its log in memory (a
    write); a read-only one does not."""
    path = str(tmp_path / "store")
    options = dict(SMALL_OPTIONS, key_limit=6000)  # no index budget: the rows stay in the log's segments
    with KVStore(path, DIM, **options) as store:
        store.put(torch.arange(6000), rows_for(torch.arange(6000), 0))
    before = directory_state(path)
    promoted = {}
    for read_only in (True, False):
        with KVStore(path, DIM, **options, read_only=read_only) as store:
            for _ in range(3):
                store.get(torch.arange(0, 600, 2))
            store.flush()
            promoted[read_only] = store.stats()["promoted_rows"]
        if read_only:
            assert directory_state(path) == before
    assert promoted[True] == 0 and promoted[False] > 0, promoted


def test_writes_to_a_read_only_store_are_refused_by_name(tmp_path):
    path = str(tmp_path / "store")
    _, _, latest, model = two_checkpoints(path)
    before = directory_state(path)
    with KVStore(path, DIM, **OPTIONS, read_only=True) as store:
        keys = torch.tensor([1, 2])
        writes = {"put": lambda: store.put(keys, rows_for(keys, 5)), "delete": lambda: store.delete(keys),
                  "lookahead": lambda: store.lookahead(keys), "compact": store.compact,
                  "checkpoint": store.checkpoint, "commit_checkpoint": lambda: store.commit_checkpoint(latest)}
        for name, write in writes.items():
            with pytest.raises(ValueError, match=f"is open read-only: {name} refused"):
                write()
        assert_store_equals(store, model)
    assert directory_state(path) == before


def test_readers_share_a_store_but_never_with_a_writer(tmp_path):
    path = str(tmp_path / "store")
    _, _, _, model = two_checkpoints(path)
    with KVStore(path, DIM, **OPTIONS, read_only=True) as one, KVStore(path, DIM, **OPTIONS, read_only=True) as two:
        assert_store_equals(one, model)
        assert_store_equals(two, model)
        with pytest.raises(ValueError, match="is already open"):
            KVStore(path, DIM, **OPTIONS)
    with KVStore(path, DIM, **OPTIONS) as writer:
        with pytest.raises(ValueError, match="is open for writing"):
            KVStore(path, DIM, **OPTIONS, read_only=True)
        assert_store_equals(writer, model)


def test_a_read_only_open_of_no_store_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"no store at .*missing \(no CHECKPOINT file\) to open read-only"):
        KVStore(str(missing), DIM, **OPTIONS, read_only=True)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no CHECKPOINT file"):
        KVStore(str(empty), DIM, **OPTIONS, read_only=True)
    assert os.listdir(empty) == []


def test_a_copied_store_without_its_lock_file_opens_read_only(tmp_path):
    path = str(tmp_path / "store")
    _, _, _, model = two_checkpoints(path)
    os.remove(os.path.join(path, "LOCK"))
    with KVStore(path, DIM, **OPTIONS, read_only=True) as store:
        assert_store_equals(store, model)
    assert not os.path.exists(os.path.join(path, "LOCK"))
