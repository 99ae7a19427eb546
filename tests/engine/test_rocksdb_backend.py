"""The RocksDB baseline: RocksDBStore against a Python dict, its bad input, and DiskEmbeddingBag over it
(backend="rocksdb") against torch.nn.EmbeddingBag with the matching torch optimizer."""
import glob
import os

import pytest
import torch

from mlkv_torch import CorruptionError, DiskEmbeddingBag, RocksDBStore, _C

from conftest import DIM, rows_for
from test_disk_embedding_bag import NUM, OPTIMIZERS, batch, reference_like

pytestmark = pytest.mark.skipif(not _C.with_rocksdb, reason="built without RocksDB (librocksdb-dev)")

SMALL_BUDGET = 256 << 10  # 64 KiB memtables: a few thousand rows push most of them into SST files


def test_store_equals_a_dict_across_flushes_and_reopen(tmp_path):
    model = {}
    g = torch.Generator().manual_seed(0)
    with RocksDBStore(tmp_path / "db", DIM, memory_budget_bytes=SMALL_BUDGET) as store:
        for tag in range(20):
            keys = torch.randint(0, 5000, (800,), generator=g)
            keys[:5] = keys[0]  # duplicates in one batch: the last wins
            values = rows_for(keys, tag)
            values[:5] += torch.arange(5, dtype=torch.float32).unsqueeze(1)
            store.put(keys, values)
            for k, v in zip(keys.tolist(), values):
                model[k] = v
        assert store.stats()["disk_bytes"] > 0, "the budget was meant to push rows into SST files"
        probe = torch.arange(5200)
        rows, found = store.lookup(probe)
    expected_found = torch.tensor([k in model for k in range(5200)])
    torch.testing.assert_close(found, expected_found)
    expected = torch.stack([model.get(k, torch.zeros(DIM)) for k in range(5200)])
    torch.testing.assert_close(rows, expected)
    with RocksDBStore(tmp_path / "db", DIM, memory_budget_bytes=SMALL_BUDGET) as reopened:
        rows, found = reopened.lookup(probe)
        torch.testing.assert_close(found, expected_found)
        torch.testing.assert_close(rows, expected)


def test_bad_input_names_the_problem(tmp_path):
    with RocksDBStore(tmp_path / "db", DIM) as store:
        with pytest.raises(TypeError, match="values must be torch.float32"):
            store.put(torch.tensor([1]), torch.zeros(1, DIM, dtype=torch.float64))
        with pytest.raises(ValueError, match="shape"):
            store.put(torch.tensor([1, 2]), torch.zeros(1, DIM))
        with pytest.raises(ValueError, match="non-negative"):
            store.put(torch.tensor([-3]), torch.zeros(1, DIM))
        with pytest.raises(TypeError, match="int64"):
            store.lookup(torch.tensor([1.0]))
        store.put(torch.tensor([4]), torch.ones(1, DIM))
    with pytest.raises(ValueError, match="holds rows of 32 bytes; this table needs 64"):
        RocksDBStore(tmp_path / "db", 2 * DIM)
    with RocksDBStore(tmp_path / "db", DIM) as store:  # the refused open changed nothing
        torch.testing.assert_close(store.lookup(torch.tensor([4]))[0], torch.ones(1, DIM))
    with pytest.raises(ValueError, match="is closed"):
        store.lookup(torch.tensor([4]))
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError, match="file"):
        RocksDBStore(tmp_path / "file" / "db", DIM)


def test_a_corrupted_table_file_is_reported(tmp_path):
    with RocksDBStore(tmp_path / "db", DIM, memory_budget_bytes=SMALL_BUDGET) as store:
        store.put(torch.arange(3000), rows_for(torch.arange(3000), 0))
    (sst,) = sorted(glob.glob(str(tmp_path / "db" / "*.sst")))[:1]
    with open(sst, "r+b") as f:  # flip bytes inside the data blocks
        f.seek(os.path.getsize(sst) // 3)
        f.write(b"\xff" * 64)
    with pytest.raises(CorruptionError, match=r"checksum mismatch.*\.sst"):
        with RocksDBStore(tmp_path / "db", DIM, memory_budget_bytes=SMALL_BUDGET) as store:
            store.lookup(torch.arange(3000))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("cache_rows", [0, 40])
def test_disk_embedding_bag_over_rocksdb_trains_like_the_reference(tmp_path, optimizer, cache_rows):
    ours, reference = OPTIMIZERS[optimizer]
    emb = DiskEmbeddingBag(NUM, 32, path=tmp_path / "t", optimizer=ours, cache_rows=cache_rows,
                           memory_budget_bytes=cache_rows * 4 * (32 + ours.state_dim(32)) + (256 << 10),
                           backend="rocksdb")
    ref = reference_like(emb, sparse=True)
    ref_opt = reference(list(ref.parameters()))
    for step in range(12):
        ids, offsets, target = batch(step)
        (emb(ids, offsets) * target).sum().backward()
        ref_opt.zero_grad()
        (ref(ids, offsets) * target).sum().backward()
        ref_opt.step()
        if step % 4 == 3:  # lookahead over this store too
            emb.lookahead(batch(step + 1)[0])
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), ref.weight.detach())
    stats = emb.stats()
    assert stats["rows_written"] > 0 and stats["rows_found"] > 0, "rows were meant to go through RocksDB"
    emb.close()
    reopened = DiskEmbeddingBag(NUM, 32, path=tmp_path / "t", optimizer=ours, cache_rows=cache_rows,
                                memory_budget_bytes=1 << 20, backend="rocksdb", reopen=True)
    torch.testing.assert_close(reopened.export_rows(torch.arange(NUM)), ref.weight.detach())
    reopened.close()


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        DiskEmbeddingBag(10, 4, path=tmp_path / "t", backend="leveldb")
