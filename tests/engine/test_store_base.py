"""The store's base run: with an index budget, the log's keys move into a file of rows sorted by key
once the index outgrows its budget, so the store's memory stays bounded whatever it holds.

Each test checks the store against a dict (the model), and what the budget promises: the index's
bytes, a get of a row in the base run costing one block read, the count of rows kept exact across
the log and the run, deletions of base rows that survive merges and reopens, and damaged or missing
run files refused by name.
"""
from __future__ import annotations

import os
import struct

import pytest
import torch

from mlkv_torch import CorruptionError, KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, crc32c, rows_for

BUDGET = 32 << 10  # bytes of index: 2048 keys at the 16 bytes a key is charged
BASE = dict(SMALL_OPTIONS, index_budget_bytes=BUDGET)


def put_model(store: KVStore, model: dict, keys: torch.Tensor, tag: int) -> None:
    store.put(keys, rows_for(keys, tag))
    model.update(zip(keys.tolist(), rows_for(keys, tag)))


def scanned(store: KVStore) -> dict:
    rows = {}
    for keys, values in store.scan(chunk_rows=700):
        for key, row in zip(keys.tolist(), values):
            assert key not in rows, f"scan gave key {key} twice"
            rows[key] = row
    return rows


def test_rows_move_into_the_base_run_and_read_back_as_written(tmp_path):
    path = str(tmp_path / "store")
    model, g = {}, torch.Generator().manual_seed(0)
    with KVStore(path, DIM, **BASE) as store:
        for step in range(30):
            put_model(store, model, torch.randint(0, 20_000, (700,), generator=g), step)
            gone = torch.randint(0, 20_000, (60,), generator=g)
            assert store.delete(gone) == len(set(gone.tolist()) & set(model))
            for key in gone.tolist():
                model.pop(key, None)
        stats = store.stats()
        assert stats["base_merges"] > 0 and stats["base_rows"] > 0
        assert_store_equals(store, model)
        absent = torch.tensor(sorted(set(range(20_000)) - set(model))[:500])
        assert not store.contains(absent).any() and not store.lookup(absent)[1].any()
        scan = scanned(store)
        assert scan.keys() == model.keys() and all(torch.equal(scan[k], model[k]) for k in model)
    with KVStore(path, DIM, **BASE) as store:  # the checkpoint names the run
        assert_store_equals(store, model)
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:  # opened without a budget, the run still serves
        assert_store_equals(store, model)
        put_model(store, model, torch.arange(100), 99)
        assert store.delete(torch.arange(100, 300)) == sum(k in model for k in range(100, 300))
        for key in range(100, 300):
            model.pop(key, None)
        assert_store_equals(store, model)


def test_the_index_stays_within_its_budget_however_many_rows(tmp_path):
    budget = 1 << 20
    opened = []
    for index_budget in (0, budget):
        store = KVStore(str(tmp_path / f"store-{index_budget}"), DIM, **dict(SMALL_OPTIONS, expected_rows=0,
                                                                           index_budget_bytes=index_budget))
        opened.append(store)
        most = 0
        for start in range(0, 300_000, 20_000):
            keys = torch.arange(start, start + 20_000)
            store.put(keys, rows_for(keys, 1))
            most = max(most, store.stats()["index_bytes"])
        assert len(store) == 300_000
        sample = torch.randint(0, 300_000, (2000,), generator=torch.Generator().manual_seed(1))
        assert torch.equal(store.get(sample), rows_for(sample, 1))
        if index_budget:
            assert most <= 2 * budget + (256 << 10), most  # at most twice over before writers wait
            assert store.stats()["base_rows"] >= 300_000 - 2 * (budget // 16)  # the log: at most twice its keys
        else:
            assert most > 4 << 20, most  # every key in memory: what the budget saves
    for store in opened:
        store.close()


def test_a_row_of_the_base_run_costs_one_block_read(tmp_path):
    with KVStore(str(tmp_path / "store"), DIM, **dict(BASE, promote_hot_reads=False)) as store:
        keys = torch.arange(50_000)
        store.put(keys, rows_for(keys, 1))
        store.compact()  # every written row into the run but those of the log's pages in memory
        assert store.stats()["base_rows"] > 45_000
        picks = torch.randperm(45_000, generator=torch.Generator().manual_seed(2))[:300]
        before = store.stats()
        assert torch.equal(store.get(picks), rows_for(picks, 1))
        after = store.stats()
        # Rows sharing a block are read once: at most one read a row, never two.
        assert 0 < after["base_reads"] - before["base_reads"] <= 300


def test_a_table_written_in_full_counts_its_rows_without_reading(tmp_path):
    model = {}
    with KVStore(str(tmp_path / "store"), DIM, **BASE) as store:
        put_model(store, model, torch.arange(40_000), 1)
        store.compact()
        put_model(store, model, torch.arange(0, 40_000, 37), 2)  # newer rows of keys the run holds
        put_model(store, model, torch.arange(40_000, 40_500), 3)  # keys it does not
        store.delete(torch.arange(100, 400))
        for key in range(100, 400):
            model.pop(key, None)
        reads = store.stats()["disk_reads"]
        assert len(store) == len(model)
        assert store.stats()["disk_reads"] == reads  # the run's keys have no gap: its fences tell


def test_deleted_base_rows_stay_deleted_through_merges_and_reopens(tmp_path):
    path = str(tmp_path / "store")
    model = {}
    with KVStore(path, DIM, **BASE) as store:
        put_model(store, model, torch.arange(10_000), 1)
        store.compact()
        assert store.delete(torch.arange(0, 10_000, 3)) == len(range(0, 10_000, 3))
        for key in range(0, 10_000, 3):
            del model[key]
        assert_store_equals(store, model)
    with KVStore(path, DIM, **BASE) as store:  # the deletions are replayed over the run
        assert_store_equals(store, model)
        store.compact()  # the deletions drop the run's rows (but those of the log's pages in memory)
        assert store.stats()["base_rows"] < 10_000 - 2500
        assert_store_equals(store, model)
        put_model(store, model, torch.arange(0, 30, 3), 5)  # deleted keys written again
        assert_store_equals(store, model)
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)


