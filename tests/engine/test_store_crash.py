"""Crash consistency: a process killed with SIGKILL leaves exactly its latest checkpoint.

The children open their stores with compaction_ratio=0 where the test needs
"exactly the checkpoint": an automatic compaction ends with a checkpoint of
its own.
"""
from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, assert_store_equals, rows_for

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest's

CHILD_PRELUDE = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, {tests_dir!r})
    import torch
    from mlkv_torch import KVStore
    from conftest import DIM, SMALL_OPTIONS, rows_for
    path = sys.argv[1]
    """
).format(tests_dir=TESTS_DIR)

# Data A, checkpointed, then writes B forever.
CHILD_A_THEN_B = CHILD_PRELUDE + textwrap.dedent(
    """
    store = KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=0))
    store.put(torch.arange(3000), rows_for(torch.arange(3000), 1))
    store.put(torch.arange(100), rows_for(torch.arange(100), 2))          # on disk: appended again
    store.delete(torch.arange(100, 200))                                  # tombstones on disk
    store.put(torch.arange(2950, 3000), rows_for(torch.arange(2950, 3000), 3))  # in place, in memory
    store.delete(torch.arange(2900, 2910))                                # tombstones in memory
    store.checkpoint()
    print("CHECKPOINTED", flush=True)
    rng = random.Random(0)
    i = 0
    while True:
        i += 1
        keys = torch.tensor([rng.randrange(5000) for _ in range(300)])
        store.put(keys, rows_for(keys, 100 + i))
        store.put(torch.arange(2950, 3000), rows_for(torch.arange(2950, 3000), 100 + i))  # in place again
        store.delete(torch.tensor([rng.randrange(5000) for _ in range(30)]))
        store.lookahead(torch.arange(200, 400))
        print("B", i, flush=True)
    """
)

# Checkpoint after every batch; prints the batch number once checkpoint() returned.
CHILD_CHECKPOINT_LOOP = CHILD_PRELUDE + textwrap.dedent(
    """
    ratio, index_budget = float(sys.argv[2]), int(sys.argv[3])
    store = KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=ratio, index_budget_bytes=index_budget))
    i = 0
    while True:
        i += 1
        put_keys, delete_keys = batch(i)
        store.put(torch.tensor(put_keys), rows_for(torch.tensor(put_keys), i))
        store.delete(torch.tensor(delete_keys))
        store.checkpoint()
        print(i, store.stats()["compactions"], flush=True)
    """
)

BATCH_SRC = textwrap.dedent(
    """
    def batch(i):
        rng = random.Random(i)
        put_keys = [rng.randrange(1500) for _ in range(rng.randrange(1, 400))]
        delete_keys = [rng.randrange(1500) for _ in range(rng.randrange(0, 40))]
        return put_keys, delete_keys
    """
)
CHILD_CHECKPOINT_LOOP = CHILD_CHECKPOINT_LOOP.replace("ratio, index_budget =", BATCH_SRC + "ratio, index_budget =", 1)
exec(BATCH_SRC)  # defines batch(i) here too


def child_env():
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


class Child:
    """A child Python process whose stdout is read line by line, with timeouts."""

    def __init__(self, source: str, *args: str):
        # stdin a pipe left open: a child that waits on it waits for its SIGKILL, whatever the
        # parent's stdin is (at EOF it would exit, and closing its tables would take another cut).
        self.proc = subprocess.Popen([sys.executable, "-c", source, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
        self.buffer = b""

    def read_line(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.proc.kill()
                raise AssertionError(f"child printed nothing for {timeout}s; stderr: {self.proc.stderr.read()!r}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self.proc.wait()
                raise AssertionError(f"child exited with {self.proc.returncode}: {self.proc.stderr.read()!r}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode().strip()

    def kill(self) -> list:
        """SIGKILL; returns the lines the child printed that were not read yet."""
        alive = self.proc.poll() is None
        if alive:
            os.kill(self.proc.pid, signal.SIGKILL)
        rest, err = self.proc.communicate(timeout=60)
        assert alive and self.proc.returncode == -signal.SIGKILL, (self.proc.returncode, err.decode())
        return [line.strip() for line in (self.buffer + rest).decode().split("\n") if line.strip()]


def model_a():
    model = {k: v for k, v in zip(range(3000), rows_for(torch.arange(3000), 1))}
    model.update(zip(range(100), rows_for(torch.arange(100), 2)))
    for k in range(100, 200):
        del model[k]
    model.update(zip(range(2950, 3000), rows_for(torch.arange(2950, 3000), 3)))
    for k in range(2900, 2910):
        del model[k]
    return model


def test_kill_after_checkpoint_recovers_exactly_it(tmp_path):
    path = str(tmp_path / "store")
    child = Child(CHILD_A_THEN_B, path)
    try:
        assert child.read_line() == "CHECKPOINTED"
        # Let B run long enough to spill pages to segment files and update in place.
        for _ in range(5):
            assert child.read_line().startswith("B ")
        time.sleep(0.05)
    finally:
        child.proc.poll() is None and child.kill()
    model = model_a()
    with KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=0)) as store:
        assert_store_equals(store, model)
        assert not store.contains(torch.arange(3000, 5000)).any()
        assert store.stats()["disk_rows"] > 0
        # The recovered store takes writes and checkpoints again.
        store.put(torch.arange(5000, 5100), rows_for(torch.arange(5000, 5100), 7))
        model.update(zip(range(5000, 5100), rows_for(torch.arange(5000, 5100), 7)))
    with KVStore(path, DIM, **SMALL_OPTIONS) as store:
        assert_store_equals(store, model)


def states_after(last: int):
    """Model after each checkpoint 0..last+1, and after the put of each batch."""
    model = {}
    checkpoints, after_put = [dict(model)], [None]
    for i in range(1, last + 2):
        put_keys, delete_keys = batch(i)  # noqa: F821 (exec(BATCH_SRC) defines it)
        model.update(zip(put_keys, rows_for(torch.tensor(put_keys), i)))
        after_put.append(dict(model))
        for k in delete_keys:
            model.pop(k, None)
        checkpoints.append(dict(model))
    return checkpoints, after_put


def same(store: KVStore, model) -> bool:
    if len(store) != len(model):
        return False
    if not model:
        return True
    keys = sorted(model)
    if not bool(store.contains(torch.tensor(keys)).all()):
        return False
    return torch.equal(store.get(torch.tensor(keys)), torch.stack([model[k] for k in keys]))


# index_budget: the log's keys move into base runs (a merge, which checkpoints after it, as a compaction);
# at 4 KiB (256 keys) most merges write overlays, join them or rewrite the bottom: kills land in those.
@pytest.mark.parametrize("seed,ratio,index_budget", [(1, 0.0, 0), (2, 0.0, 0), (3, 1.5, 0), (4, 0.0, 8 << 10),
                                                     (5, 1.5, 8 << 10), (6, 0.0, 4 << 10), (7, 1.5, 4 << 10)])
def test_kill_during_checkpoint_loop(tmp_path, seed, ratio, index_budget):
    rng = random.Random(seed)
    path = str(tmp_path / "store")
    child = Child(CHILD_CHECKPOINT_LOOP, path, str(ratio), str(index_budget))
    merges = ratio or index_budget
    lines = []
    try:
        for _ in range(rng.randrange(3, 25)):
            lines.append(child.read_line())
        while merges and int(lines[-1].split()[1]) == 0:  # on until an automatic compaction ran
            lines.append(child.read_line())
        for _ in range(rng.randrange(0, 4) if merges else 0):
            lines.append(child.read_line())
        time.sleep(rng.random() * 0.03)
    finally:
        lines += child.kill() if child.proc.poll() is None else []
    printed = [tuple(int(x) for x in line.split()) for line in lines]
    last = printed[-1][0]
    assert [p[0] for p in printed] == list(range(1, last + 1))
    checkpoints, after_put = states_after(last)
    allowed = {f"checkpoint {last}": checkpoints[last], f"checkpoint {last + 1}": checkpoints[last + 1]}
    if merges:
        # An automatic compaction inside put(batch) checkpoints right after that put.
        allowed[f"put {last + 1}"] = after_put[last + 1]
    with KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=0)) as store:
        matches = [name for name, model in allowed.items() if same(store, model)]
        assert matches, f"reopened store ({len(store)} rows) matches none of {list(allowed)}"
    if merges:
        assert printed[-1][1] > 0, "no compaction ran in the child: the test did not exercise it"


def test_copy_of_open_store_holds_its_checkpoint(tmp_path):
    """In-process crash image: copy the directory of an open store after a checkpoint and more writes."""
    path = str(tmp_path / "store")
    model = {}
    store = KVStore(path, DIM, **dict(SMALL_OPTIONS, compaction_ratio=0))
    try:
        g = torch.Generator().manual_seed(5)
        for tag in range(6):
            keys = torch.randint(0, 4000, (600,), generator=g)
            store.put(keys, rows_for(keys, tag))
            model.update(zip(keys.tolist(), rows_for(keys, tag)))
            dead = torch.randint(0, 4000, (50,), generator=g)
            store.delete(dead)
            for k in dead.tolist():
                model.pop(k, None)
            store.checkpoint()
            image = str(tmp_path / f"image-{tag}")
            # More writes after the checkpoint: in place, appended, spilled to new segments.
            last = torch.tensor(sorted(model)[-20:])
            store.put(last, rows_for(last, 99))
            more = torch.randint(0, 8000, (1500,), generator=g)
            store.put(more, rows_for(more, 98))
            store.delete(torch.tensor(sorted(model)[:30]))
            shutil.copytree(path, image)
            with KVStore(image, DIM, **dict(SMALL_OPTIONS, compaction_ratio=0)) as copy:
                assert_store_equals(copy, model)
            # Undo the extra writes on the original so the next round starts from the model again.
            store.delete(more)
            for k in more.tolist():
                model.pop(k, None)
            store.put(torch.tensor(sorted(model)), torch.stack([model[k] for k in sorted(model)]))
    finally:
        store.close()


def _with_the_nth_call_failing(tmp_path, call: str, nth: int, path: str,
                               *child_args: str) -> subprocess.CompletedProcess:
    """Runs SYNC_FAILS_CHILD on `path` with the nth `call` (a system call) failing with EIO, by
    strace's fault injection; skips the test where strace cannot trace."""
    script = tmp_path / "child.py"
    if not script.exists():
        script.write_text(SYNC_FAILS_CHILD)
    # --seccomp-bpf: only `call` stops the child (importing torch under full tracing took 5x longer).
    run = subprocess.run(["strace", "-f", "--seccomp-bpf", "-o", os.devnull, "-e", f"trace={call}",
                          "-e", f"inject={call}:error=EIO:when={nth}", sys.executable, str(script), path, *child_args],
                         capture_output=True, text=True, timeout=120, env=child_env())
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[-200:]}")
    return run


