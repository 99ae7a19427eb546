"""The threads of a process do not grow with its number of disk tables: one table-batched kernel
has three (applier, read-ahead, writer), and the stores share three background threads (page
writes, copies, compactions) and one pool of pread workers, however many stores there are."""
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from mlkv_torch import KVStore, optim
from mlkv_torch.disk_table import DiskTable
from mlkv_torch.opening import open_table_batch


def mlkv_threads() -> collections.Counter:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # ended meanwhile
            pass
    return collections.Counter(n for n in names if n.startswith("mlkv-"))


def train_kernel(path, tables: int) -> collections.Counter:
    """The threads named mlkv-* that training a kernel of `tables` tables added to the process
    (other tests' tables may still be open)."""
    before = mlkv_threads()
    rows = 4000
    batch = open_table_batch([DiskTable(f"t{i}", rows, str(path / f"t{i}")) for i in range(tables)], 8,
                             optimizer=optim.SGD(lr=0.1), cache_rows=64, memory_budget_bytes=tables * (64 << 10))
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        # every table's rows, more than the cache holds: misses, evictions, write-back, log pages flushed
        values = torch.randint(0, rows, (tables * 200,), generator=g)
        offsets = torch.arange(0, values.numel() + 1, 10)
        batch.lookahead(torch.randint(0, rows, (tables * 200,), generator=g), [200] * tables, list(range(tables)))
        batch.pool(values, [200] * tables, list(range(tables)), offsets).sum().backward()
    batch.flush()
    threads = mlkv_threads()
    batch.close()
    threads.subtract(before)
    return +threads


def test_kernel_threads_do_not_grow_with_tables(tmp_path):
    # In a process of its own: a kernel another test left open, or one it builds in a thread of its
    # own, would change this process's threads meanwhile.
    # The package this test imported, wherever it is (installed, or a build tree's).
    package_root = str(Path(sys.modules["mlkv_torch"].__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    few, many, flush = json.loads(done.stdout.splitlines()[-1])
    for name in ("mlkv-applier", "mlkv-read-ahead", "mlkv-writer"):
        assert few.get(name) == many.get(name) == 1, (few, many)
    assert many.get("mlkv-flush", 0) <= 1 and many.get("mlkv-copy", 0) <= 1 and many.get("mlkv-compact", 0) <= 1, many
    assert sum(many.values()) <= 6, many
    assert flush == 1  # the 24 stores wrote their pages through the process's one flush thread


def test_pread_workers_are_shared_by_the_stores(tmp_path):
    before = mlkv_threads()["mlkv-pread"]
    stores = [KVStore(str(tmp_path / f"s{i}"), 8, memory_budget_bytes=32 << 10, io_engine="threads", io_threads=3,
                      segment_bytes=16 << 10) for i in range(6)]
    for store in stores:
        store.put(torch.arange(2000), torch.randn(2000, 8))  # far beyond the budget: rows on disk
    for store in stores:
        store.get(torch.arange(0, 2000, 7))
    assert mlkv_threads()["mlkv-pread"] - before in (0, 3)  # 0: a pool of 3 was already running
    for store in stores:
        store.close()


if __name__ == "__main__":  # test_kernel_threads_do_not_grow_with_tables's process
    where = Path(sys.argv[1])
    few, many = train_kernel(where / "few", 2), train_kernel(where / "many", 24)
    print(json.dumps([few, many, mlkv_threads()["mlkv-flush"]]))
