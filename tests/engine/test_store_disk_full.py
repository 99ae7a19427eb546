"""A write that fails for lack of space raises OSError and loses no data.

The child process caps its file size with RLIMIT_FSIZE (and ignores SIGXFSZ),
so segment and snapshot writes fail with EFBIG the way they would on a full
disk, on a real file system.
"""
import subprocess
import sys
import textwrap

import torch

from mlkv_torch import KVStore

DIM = 16
CHILD = textwrap.dedent("""
    import resource, signal, sys, torch
    from mlkv_torch import KVStore
    path, dim = sys.argv[1], int(sys.argv[2])
    store = KVStore(path, dim=dim, memory_budget_bytes=64 << 10, segment_bytes=4 << 20, compaction_ratio=0)
    g = torch.Generator().manual_seed(0)
    first = torch.randn(2000, dim, generator=g)
    store.put(torch.arange(2000), first)
    store.checkpoint()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600 << 10, 600 << 10))
    error = None
    for i in range(200):
        try:
            store.put(torch.arange(2000 + 1000 * i, 3000 + 1000 * i), torch.randn(1000, dim, generator=g))
        except OSError as e:
            error = e
            break
    assert error is not None, "the file size limit never hit"
    print("ERROR", type(error).__name__, str(error))
    # The rows written before the failure still read back.
    torch.testing.assert_close(store.get(torch.arange(2000)), first)
    try:
        store.checkpoint()
        print("CHECKPOINT ok")
    except OSError as e:
        print("CHECKPOINT failed", str(e))
    sys.stdout.flush()
    import os
    os._exit(0)  # no close(): the next open recovers the last checkpoint that succeeded
""")


def test_write_past_the_space_limit_raises_oserror_and_keeps_the_checkpoint(tmp_path):
    path = str(tmp_path / "store")
    result = subprocess.run([sys.executable, "-c", CHILD, path, str(DIM)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    error_line = next(line for line in result.stdout.splitlines() if line.startswith("ERROR"))
    assert "segment-" in error_line and "File too large" in error_line, error_line
    g = torch.Generator().manual_seed(0)
    first = torch.randn(2000, DIM, generator=g)
    with KVStore(path, dim=DIM, memory_budget_bytes=64 << 10, compaction_ratio=0) as store:
        torch.testing.assert_close(store.get(torch.arange(2000)), first)
        assert len(store) >= 2000
