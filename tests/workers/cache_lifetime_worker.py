"""A cache's start and end in a process of its own, so an abort shows as a failure of the test
that runs it (tests/test_embedding_cache.py). Modes:

  thread_start_fails ROOT   each of the cache's thread starts fails in turn: the cache raises,
                            and one opened next works
  drop_in_thread PATH       a non-main thread drops the last reference to a cache with dirty rows
  drop_in_daemon_at_exit PATH  a daemon thread drops it while the main thread exits
  left_at_exit PATH         the interpreter's teardown drops it

The drop modes train every row once (initial rows 0, SGD at lr 1, gradient 1: each row ends -1);
the test reopens the store at PATH and expects every row there."""
import os
import sys
import threading

import torch

from mlkv_torch import DiskEmbeddingBag, KVStore, _C, optim

ROWS, DIM = 100_000, 16


def open_cache(path: str):
    """A cache holding every row of a table whose store only the cache holds."""
    opt = optim.SGD(lr=1.0)
    store = KVStore(path, DIM, torch.float32, 64 << 20, expected_rows=ROWS)
    eps, beta1, beta2 = opt.rule_constants()
    return _C.EmbeddingCache([("t", store._store, ROWS, 0, False, 0.0, 0.0, 0, 0)], capacity=ROWS, dim=DIM,
                             weight_type=0, kind=opt.kind, eps=eps, beta1=beta1, beta2=beta2,
                             initial_state=opt.initial_state(1, DIM).flatten().tolist(), policy="lru", staleness=0,
                             device="cpu")


def dirty_cache(path: str):
    cache = open_cache(path)
    keys = torch.arange(ROWS)
    cache.fetch(keys)
    cache.queue_update(keys, torch.ones(ROWS, DIM), 1, 1.0)
    cache.drain()
    return cache


def thread_start_fails(root: str) -> None:
    for failing in (1, 2, 3):  # on the CPU: the applier, the read-ahead thread, the writer
        _C._arm_fault_for_testing("thread_start", failing)
        try:
            DiskEmbeddingBag(100, 4, path=os.path.join(root, f"t{failing}"), cache_rows=10, memory_budget_bytes=1 << 20)
        except RuntimeError as e:
            assert "thread" in str(e), e
        else:
            raise AssertionError(f"the cache opened though its thread start {failing} failed")
    _C._arm_fault_for_testing("thread_start", 0)
    emb = DiskEmbeddingBag(100, 4, path=os.path.join(root, "ok"), cache_rows=10, memory_budget_bytes=1 << 20)
    emb(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    emb.close()


def drop_in_thread(path: str) -> None:
    box = [dirty_cache(path)]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()


def drop_in_daemon_at_exit(path: str) -> None:
    box = [dirty_cache(path)]
    dropping = threading.Event()

    def drop() -> None:
        cache = box.pop()
        dropping.set()
        del cache  # its write-back runs on while the main thread exits

    threading.Thread(target=drop, daemon=True).start()
    dropping.wait()


CACHE = None


def left_at_exit(path: str) -> None:
    global CACHE
    CACHE = dirty_cache(path)


if __name__ == "__main__":
    {"thread_start_fails": thread_start_fails, "drop_in_thread": drop_in_thread,
     "drop_in_daemon_at_exit": drop_in_daemon_at_exit, "left_at_exit": left_at_exit}[sys.argv[1]](sys.argv[2])