def test_the_committed_cut_keeps_its_base_run(tmp_path):
    path = str(tmp_path / "store")
    cuts = dict(BASE, cut_checkpoints=True)
    with KVStore(path, DIM, **cuts) as store:
        store.put(torch.arange(5000), rows_for(torch.arange(5000), 1))
        store.compact()
        committed = store.checkpoint()
        store.commit_checkpoint(committed)
        for tag in range(2, 6):  # later merges replace the run; the committed cut still names its own
            store.put(torch.arange(5000), rows_for(torch.arange(5000), tag))
            store.compact()
        store.checkpoint()
    with KVStore(path, DIM, **cuts, checkpoint=committed) as store:
        assert_store_equals(store, dict(zip(range(5000), rows_for(torch.arange(5000), 1))))


def run_files(path: str) -> list:
    """The store's run files, oldest first."""
    return sorted(name for name in os.listdir(path) if name.startswith("run-"))


def first_run(path: str) -> str:
    """The run holding the smallest keys (runs are numbered as they were written)."""
    return os.path.join(path, run_files(path)[0])


def test_rows_written_in_key_order_are_copied_a_few_times_not_once_a_merge(tmp_path):
    path = str(tmp_path / "store")
    model = {}
    rows = 120_000
    with KVStore(path, DIM, **BASE) as store:
        for start in range(0, rows, 10_000):  # a table filled front to back, as populate() does
            put_model(store, model, torch.arange(start, start + 10_000), 2)
        store.compact()
        stats = store.stats()
        # Each merge adds a run (joined with runs of its size now and then): rows are copied about
        # once a level, where rewriting the run each merge would copy them once a merge.
        merges = stats["base_merges"]
        assert merges > 8 and 1 < stats["base_runs"] <= 12
        assert stats["base_rows_written"] <= 3 * rows < merges * rows / 2
        assert_store_equals(store, model)
        before = store.stats()
        put_model(store, model, torch.arange(5, 60_000, 7), 3)  # rows among the old ones: an overlay
        store.compact()
        after = store.stats()
        assert after["base_overlays"] >= 1 and after["base_rows"] == rows
        # The overlay holds the moved rows alone: the bottom's 120,000 are not rewritten.
        assert after["base_rows_written"] - before["base_rows_written"] <= 2 * len(range(5, 60_000, 7))
        assert_store_equals(store, model)
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)


def test_random_writes_go_to_overlays_until_they_fill_then_one_bottom_run(tmp_path):
    path = str(tmp_path / "store")
    model, g = {}, torch.Generator().manual_seed(3)
    rows = 40_000
    with KVStore(path, DIM, **BASE) as store:
        put_model(store, model, torch.arange(rows), 1)  # a table written in full
        store.compact()
        bottom = store.stats()["base_rows_written"]
        most_overlays, rewritten = 0, False
        for step in range(40):
            put_model(store, model, torch.randint(0, rows + 5000, (1500,), generator=g), step + 2)
            gone = torch.randint(0, rows + 5000, (100,), generator=g)
            assert store.delete(gone) == len(set(gone.tolist()) & set(model))
            for key in gone.tolist():
                model.pop(key, None)
            stats = store.stats()
            most_overlays = max(most_overlays, stats["base_overlays"])
            rewritten = rewritten or (stats["base_overlays"] == 0 and stats["base_merges"] > 3)
            assert len(store) == len(model)
        stats = store.stats()
        # Overlays took the merges (a few of them, joined as they grew) until they held a quarter of
        # the rows; then one run of every row: far fewer rows written than a rewrite per merge.
        assert 1 <= most_overlays <= 8 and rewritten
        assert stats["base_rows_written"] - bottom < stats["base_merges"] * rows / 3
        assert_store_equals(store, model)
        absent = torch.tensor(sorted(set(range(rows + 5000)) - set(model))[:500])
        assert not store.contains(absent).any() and not store.lookup(absent)[1].any()
        scan = scanned(store)
        assert scan.keys() == model.keys() and all(torch.equal(scan[k], model[k]) for k in model)
    with KVStore(path, DIM, **BASE) as store:
        assert len(store) == len(model)
        assert_store_equals(store, model)


