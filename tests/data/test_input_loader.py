"""The input side: BatchLoader (order, resume, stalls, threads), InputTuner's rule, CriteoBatches
against torchrec's own Criteo datapipe."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch

from mlkv_torch.data.loader import BatchLoader, batch_bytes
from mlkv_torch.data.tuning import InputChoice, InputTuner, InputWindow


def _numbered(number: int) -> torch.Tensor:
    return torch.full((4,), number, dtype=torch.int64)


class _Switching(InputTuner):
    """Changes its choice at every decision, so the loader rebuilds its nodes each time."""

    def __init__(self) -> None:
        super().__init__("auto", "auto", cpu_budget=3)
        self.choices = [InputChoice(3, 1), InputChoice(1, 4), InputChoice(2, 2)]

    def decide(self, current: InputChoice, window: InputWindow) -> InputChoice:
        return self.choices[(self.choices.index(current) + 1) % 3 if current in self.choices else 0]


@pytest.mark.parametrize("tuner", [InputTuner(1, 1), InputTuner(3, 5), _Switching()], ids=["1x1", "3x5", "switching"])
def test_batches_come_in_order_whatever_the_threads(tuner):
    def slow_odd(number: int) -> torch.Tensor:  # later numbers finish first on other threads
        if number % 2:
            time.sleep(0.003)
        return _numbered(number)

    loader = BatchLoader(slow_odd, first=7, count=70, stride=3, tuner=tuner)
    got = [int(b[0]) for b in loader]
    assert got == [7 + 3 * i for i in range(70)]
    if isinstance(tuner, _Switching):
        assert loader.stats()["decisions"] >= 3  # at 8, 16, 32 and 64: it rebuilt at each


def test_resume_makes_only_what_it_delivers():
    made = []

    def recording(number: int) -> torch.Tensor:
        made.append(number)
        return _numbered(number)

    first = 10 ** 12  # a run resumed very late: nothing before it is made or read
    loader = BatchLoader(recording, first=first, count=5, stride=2, tuner=InputTuner(2, 2))
    assert [int(b[0]) for b in loader] == [first + 2 * i for i in range(5)]
    assert sorted(made) == [first + 2 * i for i in range(5)]
    assert loader.state_dict() == {"next_batch": first + 10}


def test_endless_loader_and_its_position():
    loader = BatchLoader(_numbered, first=3, count=None, tuner=InputTuner(2, 3))
    assert [int(next(loader)[0]) for _ in range(20)] == list(range(3, 23))
    assert loader.state_dict() == {"next_batch": 23}
    loader.close()


def test_training_waits_for_slow_batches_and_the_wait_is_measured():
    loader = BatchLoader(lambda n: time.sleep(0.03) or _numbered(n), count=10, tuner=InputTuner(1, 1))
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats["batches"] == 10 and stats["wait_s"] >= 10 * 0.03 * 0.8  # nothing else makes them


def test_a_failing_batch_raises_in_the_consumer():
    def broken(number: int) -> torch.Tensor:
        if number == 5:
            raise ValueError("row 5 is bad")
        return _numbered(number)

    loader = BatchLoader(broken, count=10, tuner=InputTuner(2, 2))
    assert [int(next(loader)[0]) for _ in range(5)] == list(range(5))
    with pytest.raises(ValueError, match="row 5 is bad"):
        next(loader)


def _new_threads_gone(before: set, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return not set(threading.enumerate()) - before


@pytest.mark.parametrize("how", ["ended", "closed mid-stream", "rebuilt, then closed"])
def test_threads_stop_when_the_loader_ends_or_closes(how):
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the threads must stop because the loader stops them, not because a collection ran
    try:
        before = set(threading.enumerate())  # threads of earlier tests may end meanwhile: count only new ones
        made = []
        if how == "ended":
            loader = BatchLoader(_numbered, count=30, tuner=InputTuner(3, 4))
            assert len(list(loader)) == 30
        else:
            loader = BatchLoader(lambda n: made.append(n) or _numbered(n), count=None,
                                 tuner=_Switching() if how.startswith("rebuilt") else InputTuner(4, 8))
            for _ in range(20 if how.startswith("rebuilt") else 5):  # the switching tuner rebuilt at 8 and 16
                next(loader)
            loader.close()
        assert _new_threads_gone(before)
        made_when_closed = len(made)
        time.sleep(0.2)
        assert len(made) == made_when_closed  # nothing is made after close
    finally:
        if gc_was_enabled:
            gc.enable()


def test_batch_bytes_counts_a_torchrec_batch():
    from mlkv_torch.data.batch import one_id_per_feature_batch

    batch = one_id_per_feature_batch(["a", "b"], torch.zeros(8, 3), torch.zeros(8, 2, dtype=torch.int64),
                                     torch.zeros(8))
    # dense 8x3 float32, labels 8 float32, KJT values 16 + lengths 16 + offsets 17 int64
    assert batch_bytes(batch) == 96 + 32 + (16 + 16 + 17) * 8


def _window(make_ms: float, step_ms: float, wait_ms: float = 0.0, make_max_ms: float = None,
            batch_bytes: int = 1 << 20) -> InputWindow:
    return InputWindow(batches=16, make_ms=make_ms, make_max_ms=make_max_ms or make_ms, step_ms=step_ms,
                       wait_ms=wait_ms, batch_bytes=batch_bytes)


def test_tuner_picks_just_enough_threads_within_the_cpu_budget():
    tuner = InputTuner("auto", "auto", cpu_budget=8)
    start = tuner.initial()
    assert start == InputChoice(1, 2)
    assert tuner.decide(start, _window(make_ms=3, step_ms=30)).workers == 1  # one thread outpaces training
    assert tuner.decide(start, _window(make_ms=30, step_ms=10)).workers == 5  # ceil(1.5 * 30 / 10)
    assert InputTuner("auto", 2, cpu_budget=2).decide(start, _window(make_ms=30, step_ms=10)).workers == 2
    # What the rates call for, whatever the budget: this host is 3 threads short; with 2 threads that
    # the model finds enough while training waits, 1 short.
    assert InputTuner.workers_needed(start, _window(make_ms=30, step_ms=10)) == 5
    assert InputTuner.workers_needed(start, _window(make_ms=3, step_ms=30)) == 1
    assert InputTuner.workers_needed(InputChoice(2, 2), _window(make_ms=3, step_ms=30, wait_ms=3)) == 3
    # 64 MiB of 16 MiB batches: one thread (two in flight) and two buffered, not the 5 threads wanted.
    small = InputTuner("auto", "auto", cpu_budget=8, memory_budget_bytes=64 << 20)
    assert small.decide(start, _window(make_ms=30, step_ms=10, batch_bytes=16 << 20)) == InputChoice(1, 2)
    # The model says one thread is enough, but training still waits: one more (Cachew's rule).
    assert tuner.decide(InputChoice(2, 2), _window(make_ms=3, step_ms=30, wait_ms=3)).workers == 3
    # Fewer threads only once training clearly does not wait.
    assert tuner.decide(InputChoice(4, 2), _window(make_ms=3, step_ms=30, wait_ms=0.2)).workers == 4
    assert tuner.decide(InputChoice(4, 2), _window(make_ms=3, step_ms=30, wait_ms=0.0)).workers == 1


def test_tuner_buffers_the_slowest_batch_within_the_memory_budget():
    tuner = InputTuner("auto", "auto", cpu_budget=1, memory_budget_bytes=64 << 20)
    start = tuner.initial()
    assert tuner.decide(start, _window(make_ms=5, step_ms=20)).prefetch == 2  # at least double buffering
    assert tuner.decide(start, _window(make_ms=5, make_max_ms=95, step_ms=20)).prefetch == 6  # ceil(95/20) + 1
    # 64 MiB of 16 MiB batches: 4 in flight, 2 of them with the one worker.
    assert tuner.decide(start, _window(make_ms=5, make_max_ms=95, step_ms=20, batch_bytes=16 << 20)).prefetch == 2
    fixed = InputTuner(3, 7, cpu_budget=1)
    assert fixed.decide(fixed.initial(), _window(make_ms=100, step_ms=1, wait_ms=50)) == InputChoice(3, 7)
    assert not fixed.tunes and tuner.tunes
    with pytest.raises(ValueError, match="workers must be a positive int or 'auto'"):
        InputTuner(0, 2)
    with pytest.raises(ValueError, match="prefetch must be a positive int or 'auto'"):
        InputTuner(1, "many")


def test_fixed_settings_still_measure_what_the_input_needs():
    # One thread, fixed: nothing is decided, but the threads that would keep up are measured (and
    # the runner reports them when training waited).
    loader = BatchLoader(lambda n: time.sleep(0.02) or _numbered(n), count=24, tuner=InputTuner(1, 1, cpu_budget=8))
    for _ in loader:
        time.sleep(0.005)
    stats = loader.stats()
    assert stats["decisions"] == 0 and stats["workers"] == 1
    assert stats["workers_needed"] >= 2 and stats["input_cores"] > 0


def test_auto_tuning_adds_threads_while_training_waits():
    # Each batch takes 20 ms on its thread and training takes 5 ms: one thread keeps it waiting.
    loader = BatchLoader(lambda n: time.sleep(0.02) or _numbered(n), count=64,
                         tuner=InputTuner("auto", "auto", cpu_budget=8))
    for _ in loader:
        time.sleep(0.005)
    assert loader.stats()["workers"] >= 2  # ceil(1.5 * 20 / 5) = 6 by the model, more while training waits


# CriteoBatches against torchrec's own datapipe over the same npy days.

def _write_day(prefix, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    np.save(f"{prefix}_dense.npy", rng.random((rows, 13), dtype=np.float32))
    np.save(f"{prefix}_sparse.npy", rng.integers(0, 1 << 32, (rows, 26), dtype=np.int64))
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))


CARDINALITIES = [1000 + 37 * i for i in range(26)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_criteo_batches_equal_torchrecs_datapipe(tmp_path, world):
    # Each rank's batches (step s of rank r trains batch s * world + r) are those torchrec's datapipe
    # gives that rank: it deals the batches out in turn.
    pytest.importorskip("torchrec")
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    from mlkv_torch.data.criteo_npy import npy_files
    from mlkv_torch.data.criteo_batches import CriteoBatches

    prefixes = [str(tmp_path / "day_0"), str(tmp_path / "day_1")]
    _write_day(prefixes[0], 250, 0)
    _write_day(prefixes[1], 170, 1)  # batches of 64 cross from day 0 into day 1
    ours = CriteoBatches(prefixes, 64, CARDINALITIES)
    for rank in range(world):
        theirs = list(InMemoryBinaryCriteoIterDataPipe("train", *npy_files(prefixes), batch_size=64, rank=rank,
                                                       world_size=world, drop_last=True, mmap_mode=True,
                                                       hashes=CARDINALITIES))
        assert ours.batches_per_epoch // world == len(theirs) == 420 // 64 // world
        for k, expected in enumerate(theirs):
            got = ours(rank + world * k)
            assert torch.equal(got.dense_features, expected.dense_features)
            assert torch.equal(got.labels, expected.labels)
            assert torch.equal(got.sparse_features.values(), expected.sparse_features.values())
    if world > 1:
        return
    for number, expected in enumerate(theirs):
        got = ours(number)
        assert torch.equal(got.dense_features, expected.dense_features)
        assert torch.equal(got.labels, expected.labels)
        assert torch.equal(got.sparse_features.values(), expected.sparse_features.values())
        assert got.sparse_features.keys() == expected.sparse_features.keys()
        assert torch.equal(got.sparse_features.lengths(), expected.sparse_features.lengths().long())
    # Epochs repeat in file order without a shuffle window.
    assert torch.equal(ours(ours.batches_per_epoch + 2).dense_features, theirs[2].dense_features)


def test_raw_criteo_ids_are_the_categorical_values_unsigned(tmp_path):
    from mlkv_torch.data.criteo_batches import RAW_ID_SPACE, CriteoBatches

    prefix = str(tmp_path / "day_0")
    _write_day(prefix, 130, 0)
    sparse = np.load(f"{prefix}_sparse.npy")
    sparse[0, :3] = [-1, -(1 << 31), (1 << 31) - 1]  # torchrec's own npy files hold them as int32
    np.save(f"{prefix}_sparse.npy", sparse)
    raw = CriteoBatches([prefix], 64, None)
    ids = raw(0).sparse_features.values().view(26, 64).T  # one id per feature and sample
    assert ids[0, :3].tolist() == [RAW_ID_SPACE - 1, 1 << 31, (1 << 31) - 1]
    assert torch.equal(ids[1:], torch.from_numpy(sparse[1:64]))  # no modulo: the values themselves
    hashed = CriteoBatches([prefix], 64, CARDINALITIES)(1).sparse_features.values().view(26, 64).T
    assert torch.equal(hashed, raw(1).sparse_features.values().view(26, 64).T % torch.tensor(CARDINALITIES))


def test_criteo_shuffle_is_a_reproducible_permutation_within_windows(tmp_path):
    from mlkv_torch.data.criteo_batches import CriteoBatches

    prefix = str(tmp_path / "day_0")
    _write_day(prefix, 1000, 2)
    batches = CriteoBatches([prefix], 10, CARDINALITIES, shuffle_window=7, seed=3)
    per_epoch = batches.batches_per_epoch
    assert per_epoch == 100  # 14 whole windows of 7 batches and a last one of 2
    for epoch in range(2):
        rows = [batches.row_indices(epoch * per_epoch + j) for j in range(per_epoch)]
        assert sorted(np.concatenate(rows).tolist()) == list(range(1000))  # every row once an epoch
        for j, r in enumerate(rows):
            window = r[0] // 70
            assert (r // 70 == window).all()  # a batch's rows come from one window
            if j >= 98:
                assert window == 14  # the short last window stays last
    first_epoch = [batches.row_indices(j) for j in range(per_epoch)]
    second_epoch = [batches.row_indices(per_epoch + j) for j in range(per_epoch)]
    assert any(not np.array_equal(a, b) for a, b in zip(first_epoch, second_epoch))
    assert any(r[0] // 70 != j // 7 for j, r in enumerate(first_epoch))  # the windows changed places
    again = CriteoBatches([prefix], 10, CARDINALITIES, shuffle_window=7, seed=3)
    assert all(np.array_equal(again.row_indices(j), first_epoch[j]) for j in range(per_epoch))
    other = CriteoBatches([prefix], 10, CARDINALITIES, shuffle_window=7, seed=4)
    assert any(not np.array_equal(other.row_indices(j), first_epoch[j]) for j in range(per_epoch))
    dense = np.load(f"{prefix}_dense.npy")
    assert np.array_equal(batches(5).dense_features.numpy(), dense[first_epoch[5]])


def test_criteo_batches_refuse_files_that_do_not_fit(tmp_path):
    from mlkv_torch.data.criteo_batches import CriteoBatches

    prefix = str(tmp_path / "day_0")
    _write_day(prefix, 30, 0)
    with pytest.raises(ValueError, match="30 rows, fewer than one batch"):
        CriteoBatches([prefix], 64, CARDINALITIES)
    np.save(f"{prefix}_dense.npy", np.zeros((30, 12), dtype=np.float32))
    with pytest.raises(ValueError, match=r"day_0_dense\.npy' has shape \(30, 12\), expected \(rows, 13\)"):
        CriteoBatches([prefix], 8, CARDINALITIES)
    with open(f"{prefix}_sparse.npy", "wb") as f:
        f.write(b"not an npy file")
    np.save(f"{prefix}_dense.npy", np.zeros((30, 13), dtype=np.float32))
    with pytest.raises(ValueError, match=r"day_0_sparse\.npy' cannot be read"):
        CriteoBatches([prefix], 8, CARDINALITIES)
    with pytest.raises(FileNotFoundError, match="nope_dense.npy"):
        CriteoBatches([str(tmp_path / "nope")], 8, CARDINALITIES)