def _each_nth_call_failing(tmp_path, call: str, nths, *child_args: str):
    """`_with_the_nth_call_failing` for each nth, on a store of its own (two children at a time: each
    spends most of its time importing torch): {nth: (the store's path, the child's run)}."""
    paths = {nth: str(tmp_path / f"store{nth}") for nth in nths}
    (tmp_path / "child.py").write_text(SYNC_FAILS_CHILD)
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda nth: _with_the_nth_call_failing(tmp_path, call, nth, paths[nth], *child_args), nths)
        return {nth: (paths[nth], run) for nth, run in zip(nths, runs)}


SYNC_FAILS_CHILD = textwrap.dedent("""
    # argv: path, memory budget, rows, the values put (one checkpoint after each), then "crash" or "close".
    import os, sys, torch
    from mlkv_torch import KVStore
    path, budget, rows, values, ending = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    try:
        store = KVStore(path, dim=8, memory_budget_bytes=budget, compaction_ratio=0)
    except OSError as e:  # the failure hit the store's creation
        print("create failed", e)
        sys.exit(0)
    for value in map(float, values.split(",")):
        store.put(torch.arange(rows), torch.full((rows, 8), value))
        try:
            store.checkpoint()
            print("checkpointed", value)
        except OSError as e:
            print("failed", value, e)
    if ending == "close":
        try:
            store.close()
            print("closed")
        except OSError as e:
            print("close failed", store.closed, e)
    sys.stdout.flush()
    os._exit(0)  # without a close: a crash
""")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace injects the failing syncs")
def test_a_sync_failing_anywhere_in_a_checkpoint_leaves_a_checkpoint_to_reopen(tmp_path):
    """Each fsync of the child's second checkpoint fails in turn (strace's fault injection), then the
    process dies. Reopening gives the rows of one checkpoint or the other, whole. Once, a failed
    directory sync after CHECKPOINT's rename removed the files the renamed record names, and the
    store could not be reopened."""
    outcomes = set()
    runs = _each_nth_call_failing(tmp_path, "fsync", range(1, 13), str(1 << 20), "100", "0,1", "crash")
    for nth, (path, run) in runs.items():
        if not os.path.exists(os.path.join(path, "CHECKPOINT")):
            continue  # the store's creation failed: nothing to reopen
        outcomes.update(line.split(" ")[0] + line.split(" ")[1] for line in run.stdout.splitlines())
        # What reopens is a checkpoint's rows, whole: none (the store's creation), 0s or 1s; at least
        # those of the last checkpoint that reported success.
        succeeded = [float(line.split(" ")[1]) for line in run.stdout.splitlines() if line.startswith("checkpointed")]
        with KVStore(path, 8, memory_budget_bytes=1 << 20, compaction_ratio=0) as store:
            if len(store) == 0:
                assert not succeeded, (nth, run.stdout)
                continue
            rows = store.get(torch.arange(100))
        assert any(torch.equal(rows, torch.full((100, 8), v)) for v in (0.0, 1.0)), (nth, run.stdout)
        assert not succeeded or rows[0, 0].item() >= max(succeeded), (nth, run.stdout)
    assert {"failed0.0", "failed1.0"} <= outcomes  # the injected failures hit both checkpoints


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace injects the failing sync")
def test_after_a_failed_sync_of_the_log_no_checkpoint_claims_its_pages(tmp_path):
    """One fdatasync fails (strace's fault injection): once it hit a segment, later checkpoints
    synced it again and reported success, though the kernel may have dropped the pages after the
    failed writeback. Now every later checkpoint and the close fail, the store closes, and reopening
    gives the last checkpoint that succeeded."""
    hit_a_segment = False
    # Each pass writes log pages out to a segment.
    runs = _each_nth_call_failing(tmp_path, "fdatasync", range(1, 8), str(64 << 10), "20000", "1,2,3", "close")
    for nth, (path, run) in runs.items():
        assert run.returncode == 0, run.stderr[-2000:]
        lines = run.stdout.splitlines()
        failed = [line for line in lines if line.startswith("failed") and "segment-" in line]
        if not failed:
            continue
        hit_a_segment = True
        first = lines.index(failed[0])
        # Every checkpoint after it fails as well, saying why, and the close too; the store is closed.
        assert all(line.startswith("failed") and "no later checkpoint is taken" in line
                   for line in lines[first + 1:-1]), lines
        assert lines[-1].startswith("close failed True"), lines
        succeeded = [float(line.split(" ")[1]) for line in lines[:first] if line.startswith("checkpointed")]
        with KVStore(path, 8, memory_budget_bytes=64 << 10, compaction_ratio=0) as store:
            if not succeeded:
                assert len(store) == 0
            else:
                torch.testing.assert_close(store.get(torch.arange(20000)), torch.full((20000, 8), succeeded[-1]))
    assert hit_a_segment
