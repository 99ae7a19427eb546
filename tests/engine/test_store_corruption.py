"""Flipped bytes and truncated files are detected, named, and never made worse.

Layout used to find records (docs: records are packed record_bytes apart inside
4 KiB blocks, never straddling one; pages are page_bytes; a segment file holds
segment_bytes / page_bytes whole pages). With dim 8 float32 a record is 48
bytes, 85 to a block; the SMALL options give one-block pages and 4-page
segments. A fresh store written with keys 0..N-1 in one put holds key k at slot k.
"""
from __future__ import annotations

import os

import pytest
import torch

import mlkv_torch
from mlkv_torch import CorruptionError, KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, directory_bytes, rows_for

N = 3000
OPTIONS = dict(SMALL_OPTIONS, compaction_ratio=0)
BLOCK = 4096


def record_location(stats, slot):
    """(segment file name, byte offset of the record) of a slot."""
    page_bytes, record_bytes = stats["page_bytes"], stats["record_bytes"]
    per_block = BLOCK // record_bytes
    per_page = page_bytes // BLOCK * per_block
    pages_per_segment = OPTIONS["segment_bytes"] // page_bytes
    page, in_page = divmod(slot, per_page)
    segment, page_in_segment = divmod(page, pages_per_segment)
    offset = page_in_segment * page_bytes + (in_page // per_block) * BLOCK + (in_page % per_block) * record_bytes
    return f"segment-{segment:010d}.log", offset


def flip(path, offset, mask=0x20):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        assert byte, f"offset {offset} is past the end of {path}"
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def build(path, close=True):
    """N rows, key k at slot k; returns (store or None, model, stats)."""
    store = KVStore(path, DIM, **OPTIONS)
    store.put(torch.arange(N), rows_for(torch.arange(N), 0))
    stats = store.stats()
    assert stats["head_address"] > 1000  # keys below are on disk only
    model = dict(zip(range(N), rows_for(torch.arange(N), 0)))
    if close:
        store.close()
        return None, model, stats
    return store, model, stats


def snapshot_name(path):
    names = [n for n in os.listdir(path) if n.startswith("snapshot-")]
    assert len(names) == 1, names
    return names[0]


def reopen_fails(path, file_name):
    """Reopening raises CorruptionError naming file_name and leaves every file as it was."""
    before = directory_bytes(path)
    with pytest.raises(CorruptionError) as info:
        KVStore(path, DIM, **OPTIONS)
    assert file_name in str(info.value), str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert directory_bytes(path) == before, "a failed open rewrote files"
    return info.value


# --- segment files -------------------------------------------------------


@pytest.mark.parametrize("field,offset_in_record", [("key", 0), ("key", 7), ("checksum", 9), ("magic", 12),
                                                    ("flags", 14), ("value", 16), ("value", 47)])
def test_flipped_byte_in_segment_detected_on_reopen(tmp_path, field, offset_in_record):
    path = str(tmp_path / "store")
    _, model, stats = build(path)
    name, offset = record_location(stats, 41)
    assert name == "segment-0000000000.log"
    flip(os.path.join(path, name), offset + offset_in_record)
    reopen_fails(path, name)
    # Repairing the byte makes the store open again with everything in it.
    flip(os.path.join(path, name), offset + offset_in_record)
    with KVStore(path, DIM, **OPTIONS) as store:
        assert_store_equals(store, model)


def test_flipped_byte_in_newer_segment_detected(tmp_path):
    path = str(tmp_path / "store")
    _, _, stats = build(path)
    name, offset = record_location(stats, 1000)
    assert name != "segment-0000000000.log"
    flip(os.path.join(path, name), offset + 20)
    reopen_fails(path, name)


def test_flipped_byte_in_superseded_record_detected(tmp_path):
    path = str(tmp_path / "store")
    store, _, stats = build(path, close=False)
    store.put(torch.tensor([41]), rows_for(torch.tensor([41]), 5))  # slot 41 is now garbage
    store.close()
    name, offset = record_location(stats, 41)
    flip(os.path.join(path, name), offset + 30)
    reopen_fails(path, name)


@pytest.mark.parametrize("size", [0, 100, BLOCK, BLOCK + 100, 2 * BLOCK, 4 * BLOCK - 1])
def test_truncated_segment_detected(tmp_path, size):
    path = str(tmp_path / "store")
    build(path)
    name = "segment-0000000001.log"
    assert os.path.getsize(os.path.join(path, name)) == 4 * BLOCK
    os.truncate(os.path.join(path, name), size)
    reopen_fails(path, name)


def test_missing_segment_detected(tmp_path):
    path = str(tmp_path / "store")
    build(path)
    os.unlink(os.path.join(path, "segment-0000000002.log"))
    reopen_fails(path, "segment-0000000002.log")


# --- CHECKPOINT ----------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 7, 8, 12, 16, 24, 40, 56, 72, 80, 84, 87])
def test_flipped_byte_in_checkpoint_detected(tmp_path, offset):
    path = str(tmp_path / "store")
    _, model, _ = build(path)
    flip(os.path.join(path, "CHECKPOINT"), offset, mask=0x01)
    reopen_fails(path, "CHECKPOINT")
    flip(os.path.join(path, "CHECKPOINT"), offset, mask=0x01)
    with KVStore(path, DIM, **OPTIONS) as store:
        assert_store_equals(store, model)


@pytest.mark.parametrize("size", [0, 40, 87, 89, 200])
def test_checkpoint_of_wrong_size_detected(tmp_path, size):
    path = str(tmp_path / "store")
    build(path)
    meta = os.path.join(path, "CHECKPOINT")
    with open(meta, "rb") as f:
        data = f.read()
    with open(meta, "wb") as f:
        f.write((data + b"\0" * 200)[:size])
    reopen_fails(path, "CHECKPOINT")


# --- snapshot ------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 100, 4000])
def test_flipped_byte_in_snapshot_detected(tmp_path, offset):
    path = str(tmp_path / "store")
    _, _, stats = build(path)
    name = snapshot_name(path)
    # The snapshot starts at the first mutable page; its records up to the tail are live.
    assert stats["tail_address"] - stats["read_only_address"] > 85
    flip(os.path.join(path, name), offset)
    reopen_fails(path, name)


@pytest.mark.parametrize("cut", ["empty", "half", "one byte short"])
def test_truncated_snapshot_detected(tmp_path, cut):
    path = str(tmp_path / "store")
    build(path)
    name = snapshot_name(path)
    full = os.path.getsize(os.path.join(path, name))
    size = {"empty": 0, "half": full // 2, "one byte short": full - 1}[cut]
    os.truncate(os.path.join(path, name), size)
    reopen_fails(path, name)


def test_missing_snapshot_detected(tmp_path):
    path = str(tmp_path / "store")
    build(path)
    name = snapshot_name(path)
    os.unlink(os.path.join(path, name))
    reopen_fails(path, name)


# --- while the store is open ---------------------------------------------


@pytest.mark.parametrize("engine", ["threads", "uring", "pread"])
def test_flipped_byte_detected_by_get_while_open(tmp_path, engine):
    if engine == "uring" and not mlkv_torch._C.uring_available():
        pytest.skip("no io_uring here")
    path = str(tmp_path / "store")
    store = KVStore(path, DIM, **dict(OPTIONS, direct_io=True, io_engine=engine))
    try:
        store.put(torch.arange(N), rows_for(torch.arange(N), 0))
        stats = store.stats()
        assert stats["direct_io"] is True
        name, offset = record_location(stats, 41)
        checkpoint_before = open(os.path.join(path, "CHECKPOINT"), "rb").read()
        flip(os.path.join(path, name), offset + 16 + 5)
        with pytest.raises(CorruptionError, match=name):
            store.get(torch.tensor([41]))
        with pytest.raises(CorruptionError, match=name):
            store.get(torch.tensor([300, 41, 2999]))
        # A row of another block of the same file, and rows in memory, still read.
        assert record_location(stats, 300)[0] == name
        torch.testing.assert_close(store.get(torch.tensor([300, 40 + 85, 2999])),
                                   rows_for(torch.tensor([300, 125, 2999]), 0), rtol=0, atol=0)
        # Another record of the same block is intact too.
        torch.testing.assert_close(store.get(torch.tensor([42])), rows_for(torch.tensor([42]), 0), rtol=0, atol=0)
        # Lookahead meets it in the background and flush reports it.
        store.lookahead(torch.tensor([41]))
        with pytest.raises(CorruptionError, match=name):
            store.flush()
        store.flush()  # reported once
        assert open(os.path.join(path, "CHECKPOINT"), "rb").read() == checkpoint_before
        assert 41 in store and len(store) == N
    finally:
        store.close()
    reopen_fails(path, name)


def test_truncated_segment_detected_by_get_while_open(tmp_path):
    path = str(tmp_path / "store")
    store = KVStore(path, DIM, **dict(OPTIONS, direct_io=True))
    try:
        store.put(torch.arange(N), rows_for(torch.arange(N), 0))
        name, _ = record_location(store.stats(), 500)
        os.truncate(os.path.join(path, name), BLOCK + 100)
        with pytest.raises(CorruptionError, match=name):
            store.get(torch.tensor([500]))
        torch.testing.assert_close(store.get(torch.tensor([0, 2999])), rows_for(torch.tensor([0, 2999]), 0),
                                   rtol=0, atol=0)
    finally:
        store.close()


# Slot 41 is in its segment's first page, 300 in its last: compaction reads a segment's pages in one read.
@pytest.mark.parametrize("slot", [41, 300])
@pytest.mark.parametrize("field,offset_in_record", [("key", 0), ("magic", 12), ("value", 20)])
def test_compact_detects_corrupt_live_record(tmp_path, field, offset_in_record, slot):
    """compact() must not drop a live row whose on-disk record is corrupt.

    It should raise CorruptionError naming the segment and leave the files as
    they were (the store still opens after the byte is repaired).
    """
    path = str(tmp_path / "store")
    store, model, stats = build(path, close=False)
    name, offset = record_location(stats, slot)
    flip(os.path.join(path, name), offset + offset_in_record)
    try:
        with pytest.raises(CorruptionError, match=name):
            store.compact()
        assert os.path.exists(os.path.join(path, name))
    finally:
        store.close()
    flip(os.path.join(path, name), offset + offset_in_record)
    with KVStore(path, DIM, **OPTIONS) as reopened:
        assert_store_equals(reopened, model)