def test_a_key_never_written_costs_no_read_but_a_filter_false_yes(tmp_path):
    # Sparse keys (an unpopulated table's first touches): the fences cannot tell an absent key, the
    # bottom's Bloom filter can, but for about one key in 120.
    g = torch.Generator().manual_seed(4)
    keys = torch.unique(torch.randint(0, 1 << 40, (20_000,), generator=g))
    model = {}
    with KVStore(str(tmp_path / "store"), DIM, **dict(BASE, promote_hot_reads=False)) as store:
        put_model(store, model, keys, 1)
        store.compact()
        assert store.stats()["base_rows"] > 0.9 * len(keys)  # (the log keeps its pages in memory)
        absent = torch.randint(0, 1 << 40, (5000,), generator=g)
        absent = absent[~torch.isin(absent, keys)]
        before = store.stats()["base_reads"]
        assert not store.lookup(absent)[1].any() and not store.contains(absent).any()
        assert store.stats()["base_reads"] - before < 0.03 * 2 * len(absent)
        before = store.stats()["base_reads"]
        put_model(store, model, keys[:500], 2)  # log keys the base holds: stats() counts them unread
        after = store.stats()
        assert after["base_reads"] == before and after["rows"] == len(model) == len(store)
        assert_store_equals(store, model)


def a_closed_store_with_runs(tmp_path) -> str:
    """The path of a closed store whose 5000 rows are in base runs."""
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **BASE) as store:
        store.put(torch.arange(5000), rows_for(torch.arange(5000), 1))
        store.compact()
    return path


ROW_BYTES = 8 + DIM * 4  # a base run's row: int64 key, then the value
ROWS_PER_BLOCK = (4096 - 16) // (ROW_BYTES + 4)  # each with its checksum at the block's end (format 3)


def test_a_damaged_row_of_the_run_is_named_and_not_served(tmp_path):
    path = a_closed_store_with_runs(tmp_path)
    run = first_run(path)
    with open(run, "r+b") as f:  # a byte of block 2's row 3's value
        offset = 2 * 4096 + 16 + 3 * ROW_BYTES + 12
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with KVStore(path, DIM, **BASE) as store:
        intact = torch.tensor([0, 4999, 2 * ROWS_PER_BLOCK + 4])  # the last one in the damaged block
        assert torch.equal(store.get(intact), rows_for(intact, 1))
        with pytest.raises(CorruptionError, match=r"run-.*\.run: block 2 .*checksum"):
            store.get(torch.tensor([2 * ROWS_PER_BLOCK + 3]))


def test_a_missing_or_truncated_run_is_refused_by_name(tmp_path):
    path = a_closed_store_with_runs(tmp_path)
    run = first_run(path)
    os.truncate(run, os.path.getsize(run) - 100)
    with pytest.raises(CorruptionError, match=r"run-\d+\.run"):
        KVStore(path, DIM, **BASE)
    os.remove(run)
    with pytest.raises(CorruptionError, match=r"base run .*run-\d+\.run is missing"):
        KVStore(path, DIM, **BASE)
    manifest = next(name for name in os.listdir(path) if name.startswith("base-"))
    os.remove(os.path.join(path, manifest))
    with pytest.raises(CorruptionError, match=r"base manifest .*base-\d+\.runs is missing"):
        KVStore(path, DIM, **BASE)


def test_a_store_written_before_base_runs_opens(tmp_path):
    """A version-1 CHECKPOINT (88 bytes, no base run), as stores made before base runs hold."""
    path = str(tmp_path / "store")
    model = {}
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        put_model(store, model, torch.arange(3000), 1)
    record = open(os.path.join(path, "CHECKPOINT"), "rb").read()
    assert len(record) == 96 and struct.unpack_from("<I", record, 8)[0] == 2
    v1 = bytearray(record[:80] + record[88:92])  # no base field; image_age at 80
    struct.pack_into("<I", v1, 8, 1)
    v1 += struct.pack("<I", crc32c(bytes(v1)))
    with open(os.path.join(path, "CHECKPOINT"), "wb") as f:
        f.write(v1)
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)
        put_model(store, model, torch.arange(3000, 9000), 2)
        store.compact()
        assert store.stats()["base_rows"] > 0
    assert len(open(os.path.join(path, "CHECKPOINT"), "rb").read()) == 96
    with KVStore(path, DIM, **BASE) as store:
        assert_store_equals(store, model)


