"""Model-based test: random operation sequences against a dict of key -> row.

The memory budget (8 pages of 85 rows) is far below the key space (3000 keys),
so most gets, deletes and lookaheads touch rows that live only on disk.
"""
from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mlkv_torch
from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS

KEY_SPACE = 3000
keys_st = st.integers(min_value=0, max_value=KEY_SPACE - 1)
ENGINES = ["threads", "pread"] + (["uring"] if mlkv_torch._C.uring_available() else [])


def make_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="mlkv-model-")
        self.path = self.dir + "/store"
        self.model = {}
        self.store = None
        self.options = {}

    @initialize(
        ratio=st.sampled_from([0.0, 1.5]),
        engine=st.sampled_from(ENGINES),
        direct_io=st.booleans(),
        mutable=st.sampled_from([0.9, 0.3]),
        page_bytes=st.sampled_from([0, 0, 8192]),
        index_budget=st.sampled_from([0, 0, 8 << 10]),  # 8 KiB: the log's keys move to a base run often
        key_limit=st.sampled_from([0, KEY_SPACE]),  # KEY_SPACE: the index hashes 12-bit keys
    )
    def open(self, ratio, engine, direct_io, mutable=0.9, page_bytes=0, index_budget=0, key_limit=0):
        self.options = dict(SMALL_OPTIONS, compaction_ratio=ratio, io_engine=engine, direct_io=direct_io,
                            mutable_fraction=mutable, page_bytes=page_bytes, index_budget_bytes=index_budget,
                            key_limit=key_limit)
        self.store = KVStore(self.path, DIM, **self.options)
        self.page_bytes = self.store.stats()["page_bytes"]

    def teardown(self):
        try:
            if self.store is not None:
                self.store.close()
                # Whatever the sequence, a reopen after close holds the model.
                with KVStore(self.path, DIM, **self.options) as store:
                    self.check_all(store)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------

    def check_all(self, store):
        assert len(store) == len(self.model)
        if self.model:
            keys = sorted(self.model)
            got = store.get(torch.tensor(keys, dtype=torch.int64))
            torch.testing.assert_close(got, torch.stack([self.model[k] for k in keys]), rtol=0, atol=0)

    def apply_put(self, keys, values):
        self.store.put(torch.tensor(keys, dtype=torch.int64), values)
        for k, v in zip(keys, values):
            self.model[k] = v.clone()

    # -- writes ----------------------------------------------------------

    @rule(start=keys_st, n=st.integers(1, 700), step=st.sampled_from([1, 1, 2, 7]), seed=st.integers(0, 2**31))
    def put_range(self, start, n, step, seed):
        keys = [(start + i * step) % KEY_SPACE for i in range(n)]  # wraps around: duplicates when step > 1
        self.apply_put(keys, make_rows(n, seed))

    @rule(keys=st.lists(keys_st, min_size=1, max_size=30), seed=st.integers(0, 2**31))
    def put_list(self, keys, seed):
        keys = keys + keys[: len(keys) // 2]  # always some duplicates: the last one wins
        self.apply_put(keys, make_rows(len(keys), seed))

    @rule(keys=st.lists(keys_st, max_size=40))
    def delete(self, keys):
        expected = len({k for k in keys if k in self.model})
        assert self.store.delete(torch.tensor(keys, dtype=torch.int64)) == expected
        for k in keys:
            self.model.pop(k, None)

    @rule(start=keys_st, n=st.integers(1, 500))
    def delete_range(self, start, n):
        keys = list(range(start, min(start + n, KEY_SPACE)))
        expected = sum(k in self.model for k in keys)
        assert self.store.delete(torch.tensor(keys, dtype=torch.int64)) == expected
        for k in keys:
            self.model.pop(k, None)

    # -- reads -----------------------------------------------------------

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get_present(self, data):
        present = sorted(self.model)
        picks = data.draw(st.lists(st.integers(0, len(present) - 1), min_size=1, max_size=200))
        keys = [present[i] for i in picks]
        got = self.store.get(torch.tensor(keys, dtype=torch.int64))
        torch.testing.assert_close(got, torch.stack([self.model[k] for k in keys]), rtol=0, atol=0)

    @rule(keys=st.lists(keys_st, min_size=1, max_size=20), absent=keys_st)
    def get_with_absent(self, keys, absent):
        self.store.delete(torch.tensor([absent]))
        self.model.pop(absent, None)
        keys = [k for k in keys if k in self.model]
        with pytest.raises(KeyError) as info:
            self.store.get(torch.tensor(keys + [absent], dtype=torch.int64))
        named = str(info.value).strip("'\"").rsplit(": ", 1)[-1].split(", ")
        assert named == [str(absent)], str(info.value)

    @rule(keys=st.lists(keys_st, max_size=50))
    def contains(self, keys):
        found = self.store.contains(torch.tensor(keys, dtype=torch.int64)).tolist()
        assert found == [k in self.model for k in keys]

    @rule(key=keys_st)
    def contains_one(self, key):
        assert (key in self.store) == (key in self.model)

    @rule(start=keys_st, n=st.integers(1, 300))
    def lookahead(self, start, n):
        self.store.lookahead(torch.arange(start, min(start + n, KEY_SPACE)))

    @rule()
    def flush(self):
        self.store.flush()

    @rule()
    def get_everything(self):
        self.check_all(self.store)

    # -- durability and maintenance --------------------------------------

    @rule()
    def checkpoint(self):
        self.store.checkpoint()

    @rule()
    def compact(self):
        self.store.compact()

    @rule(pages=st.sampled_from([4, 8, 16]), index_budget=st.sampled_from([None, 0, 8 << 10]))
    def reopen(self, pages, index_budget=None):
        # The page size is fixed at creation; the budget may change (at least 4 pages), and the index's.
        self.store.close()
        self.options["memory_budget_bytes"] = pages * self.page_bytes
        if index_budget is not None:
            self.options["index_budget_bytes"] = index_budget
        self.store = KVStore(self.path, DIM, **self.options)
        assert len(self.store) == len(self.model)

    @invariant()
    def length_matches(self):
        if self.store is not None:
            assert len(self.store) == len(self.model)
            stats = self.store.stats()
            if stats["base_runs"] == 0:  # stats() counts from memory: exact where no base may hold a log key
                assert stats["rows"] == len(self.model)


StoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreModel = StoreMachine.TestCase


def test_model_reached_disk():
    """The machine's options do push rows to disk (a fixed sequence of its rules)."""
    machine = StoreMachine()
    try:
        machine.open(ratio=0.0, engine="threads", direct_io=True)
        machine.put_range(start=0, n=700, step=1, seed=1)
        machine.put_range(start=700, n=700, step=1, seed=2)
        machine.check_all(machine.store)
        assert machine.store.stats()["disk_rows"] > 0
        machine.delete_range(start=0, n=100)
        machine.lookahead(start=100, n=200)
        machine.flush()
        machine.reopen(pages=4)
        machine.check_all(machine.store)
    finally:
        machine.teardown()
