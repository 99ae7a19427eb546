"""A store's checkpoints as cuts (cut_checkpoints=True): numbered, the one its owner last committed
kept recoverable beside the latest, and never moved by automatic compaction; checked against dicts
after SIGKILLs of real child processes."""
from __future__ import annotations

import os
import shutil
import textwrap

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, rows_for
from test_store_crash import CHILD_PRELUDE, Child

CUTS = dict(SMALL_OPTIONS, cut_checkpoints=True)


def test_checkpoint_numbers_and_going_back_one(tmp_path):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **CUTS) as store:
        first = store.checkpoint()
        store.put(torch.arange(500), rows_for(torch.arange(500), 1))
        one = store.checkpoint()
        assert one == first + 1
        assert store.checkpoint() == one  # nothing changed: the same checkpoint stands
        store.commit_checkpoint(one)  # its owner recorded it: the next one keeps it
        store.put(torch.arange(250, 800), rows_for(torch.arange(250, 800), 2))
        store.delete(torch.arange(0, 10))
        two = store.checkpoint()
        assert two == one + 1
    at_one = {k: v for k, v in zip(range(500), rows_for(torch.arange(500), 1))}
    at_two = dict(at_one)
    at_two.update(zip(range(250, 800), rows_for(torch.arange(250, 800), 2)))
    for k in range(10):
        del at_two[k]
    with KVStore(path, DIM, **CUTS, checkpoint=two) as store:  # close changed nothing: two is the latest
        assert_store_equals(store, at_two)
    with KVStore(path, DIM, **CUTS, checkpoint=one) as store:  # back one: two is discarded
        assert_store_equals(store, at_one)
        store.put(torch.tensor([900]), rows_for(torch.tensor([900]), 3))
        at_one[900] = rows_for(torch.tensor([900]), 3)[0]
    with KVStore(path, DIM, **CUTS) as store:
        assert_store_equals(store, at_one)
    with pytest.raises(ValueError, match=rf"has checkpoints .*not checkpoint {first}"):
        KVStore(path, DIM, **CUTS, checkpoint=first)


def test_a_checkpoint_in_two_halves_holds_the_rows_put_before_it_began(tmp_path):
    """begin_checkpoint fixes the contents and returns; puts go on (in place in the pages it
    copied, and past them, until those pages are flushed to their segments); finish_checkpoint
    makes the contents at begin durable. Reopening at it gives them, not the later puts."""
    path = str(tmp_path / "store")
    keys = torch.arange(300)
    at_begin = dict(zip(keys.tolist(), rows_for(keys, 1)))
    with KVStore(path, DIM, **CUTS) as store:
        store.put(keys, rows_for(keys, 1))
        store.begin_checkpoint()
        for what in ("checkpoint", "begin_checkpoint", "compact"):
            with pytest.raises(ValueError, match=r"is begun and not finished"):
                getattr(store, what)()
        with pytest.raises(ValueError, match=r"is begun and not finished"):
            store.commit_checkpoint(1)
        # After it: the same rows changed (in place: they are in the mutable pages it copied), rows
        # deleted, and enough new rows that every page it copied is flushed to its segment.
        latest = dict(at_begin)
        store.put(keys[:200], rows_for(keys[:200], 2))
        store.delete(keys[200:220])
        more = torch.arange(1000, 3000)
        store.put(more, rows_for(more, 3))
        latest.update(zip(keys[:200].tolist(), rows_for(keys[:200], 2)))
        for k in range(200, 220):
            del latest[k]
        latest.update(zip(more.tolist(), rows_for(more, 3)))
        assert store.stats()["read_only_address"] > 300  # the pages it copied are read-only now
        assert_store_equals(store, latest)  # gets see the puts at once
        sequence = store.finish_checkpoint()
        with pytest.raises(ValueError, match=r"no checkpoint begun to finish"):
            store.finish_checkpoint()
        store.commit_checkpoint(sequence)  # kept beside the one close takes
        assert_store_equals(store, latest)
    with KVStore(path, DIM, **CUTS) as store:  # the checkpoint close took: the latest rows
        assert_store_equals(store, latest)
    with KVStore(path, DIM, **CUTS, checkpoint=sequence) as store:  # back to it (close's goes)
        assert_store_equals(store, at_begin)


def test_close_finishes_a_checkpoint_begun(tmp_path):
    path = str(tmp_path / "store")
    keys = torch.arange(100)
    store = KVStore(path, DIM, **CUTS)
    store.put(keys, rows_for(keys, 1))
    store.begin_checkpoint()
    store.put(keys[:10], rows_for(keys[:10], 2))
    store.close()  # finishes it, then takes its own
    with KVStore(path, DIM, **CUTS) as reopened:
        expected = dict(zip(keys.tolist(), rows_for(keys, 1)))
        expected.update(zip(range(10), rows_for(keys[:10], 2)))
        assert_store_equals(reopened, expected)


