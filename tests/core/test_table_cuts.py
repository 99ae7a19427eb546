"""Cuts of a DiskEmbeddingBagCollection: after a SIGKILL at any point (while training past the cut,
half-way through the next cut, or with every store checkpointed past it), ``reopen=True`` brings every table back
to the last committed
cut exactly (rows, optimizer state, Adam's step), never a mix; real child processes, real stores."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

from test_store_crash import Child

torchrec = pytest.importorskip("torchrec")

from mlkv_torch.cut import read_cut  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Two row layouts (dims 8 and 4): two kernels, so a cut spans two batches of stores. Budget small
# enough that rows are evicted and written back while training.
SETUP = textwrap.dedent(
    """
    import sys
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection

    TABLES = [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=3000, feature_names=["fa"]),
              EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=500, feature_names=["fb"]),
              EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=2000, feature_names=["fc"])]

    def batch(step):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (3 * 16,), generator=g)
        n = int(lengths.sum())
        values = torch.cat([torch.randint(0, 3000, (n,), generator=g)
                            % torch.tensor([3000, 500, 2000]).repeat_interleave(
            torch.stack([lengths[i * 16:(i + 1) * 16].sum() for i in range(3)]))])
        return KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=values, lengths=lengths)

    def collection(path, **kwargs):
        kwargs.setdefault("memory_budget_bytes", 160 << 10)
        return DiskEmbeddingBagCollection(TABLES, path=path, optimizer=optim.Adam(lr=0.05), seed=3, **kwargs)

    def train(ebc, first, last):
        for step in range(first, last):
            out = ebc(batch(step))
            (out.values() * torch.linspace(-1, 1, out.values().shape[1])).sum().backward()

    def state_of(ebc):
        ebc.flush()
        return {name: (*bag.snapshot(include_state=True), bag.steps) for name, bag in ebc.embedding_bags.items()}
    """
)

CHILD = SETUP + textwrap.dedent(
    """
    path, expected, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    ebc = collection(path)
    if scenario == "populated":  # populate ends with a cut; training after it takes none
        ebc.populate()
        torch.save(state_of(ebc), expected)
        train(ebc, 0, 30)
    else:
        train(ebc, 0, 12)
        ebc.checkpoint(label=12)
        torch.save(state_of(ebc), expected)
        train(ebc, 12, 30)
    if scenario == "half":  # the next cut reaches the first kernel's stores only
        ebc._batches[0].checkpoint()
    if scenario == "stores":  # every store checkpoints past the cut; the collection's record is not written
        for kernel in ebc._batches:
            kernel.checkpoint()
    print("READY", flush=True)
    sys.stdin.read()
    """
)


def run_child(tmp_path, scenario: str):
    path, expected = str(tmp_path / "tables"), str(tmp_path / "expected.pt")
    child = Child(f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n" + CHILD, path, expected, scenario)
    try:
        assert child.read_line(timeout=300) == "READY"
    finally:
        child.kill()
    return path, torch.load(expected)


def reopened_state(path, **kwargs):
    namespace = {}
    exec(SETUP, namespace)
    ebc = namespace["collection"](path, reopen=True, **kwargs)
    try:
        return namespace["state_of"](ebc), ebc
    except BaseException:
        ebc.close()
        raise


def assert_tables_equal(got, expected, at_step: int) -> None:
    """Every table's rows, optimizer state and step (`state_of`) exactly as expected."""
    assert sorted(got) == sorted(expected)
    for name, (weight, state, steps) in expected.items():
        torch.testing.assert_close(got[name][0], weight, rtol=0, atol=0, msg=f"table {name} weights")
        torch.testing.assert_close(got[name][1], state, rtol=0, atol=0, msg=f"table {name} optimizer state")
        assert got[name][2] == steps == at_step, name