def to_format_1(path: str) -> None:
    """Rewrites the store's runs and manifests as format 1 (no deletions, no filters, no counts, no
    per-row checksums), as the stores made before overlays hold; their runs must have neither."""
    for name in run_files(path):
        data = open(os.path.join(path, name), "rb").read()
        trailer = data[-64:]
        value_bytes = struct.unpack_from("<I", trailer, 12)[0]
        block_bytes, _, blocks, fence_offset = struct.unpack_from("<QQQQ", trailer, 24)
        assert data[fence_offset:-64][-24:] == bytes(24), "the run holds deletions or a filter"
        row_bytes = 8 + value_bytes
        rows = []
        for b in range(blocks):
            count = struct.unpack_from("<I", data, b * block_bytes + 4)[0]
            start = b * block_bytes + 16
            rows += [data[start + j * row_bytes:start + (j + 1) * row_bytes] for j in range(count)]
        with open(os.path.join(path, name), "wb") as f:
            f.write(format_1_run(rows, row_bytes, trailer))
    for name in (n for n in os.listdir(path) if n.startswith("base-")):
        data = open(os.path.join(path, name), "rb").read()
        runs, generation, overlays = struct.unpack_from("<IQ", data, 12) + struct.unpack_from("<I", data, 28)
        assert overlays == 0
        ids = data[48:]
        header = bytearray(data[:32])
        struct.pack_into("<I", header, 8, 1)
        struct.pack_into("<I", header, 24, crc32c(bytes(header[:24]) + ids))
        struct.pack_into("<I", header, 28, 0)
        with open(os.path.join(path, name), "wb") as f:
            f.write(bytes(header) + ids)


def format_1_run(rows: list, row_bytes: int, trailer: bytes) -> bytes:
    """A run file of format 1 holding `rows` (key, then value; in key order): blocks whose checksum
    is the block's alone, as many rows a block as fit, fences, their gapless bits and the last key."""
    block_bytes = (16 + row_bytes + 4095) // 4096 * 4096
    per_block = (block_bytes - 16) // row_bytes
    keys = [struct.unpack_from("<q", row)[0] for row in rows]
    out, fences, gapless = bytearray(), [], []
    for index, first in enumerate(range(0, len(rows), per_block)):
        body = struct.pack("<IQ", len(rows[first:first + per_block]), index) + b"".join(rows[first:first + per_block])
        body += bytes(block_bytes - 4 - len(body))
        out += struct.pack("<I", crc32c(body)) + body
        fences.append(keys[first])
        block_keys = keys[first:first + per_block + 1]  # and the next block's first
        gapless.append(all(b == a + 1 for a, b in zip(block_keys, block_keys[1:])))
    words = [sum(1 << (i % 64) for i in range(w * 64, min(len(gapless), w * 64 + 64)) if gapless[i])
             for w in range((len(gapless) + 63) // 64)]
    section = struct.pack(f"<{len(fences)}q{len(words)}Qq", *fences, *words, keys[-1])
    v1 = bytearray(trailer)
    struct.pack_into("<I", v1, 8, 1)
    struct.pack_into("<QQQQ", v1, 24, block_bytes, len(rows), len(fences), len(out))
    struct.pack_into("<I", v1, 56, crc32c(section))
    struct.pack_into("<I", v1, 60, crc32c(bytes(v1[:60])))
    return bytes(out + section + v1)


def test_runs_and_manifests_of_format_1_open_and_merge_on(tmp_path):
    path = str(tmp_path / "store")
    model = {}
    with KVStore(path, DIM, **BASE) as store:
        for start in range(0, 8000, 2000):  # key order: bottom runs alone, written in full (no filters)
            put_model(store, model, torch.arange(start, start + 2000), 1)
        store.compact()
        assert store.stats()["base_overlays"] == 0 and store.stats()["base_rows"] > 0
    to_format_1(path)
    with KVStore(path, DIM, **BASE) as store:
        assert len(store) == len(model)
        assert_store_equals(store, model)
        put_model(store, model, torch.arange(3, 8000, 5), 2)  # among the old rows: an overlay of format 2
        store.delete(torch.arange(0, 8000, 11))
        for key in range(0, 8000, 11):
            model.pop(key, None)
        store.compact()
        assert_store_equals(store, model)
    with KVStore(path, DIM, **BASE) as store:
        assert len(store) == len(model)
        assert_store_equals(store, model)