def test_uncommitted_checkpoints_replace_each_other_and_the_committed_one_stays(tmp_path):
    """A cut that failed, or was never recorded, leaves its checkpoint uncommitted: the checkpoints
    after it replace it, and the committed one stays recoverable however many follow."""
    path = str(tmp_path / "store")
    at = {}
    with KVStore(path, DIM, **CUTS) as store:
        for tag in (1, 2, 3, 4):
            keys = torch.arange(tag * 100, tag * 100 + 400)
            store.put(keys, rows_for(keys, tag))
            at[tag] = dict(at.get(tag - 1, {}))
            at[tag].update(zip(keys.tolist(), rows_for(keys, tag)))
            at[tag]["sequence"] = store.checkpoint()
            if tag == 1:
                store.commit_checkpoint(at[1]["sequence"])
        with pytest.raises(ValueError, match=rf"cannot commit checkpoint {at[3]['sequence']}: its latest is "
                                             rf"{at[4]['sequence']} and the one it keeps {at[1]['sequence']}"):
            store.commit_checkpoint(at[3]["sequence"])
        store.commit_checkpoint(at[1]["sequence"])  # the one it keeps: committed already
        snapshots = sorted(f for f in os.listdir(path) if f.startswith("snapshot-"))
        assert len(snapshots) <= 2, snapshots  # the replaced ones' files went
    shutil.copytree(path, path + "-copy")  # going back discards the latest: each on its own copy
    for tag, where in ((1, path + "-copy"), (4, path)):
        expected = {k: v for k, v in at[tag].items() if k != "sequence"}
        with KVStore(where, DIM, **CUTS, checkpoint=at[tag]["sequence"]) as store:
            assert_store_equals(store, expected)
            if tag == 4:
                store.commit_checkpoint(at[4]["sequence"])
                store.put(torch.tensor([7]), rows_for(torch.tensor([7]), 9))
                store.checkpoint()  # keeps 4 beside it; 1 goes
    for tag in (2, 3, 1):
        with pytest.raises(ValueError, match=rf"not checkpoint {at[tag]['sequence']} that was asked for"):
            KVStore(path, DIM, **CUTS, checkpoint=at[tag]["sequence"])
    with KVStore(path, DIM, **CUTS, checkpoint=at[4]["sequence"]) as store:
        assert_store_equals(store, {k: v for k, v in at[4].items() if k != "sequence"})


def test_a_plain_store_keeps_only_its_latest_checkpoint(tmp_path):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        store.put(torch.arange(100), rows_for(torch.arange(100), 1))
        one = store.checkpoint()
        store.put(torch.arange(100), rows_for(torch.arange(100), 2))
        store.checkpoint()
    assert "CHECKPOINT.previous" not in os.listdir(path)
    with pytest.raises(ValueError, match=f"not checkpoint {one}"):
        KVStore(path, DIM, **SMALL_OPTIONS, checkpoint=one)
    with pytest.raises(ValueError, match="checkpoint must be a positive int"):
        KVStore(path, DIM, **SMALL_OPTIONS, checkpoint=0)


# Checkpoints A, then overwrites until automatic compaction has run several times, then waits.
CHILD_COMPACTS_AFTER_CUT = CHILD_PRELUDE + textwrap.dedent(
    """
    store = KVStore(path, DIM, **dict(SMALL_OPTIONS, cut_checkpoints=True, compaction_ratio=1.5))
    store.put(torch.arange(1200), rows_for(torch.arange(1200), 1))
    print("CUT", store.checkpoint(), flush=True)
    i = 0
    while store.stats()["compactions"] < 3:
        i += 1
        keys = torch.arange(i % 3 * 400, i % 3 * 400 + 400)
        store.put(keys, rows_for(keys, 100 + i))
    store.flush()
    print("COMPACTED", store.stats()["compactions"], store.stats()["checkpoints"], flush=True)
    sys.stdin.read()
    """
)


def test_automatic_compaction_never_moves_a_cut_store_past_its_checkpoint(tmp_path):
    path = str(tmp_path / "store")
    child = Child(CHILD_COMPACTS_AFTER_CUT, path)
    try:
        cut = int(child.read_line().split()[1])
        compacted = child.read_line().split()
        assert compacted[0] == "COMPACTED" and int(compacted[1]) >= 3
        assert int(compacted[2]) == 2  # the one at creation and the cut: compaction took none
    finally:
        child.kill()
    with KVStore(path, DIM, **CUTS, checkpoint=cut) as store:
        assert_store_equals(store, {k: v for k, v in zip(range(1200), rows_for(torch.arange(1200), 1))})