@pytest.mark.parametrize("scenario", ["training", "half", "stores"])
def test_killed_after_a_cut_reopens_exactly_at_it(tmp_path, scenario):
    path, expected = run_child(tmp_path, scenario)
    assert read_cut(path)["label"] == 12
    got, ebc = reopened_state(path)
    try:
        assert_tables_equal(got, expected, at_step=12)
        # The reopened tables train on, and a new cut commits.
        namespace = {}
        exec(SETUP, namespace)
        namespace["train"](ebc, 12, 14)
        assert ebc.checkpoint(label=14)["tables"]["a"]["step"] == 14
    finally:
        ebc.close()


def test_killed_after_populate_reopens_at_the_populated_rows(tmp_path):
    path, expected = run_child(tmp_path, "populated")
    assert read_cut(path)["label"] is None
    got, ebc = reopened_state(path)
    try:
        assert sorted(got) == sorted(expected)
        for name, (weight, state, steps) in expected.items():
            assert steps == 0 and got[name][2] == 0, name
            torch.testing.assert_close(got[name][0], weight, rtol=0, atol=0, msg=f"table {name} weights")
            torch.testing.assert_close(got[name][1], state, rtol=0, atol=0, msg=f"table {name} optimizer state")
        for name, num_rows in (("a", 3000), ("b", 500), ("c", 2000)):
            assert ebc.embedding_bags[name].stats()["rows"] == num_rows, f"table {name}: every row is in the store"
    finally:
        ebc.close()


def test_a_store_two_checkpoints_past_the_cut_is_refused_by_name(tmp_path):
    path, _ = run_child(tmp_path, "training")
    record = read_cut(path)
    got, ebc = reopened_state(path)
    namespace = {}
    exec(SETUP, namespace)
    namespace["train"](ebc, 12, 14)
    ebc.checkpoint(label=14)
    namespace["train"](ebc, 14, 16)
    ebc.checkpoint(label=16)
    ebc.close()
    with pytest.raises(ValueError, match=r"table 'a' cannot reopen at the cut 12 .*has checkpoints"):
        namespace["collection"](path, cut=record)


def test_an_explicit_cut_older_than_the_recorded_one_wins(tmp_path):
    """A training checkpoint names its cut; the collection's record may already name the next
    (the crash came between the two commits): the stores go back to the checkpoint's."""
    path, expected = run_child(tmp_path, "training")
    older = read_cut(path)
    namespace = {}
    exec(SETUP, namespace)
    ebc = namespace["collection"](path, reopen=True)
    namespace["train"](ebc, 12, 15)
    newer = ebc.checkpoint(label=15)
    ebc.close()
    assert read_cut(path) == newer
    got, ebc = reopened_state(path, cut=older)
    try:
        assert_tables_equal(got, expected, at_step=12)
        assert read_cut(path) == older
    finally:
        ebc.close()