# Two stores of one model: both at cut 1, then only the first reaches cut 2 before the kill.
CHILD_HALF_A_CUT = CHILD_PRELUDE + textwrap.dedent(
    """
    first = KVStore(path + "/a", DIM, **dict(SMALL_OPTIONS, cut_checkpoints=True))
    second = KVStore(path + "/b", DIM, **dict(SMALL_OPTIONS, cut_checkpoints=True))
    for store, tag in ((first, 1), (second, 2)):
        store.put(torch.arange(700), rows_for(torch.arange(700), tag))
    cut = first.checkpoint(), second.checkpoint()
    for store, sequence in zip((first, second), cut):
        store.commit_checkpoint(sequence)  # the owner recorded the cut
    print(*cut, flush=True)
    for store, tag in ((first, 3), (second, 4)):
        store.put(torch.arange(300, 1000), rows_for(torch.arange(300, 1000), tag))
    print(first.checkpoint(), flush=True)
    sys.stdin.read()
    """
)


def test_a_cut_half_taken_when_killed_goes_back_whole(tmp_path):
    path = str(tmp_path)
    child = Child(CHILD_HALF_A_CUT, path)
    try:
        a1, b1 = (int(x) for x in child.read_line().split())
        a2 = int(child.read_line())
    finally:
        child.kill()
    assert a2 == a1 + 1
    with KVStore(path + "/a", DIM, **CUTS, checkpoint=a1) as a, KVStore(path + "/b", DIM, **CUTS, checkpoint=b1) as b:
        assert_store_equals(a, {k: v for k, v in zip(range(700), rows_for(torch.arange(700), 1))})
        assert_store_equals(b, {k: v for k, v in zip(range(700), rows_for(torch.arange(700), 2))})
    with pytest.raises(ValueError, match=f"not checkpoint {a2}"):  # discarded when the store went back
        KVStore(path + "/a", DIM, **CUTS, checkpoint=a2)


def _scanned(store: KVStore):
    rows = {}
    for keys, values in store.scan(chunk_rows=97):
        for k, v in zip(keys.tolist(), values):
            assert k not in rows, f"key {k} scanned twice at rest"
            rows[k] = v.clone()
    return rows


def test_scan_gives_every_live_row_once_in_log_order(tmp_path):
    """Against a dict: rows on disk and in memory, overwritten in place and by appends, deleted,
    compacted, and after a reopen."""
    path = str(tmp_path / "store")
    model = {}
    with KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=1.5)) as store:
        assert _scanned(store) == {}
        g = torch.Generator().manual_seed(0)
        for tag in range(12):
            keys = torch.randint(0, 3000, (700,), generator=g).unique()
            store.put(keys, rows_for(keys, tag))
            model.update(zip(keys.tolist(), rows_for(keys, tag)))
            gone = torch.randint(0, 3000, (40,), generator=g).unique()
            store.delete(gone)
            for k in gone.tolist():
                model.pop(k, None)
        store.flush()
        assert store.stats()["compactions"] > 0 and store.stats()["head_address"] > 0
        got = _scanned(store)
        assert sorted(got) == sorted(model)
        for k, v in model.items():
            assert torch.equal(got[k], v), k
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        got = _scanned(store)
        assert sorted(got) == sorted(model) and all(torch.equal(got[k], v) for k, v in model.items())
    with pytest.raises(ValueError, match="chunk_rows"):
        next(KVStore(str(tmp_path / "other"), DIM, **SMALL_OPTIONS).scan(0))


def _index_images(path):
    return sorted(name for name in os.listdir(path) if name.startswith("index-"))


def test_reopen_loads_the_index_checkpoint_and_falls_back_to_the_log(tmp_path):
    """A store whose on-disk log outweighs its index checkpoints the index; reopening loads it instead
    of scanning the log. A damaged or missing image costs only time: the log is scanned."""
    path = str(tmp_path / "store")
    options = dict(memory_budget_bytes=256 << 10, expected_rows=1 << 14, segment_bytes=1 << 20, cut_checkpoints=True)
    model = {}
    with KVStore(path, DIM, **options) as store:
        g = torch.Generator().manual_seed(1)
        for tag in range(6):
            keys = torch.randint(0, 40000, (12000,), generator=g).unique()
            store.put(keys, rows_for(keys, tag))
            model.update(zip(keys.tolist(), rows_for(keys, tag)))
        gone = torch.arange(0, 40000, 7)
        store.delete(gone)
        for k in gone.tolist():
            model.pop(k, None)
        cut = store.checkpoint()
    (image,) = _index_images(path)
    assert image == f"index-{cut:010d}.dat"
    with KVStore(path, DIM, **options) as store:
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
    image = os.path.join(path, f"index-{cut:010d}.dat")
    with open(image, "r+b") as f:
        f.seek(os.path.getsize(image) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with KVStore(path, DIM, **options) as store:
        assert not store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
    os.unlink(image)
    with KVStore(path, DIM, **options) as store:
        assert not store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)


def _an_aged_index_image(tmp_path):
    """A store whose latest checkpoint loads an earlier checkpoint's index image and replays the log
    after it: 10,000 rows, then 2,000 of them changed (appended after the image) and checkpointed."""
    path = str(tmp_path / "store")
    options = dict(memory_budget_bytes=1 << 20, page_bytes=4096, mutable_fraction=0.05, expected_rows=1,
                   compaction_ratio=0)
    with KVStore(path, 8, **options) as store:
        store.put(torch.arange(10000), torch.zeros(10000, 8))
        store.checkpoint()
        store.put(torch.arange(2000), torch.ones(2000, 8))
        store.checkpoint()
    (image,) = _index_images(path)
    with KVStore(path, 8, **options) as store:
        assert store.stats()["recovered_from_index_image"]
    return path, options, os.path.join(path, image)


def _with_header_word(image, offset, change):
    with open(image, "r+b") as f:
        f.seek(offset)
        word = int.from_bytes(f.read(8), "little")
        f.seek(offset)
        f.write(change(word).to_bytes(8, "little"))


def _rows_are_the_latest(path, options):
    with KVStore(path, 8, **options) as store:
        assert not store.stats()["recovered_from_index_image"]  # the log was scanned instead
        assert len(store) == 10000
        torch.testing.assert_close(store.get(torch.arange(2000)), torch.ones(2000, 8))
        torch.testing.assert_close(store.get(torch.arange(2000, 10000)), torch.zeros(8000, 8))


def test_a_flipped_bit_in_where_an_index_images_replay_starts_is_caught(tmp_path):
    # Bytes 56-63 of the header: the slot the replay starts at, once outside the image's checksum,
    # so a later start (still inside the log) skipped the changed rows and read back old ones.
    path, options, image = _an_aged_index_image(tmp_path)
    _with_header_word(image, 56, lambda flushed: flushed ^ 1024)
    _rows_are_the_latest(path, options)


def test_a_damaged_count_in_an_index_image_is_caught_before_it_is_allocated(tmp_path):
    # Bytes 32-39: the bucket count, once allocated (MemoryError, or worse) before the checksum was read.
    path, options, image = _an_aged_index_image(tmp_path)
    _with_header_word(image, 32, lambda buckets: buckets | (1 << 39))
    _rows_are_the_latest(path, options)


def _put(store, model, keys, tag):
    store.put(keys, rows_for(keys, tag))
    model.update(zip(keys.tolist(), rows_for(keys, tag)))