# A cut written in the background (the writer held back while training goes on, so training
# changes rows of the cut before they are written: copy on write), against a twin trained the same
# way without cuts. Scenarios: "written" (the cut commits, training goes on, then SIGKILL),
# "killed" (SIGKILL while the cut is still being written), "full" (the disk refuses every write
# while the cut is written: it raises, and the cut before stays, through the store checkpoints
# taken after it that no record names).
BACKGROUND_CHILD = SETUP + textwrap.dedent(
    """
    import os, resource, signal, time
    path, expected, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    # A small cache (rows are evicted and written back while training) in a budget whose write-back
    # buffer (a thirty-second) holds what training writes back while the writer is held.
    SIZES = dict(memory_budget_bytes=2 << 20, cache_rows=600)
    twin = collection(path + "-twin", **SIZES)
    states = {}
    for first, last in ((0, 6), (6, 12), (12, 30)):
        train(twin, first, last)
        states[last] = state_of(twin)
    ebc = collection(path, **SIZES)
    train(ebc, 0, 6)
    ebc.checkpoint(label=6)
    train(ebc, 6, 12)
    for kernel in ebc._batches:
        kernel.cache.pause_writer(True)
    pending = ebc.begin_checkpoint(label=12)
    train(ebc, 12, 16)
    if scenario == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))  # no file may grow: a full disk
    for kernel in ebc._batches:
        kernel.cache.pause_writer(scenario == "killed")
    if scenario == "sealed":
        # Once the cut's rows are in and every store has begun its checkpoint, the rows training
        # writes back after the boundary go to the stores while those checkpoints are unfinished.
        while not all(kernel.cache.cut_sealed for kernel in ebc._batches):
            time.sleep(0.005)
        def writes():
            return sum(s["appends"] + s["in_place_updates"]
                       for k in ebc._batches for s in map(lambda st: st.stats(), k.stores))
        before = writes()
        train(ebc, 16, 30)
        for _ in range(3000):  # the writer puts the rows evicted meanwhile
            if writes() > before:
                break
            time.sleep(0.01)
        assert all(kernel.cache.cut_sealed for kernel in ebc._batches)  # not finished yet
        print("WRITTEN WHILE SEALED", writes() - before, flush=True)
        assert ebc.wait_checkpoint()["label"] == 12
        states["got"] = state_of(ebc)
    if scenario == "written":
        assert not pending.done or pending.wait()["label"] == 12
        assert ebc.wait_checkpoint()["label"] == 12
        train(ebc, 16, 30)
        states["got"] = state_of(ebc)
    if scenario == "full":
        try:
            ebc.wait_checkpoint()
            print("NO ERROR", flush=True)
        except OSError as e:
            print("ERROR", str(e).replace(chr(10), " "), flush=True)
        try:  # training goes on while the disk is full, until the rows waiting for it fill their buffer
            train(ebc, 16, 18)
        except OSError:
            pass
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        # Room again: the failed cut's rows reach the stores, and its checkpoints (never committed)
        # are taken late; then each kernel takes a part of a cut no record names. The stores keep
        # checkpoint 6's beside their latest however many uncommitted ones follow.
        train(ebc, 18, 20)
        for kernel in ebc._batches:
            kernel.checkpoint()
    torch.save(states, expected)
    print("READY", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.parametrize("scenario", ["written", "sealed", "killed", "full"])
def test_a_cut_written_in_the_background_holds_the_boundary_state(tmp_path, scenario):
    path, expected = str(tmp_path / "tables"), str(tmp_path / "expected.pt")
    child = Child(f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n" + BACKGROUND_CHILD, path, expected, scenario)
    try:
        line = child.read_line(timeout=300)
        if scenario == "full":
            # The error names the file that could not be written and why.
            assert line.startswith("ERROR") and "File too large" in line and path in line, line
            line = child.read_line(timeout=300)
        if scenario == "sealed":
            assert line.startswith("WRITTEN WHILE SEALED") and int(line.split()[-1]) > 0, line
            line = child.read_line(timeout=300)
        assert line == "READY"
    finally:
        child.kill()
    states = torch.load(expected)
    if scenario in ("written", "sealed"):
        # Writing the cut changed nothing of training: the tables equal the twin's, trained without one.
        for name, (weight, state, steps) in states["got"].items():
            torch.testing.assert_close(weight, states[30][name][0], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(state, states[30][name][1], rtol=0, atol=0, msg=name)
            assert steps == states[30][name][2] == 30
    at = 12 if scenario in ("written", "sealed") else 6
    assert read_cut(path)["label"] == at
    got, ebc = reopened_state(path, memory_budget_bytes=2 << 20, cache_rows=600)  # the child's sizes
    try:
        assert sorted(got) == sorted(states[at])
        for name, (weight, state, steps) in got.items():
            torch.testing.assert_close(weight, states[at][name][0], rtol=0, atol=0, msg=f"table {name} weights")
            torch.testing.assert_close(state, states[at][name][1], rtol=0, atol=0, msg=f"table {name} state")
            assert steps == states[at][name][2] == at, name
    finally:
        ebc.close()


def test_one_cut_at_a_time_and_close_commits_the_pending_one(tmp_path):
    namespace = {}
    exec(SETUP, namespace)
    ebc = namespace["collection"](str(tmp_path / "tables"))
    namespace["train"](ebc, 0, 3)
    first = ebc.begin_checkpoint(label=3)
    namespace["train"](ebc, 3, 5)
    second = ebc.begin_checkpoint(label=5)  # commits the first before it begins
    assert first.done and first.wait()["label"] == 3
    assert read_cut(str(tmp_path / "tables"))["label"] == 3
    namespace["train"](ebc, 5, 6)
    ebc.close()
    assert second.done and second.wait()["label"] == 5
    assert read_cut(str(tmp_path / "tables"))["label"] is None  # close's own cut, at step 6
    assert read_cut(str(tmp_path / "tables"))["tables"]["a"]["step"] == 6


def test_a_cut_takes_the_rows_trained_since_the_cut_before(tmp_path):
    """The cache's `cut_rows`: what a cut writes is the rows trained since the cut before (every row
    cached here, none written back by an eviction)."""
    namespace = {}
    exec(SETUP, namespace)
    collection, train, batch = namespace["collection"], namespace["train"], namespace["batch"]
    ebc = collection(str(tmp_path / "tables"), memory_budget_bytes=4 << 20)
    try:
        train(ebc, 0, 5)
        ebc.checkpoint(label=5)
        train(ebc, 5, 8)
        trained = {(key, i) for step in range(5, 8) for kjt in [batch(step)] for key in kjt.keys()
                   for i in kjt[key].values().tolist()}
        pending = ebc.begin_checkpoint(label=8)
        assert sum(b.cache.stats()["cut_rows"] for b in ebc._batches) == len(trained)
        assert pending.wait()["label"] == 8
    finally:
        ebc.close()


def test_while_a_cut_is_written_no_row_waits_for_it_and_training_is_unchanged(tmp_path):
    """While a cut's rows are written, a row written back would wait in the write-back buffer until
    the stores have them: so evictions take clean rows first, and the policy keeps no miss out (a
    row kept out is written back at its update). With the writer held, two steps after the
    boundary leave nothing waiting, where a twin without a cut keeps rows out; the tables equal the
    twin's, and reopen exactly at the cut."""
    namespace = {}
    exec(SETUP, namespace)
    collection, train, state_of = (namespace[k] for k in ("collection", "train", "state_of"))
    sizes = dict(memory_budget_bytes=2 << 20, cache_rows=600)  # rows evicted and kept out while training
    twin = collection(str(tmp_path / "twin"), **sizes)
    ebc = collection(str(tmp_path / "tables"), **sizes)

    def counters(c):
        stats = [batch.cache.stats() for batch in c._batches]
        return {k: sum(s[k] for s in stats) for k in ("rejected", "admitted", "write_back_rows", "cut_rows")}
    try:
        train(twin, 0, 6)
        train(ebc, 0, 6)
        twin_at_cut = state_of(twin)
        ebc.flush()
        before, twin_before = counters(ebc), counters(twin)
        for batch in ebc._batches:
            batch.cache.pause_writer(True)
        pending = ebc.begin_checkpoint(label=6)
        assert counters(ebc)["cut_rows"] == 0  # flushed: nothing dirty at the boundary
        train(twin, 6, 8)
        train(ebc, 6, 8)
        during, twin_during = counters(ebc), counters(twin)
        assert twin_during["rejected"] > twin_before["rejected"]  # the policy keeps rows out here
        assert during["rejected"] == before["rejected"]
        assert during["admitted"] > before["admitted"]
        assert during["write_back_rows"] == 0  # no row waits for the cut
        for batch in ebc._batches:
            batch.cache.pause_writer(False)
        at_cut = pending.wait()
        assert at_cut["label"] == 6
        train(twin, 8, 12)
        train(ebc, 8, 12)
        assert_tables_equal(state_of(ebc), state_of(twin), at_step=12)
    finally:
        twin.close()
        ebc.close()
    got, reopened = reopened_state(str(tmp_path / "tables"), cut=at_cut, **sizes)
    try:
        assert_tables_equal(got, twin_at_cut, at_step=6)
    finally:
        reopened.close()