def test_checkpoints_name_the_latest_index_image_and_recovery_replays_the_log_after_it(tmp_path):
    """A checkpoint writes a new index image only once the log written since the last one outgrows an
    image; until then it names the last, and recovery replays the log after it over it. Checked
    against a dict through the cases that replay must see: rows updated and deleted in place in the
    pages that were mutable when the image was taken, rows appended, a compaction that moved rows
    out of segments the image names, going back to the previous checkpoint, a damaged image."""
    path = str(tmp_path / "store")
    options = dict(memory_budget_bytes=256 << 10, expected_rows=1 << 14, segment_bytes=1 << 20, cut_checkpoints=True,
                   compaction_ratio=0)
    model = {}
    g = torch.Generator().manual_seed(2)
    with KVStore(path, DIM, **options) as store:
        for tag in range(10):  # a log of mostly dead rows (a compaction copies few): 2000 live, 8000 per round
            _put(store, model, torch.arange(2000), tag)
            filler = torch.arange(100000, 106000)
            store.put(filler, rows_for(filler, tag))
            store.delete(filler)
        _put(store, model, torch.arange(3000, 3010), 10)
        first = store.checkpoint()
        assert _index_images(path) == [f"index-{first:010d}.dat"]
        # Rows of the pages still mutable when the image was taken: updated and deleted in place.
        assert store.stats()["read_only_address"] < store.stats()["tail_address"] - 10
        _put(store, model, torch.arange(3000, 3005), 40)
        store.delete(torch.arange(3005, 3010))
        for k in range(3005, 3010):
            del model[k]
        _put(store, model, torch.arange(50000, 50100), 41)  # appended
        second = store.checkpoint()
        assert _index_images(path) == [f"index-{first:010d}.dat"]  # a small log since the image: it stands
    with KVStore(path, DIM, **options) as store:
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
        store.compact()  # every live row the image names in a segment moves to the tail
        third = store.checkpoint()
        assert third > second and store.stats()["begin_address"] > 0
        assert _index_images(path) == [f"index-{first:010d}.dat"]  # the copies weigh less than an image
    at_third = dict(model)
    with KVStore(path, DIM, **options) as store:
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
        for tag in range(60, 64):  # the log outgrows the image: the next checkpoint writes one
            _put(store, model, torch.randint(0, 40000, (12000,), generator=g).unique(), tag)
        fourth = store.checkpoint()
    assert _index_images(path) == [f"index-{first:010d}.dat", f"index-{fourth:010d}.dat"]  # both kept checkpoints'
    with KVStore(path, DIM, **options) as store:
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, model)
    with KVStore(path, DIM, **options, checkpoint=third) as store:  # back one, through its older image
        assert store.stats()["recovered_from_index_image"]
        assert_store_equals(store, at_third)
    assert _index_images(path) == [f"index-{first:010d}.dat"]  # the discarded checkpoint's image went
    image = os.path.join(path, f"index-{first:010d}.dat")
    with open(image, "r+b") as f:
        f.seek(72)  # past the header: its first buckets
        f.write(b"\xff" * 16)
    with KVStore(path, DIM, **options) as store:
        assert not store.stats()["recovered_from_index_image"]
        assert_store_equals(store, at_third)


def test_an_index_image_is_not_named_again_once_compaction_passes_it(tmp_path):
    """Rows deleted in place after an index image was taken (in the pages then mutable) leave their
    tombstones only there; once a compaction drops those pages' segments, that image would bring
    the rows back: the next checkpoint must write its own. Small pages and segments, so the log
    since the image stays smaller than an image while the compaction passes it."""
    path = str(tmp_path / "store")
    options = dict(memory_budget_bytes=32 << 10, expected_rows=1024, segment_bytes=16 << 10, compaction_ratio=0)
    model = {}
    filler = torch.arange(100000, 100300)
    with KVStore(path, DIM, **options) as store:
        for tag in range(12):  # 7200 records, 300 live
            _put(store, model, torch.arange(300), tag)
            store.put(filler, rows_for(filler, tag))
            store.delete(filler)
        first = store.checkpoint()
        assert _index_images(path) == [f"index-{first:010d}.dat"]
        image_at = store.stats()["read_only_address"]
        gone = torch.arange(250, 300)  # the newest hot rows: still in the mutable pages, deleted in place
        store.delete(gone)
        for k in gone.tolist():
            del model[k]
        _put(store, model, torch.arange(5000, 6000), 30)  # the tombstones' pages go to disk
        store.compact()
        assert store.stats()["begin_address"] > image_at + 300  # past the tombstones
        store.checkpoint()
    with KVStore(path, DIM, **options) as store:
        assert_store_equals(store, model)


def test_a_checkpoint_begun_while_compaction_runs_never_deadlocks(tmp_path):
    """Without cut_checkpoints a compaction ends with a checkpoint of its own; while the owner's is
    begun it takes none (the owner's puts may stall for that compaction, and close flushes it), so
    puts that keep compacting and a close with the checkpoint unfinished both return."""
    import subprocess
    import sys

    child = textwrap.dedent(f"""
        import torch
        from mlkv_torch import KVStore
        store = KVStore({str(tmp_path / "store")!r}, 8, memory_budget_bytes=32 << 10, segment_bytes=16 << 10,
                        expected_rows=1024, compaction_ratio=1.5)
        keys = torch.arange(4000)  # far more than memory holds: overwrites append
        store.put(keys, torch.zeros(4000, 8))
        store.begin_checkpoint()
        for round_ in range(20):  # the log outgrows 1.5x the live rows again and again
            store.put(keys, torch.full((4000, 8), float(round_)))
        compactions = store.stats()["compactions"]
        store.close()
        reopened = KVStore({str(tmp_path / "store")!r}, 8, memory_budget_bytes=32 << 10, segment_bytes=16 << 10,
                           expected_rows=1024)
        assert bool((reopened.get(keys) == 19).all())
        print("COMPACTIONS", compactions)
        """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0, done.stdout  # compactions ran while it was begun
