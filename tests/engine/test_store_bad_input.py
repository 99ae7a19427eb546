"""Every bad input is refused with the right exception type and a message that
names the problem, and a refused call changes nothing."""
from __future__ import annotations

import os

import pytest
import torch

from mlkv_torch import KVStore

from conftest import DIM, SMALL_OPTIONS, directory_bytes, rows_for

BASE = 100


@pytest.fixture
def store(open_store):
    s = open_store()
    s.put(torch.arange(BASE), rows_for(torch.arange(BASE), 0))
    return s


def assert_unchanged(store):
    assert len(store) == BASE
    torch.testing.assert_close(store.get(torch.arange(BASE)), rows_for(torch.arange(BASE), 0), rtol=0, atol=0)
    assert store.stats()["rows"] == BASE


# --- keys ----------------------------------------------------------------

BAD_KEYS = [
    pytest.param(torch.tensor([1.0, 2.0]), TypeError, "int64", id="float32"),
    pytest.param(torch.tensor([1, 2], dtype=torch.int32), TypeError, "int64", id="int32"),
    pytest.param(torch.tensor([1, 2], dtype=torch.uint8), TypeError, "int64", id="uint8"),
    pytest.param(torch.tensor([True, False]), TypeError, "int64", id="bool"),
    pytest.param([1.5, 2.0], TypeError, "int64", id="list-of-floats"),
    pytest.param(torch.tensor([[1, 2]]), ValueError, "1-D", id="2-D"),
    pytest.param(torch.tensor(3), ValueError, "1-D", id="0-D"),
    pytest.param(torch.tensor([4, -1, 5]), ValueError, "non-negative", id="negative"),
    pytest.param([-(2**63)], ValueError, "non-negative", id="int64-min"),
]


@pytest.mark.parametrize("keys,error,match", BAD_KEYS)
def test_bad_keys_put(store, keys, error, match):
    n = torch.as_tensor(keys).numel()
    with pytest.raises(error, match=match):
        store.put(keys, rows_for(torch.arange(n), 1))
    assert_unchanged(store)


@pytest.mark.parametrize("keys,error,match", BAD_KEYS)
@pytest.mark.parametrize("method", ["get", "contains", "delete", "lookahead"])
def test_bad_keys_other_methods(store, keys, error, match, method):
    with pytest.raises(error, match=match):
        getattr(store, method)(keys)
    store.flush()
    assert_unchanged(store)


def test_negative_key_in_a_batch_changes_nothing(store):
    keys = torch.tensor([0, 1, 500, -3, 501])
    with pytest.raises(ValueError, match=r"keys\[3\] = -3"):
        store.put(keys, rows_for(keys.abs(), 9))
    with pytest.raises(ValueError, match="non-negative"):
        store.delete(torch.tensor([0, 1, -2]))
    assert 500 not in store
    assert_unchanged(store)


# --- values --------------------------------------------------------------

BAD_VALUES = [
    pytest.param(torch.zeros(3, DIM, dtype=torch.float64), TypeError, "float32", id="float64"),
    pytest.param(torch.zeros(3, DIM, dtype=torch.float16), TypeError, "float32", id="float16"),
    pytest.param(torch.zeros(3, DIM, dtype=torch.int64), TypeError, "float32", id="int64"),
    pytest.param([[0.0] * DIM] * 3, TypeError, "torch.Tensor", id="list"),
    pytest.param(torch.zeros(3, DIM + 1), ValueError, r"shape \[3, 8\]", id="wide"),
    pytest.param(torch.zeros(3, DIM - 1), ValueError, r"shape \[3, 8\]", id="narrow"),
    pytest.param(torch.zeros(2, DIM), ValueError, r"shape \[3, 8\]", id="too-few-rows"),
    pytest.param(torch.zeros(4, DIM), ValueError, r"shape \[3, 8\]", id="too-many-rows"),
    pytest.param(torch.zeros(3 * DIM), ValueError, r"shape \[3, 8\]", id="flat"),
    pytest.param(torch.zeros(3, 2, DIM // 2), ValueError, r"shape \[3, 8\]", id="3-D"),
    pytest.param(torch.zeros(1, DIM), ValueError, r"shape \[3, 8\]", id="broadcastable"),
]


@pytest.mark.parametrize("values,error,match", BAD_VALUES)
def test_bad_values(store, values, error, match):
    with pytest.raises(error, match=match):
        store.put(torch.tensor([0, 1, 200]), values)
    assert 200 not in store
    assert_unchanged(store)


def test_values_for_empty_keys_must_be_empty(store):
    with pytest.raises(ValueError, match=r"shape \[0, 8\]"):
        store.put(torch.empty(0, dtype=torch.int64), torch.zeros(1, DIM))
    assert_unchanged(store)


# --- paths ---------------------------------------------------------------


def test_path_is_a_regular_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a store")
    with pytest.raises(ValueError, match="not a directory"):
        KVStore(str(path), DIM, **SMALL_OPTIONS)
    assert path.read_bytes() == b"not a store"


def test_path_under_a_regular_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="cannot create store directory"):
        KVStore(str(path / "store"), DIM, **SMALL_OPTIONS)
    assert path.read_bytes() == b"x"


def test_path_of_wrong_type(tmp_path):
    with pytest.raises(TypeError, match="path"):
        KVStore(123, DIM, **SMALL_OPTIONS)


NOT_WRITABLE_CHILD = """
import os, sys
from mlkv_torch import KVStore
try:
    KVStore(os.path.join(sys.argv[1], "store"), 8, memory_budget_bytes=32 << 10)
except ValueError as e:
    print("REFUSED", e)
"""


def test_path_not_writable(tmp_path):
    import subprocess
    import sys

    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    # Root writes anywhere: as root the child runs without the capability to override permissions.
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    try:
        run = subprocess.run([*drop, sys.executable, "-c", NOT_WRITABLE_CHILD, str(parent)], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "REFUSED" in run.stdout and str(parent) in run.stdout, run.stdout + run.stderr
        assert not (parent / "store").exists()
    finally:
        parent.chmod(0o700)


# --- reopening -----------------------------------------------------------


@pytest.mark.parametrize("dim,dtype,match", [
    (DIM + 1, torch.float32, "dim"),
    (DIM - 1, torch.float32, "dim"),
    (DIM, torch.float16, "float32 rows, opened with float16"),
    (DIM, torch.bfloat16, "float32 rows, opened with bfloat16"),
    (DIM * 2, torch.float16, "dim"),  # same row bytes, other shape
])
def test_reopen_with_other_dim_or_dtype(tmp_path, dim, dtype, match):
    path = str(tmp_path / "store")
    with KVStore(path, DIM, **SMALL_OPTIONS) as s:
        s.put(torch.arange(BASE), rows_for(torch.arange(BASE), 0))
    before = directory_bytes(path)
    with pytest.raises(ValueError, match=match):
        KVStore(path, dim, dtype, **SMALL_OPTIONS)
    assert directory_bytes(path) == before
    with KVStore(path, DIM, **SMALL_OPTIONS) as s:  # the failed open let go of the path
        assert_unchanged(s)


def test_same_path_opened_twice(tmp_path, store):
    with pytest.raises(ValueError, match="already open"):
        KVStore(store.path, DIM, **SMALL_OPTIONS)
    with pytest.raises(ValueError, match="already open"):
        KVStore(store.path + "/", DIM, **SMALL_OPTIONS)  # the same directory, spelled otherwise
    assert_unchanged(store)
    store.put(torch.tensor([BASE]), rows_for(torch.tensor([BASE]), 0))
    store.delete(torch.tensor([BASE]))
    store.close()
    with KVStore(store.path, DIM, **SMALL_OPTIONS) as again:  # free once closed
        assert_unchanged(again)


# --- closed store --------------------------------------------------------

CLOSED_CALLS = {
    "put": lambda s: s.put(torch.tensor([1]), torch.zeros(1, DIM)),
    "get": lambda s: s.get(torch.tensor([1])),
    "contains": lambda s: s.contains(torch.tensor([1])),
    "in": lambda s: 1 in s,
    "delete": lambda s: s.delete(torch.tensor([1])),
    "lookahead": lambda s: s.lookahead(torch.tensor([1])),
    "checkpoint": lambda s: s.checkpoint(),
    "compact": lambda s: s.compact(),
}


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_operations_after_close(tmp_path, call):
    path = str(tmp_path / "store")
    s = KVStore(path, DIM, **SMALL_OPTIONS)
    s.put(torch.arange(BASE), rows_for(torch.arange(BASE), 0))
    s.close()
    before = directory_bytes(path)
    with pytest.raises(ValueError, match="closed"):
        CLOSED_CALLS[call](s)
    s.close()  # still idempotent
    assert directory_bytes(path) == before
    with KVStore(path, DIM, **SMALL_OPTIONS) as again:
        assert_unchanged(again)


# --- options -------------------------------------------------------------

BAD_OPTIONS = [
    pytest.param(dict(io_engine="aio"), ValueError, "io_engine", id="io_engine"),
    pytest.param(dict(io_engine=""), ValueError, "io_engine", id="io_engine-empty"),
    pytest.param(dict(memory_budget_bytes=8 << 10), ValueError, "fewer than 4 log pages", id="budget-too-small"),
    pytest.param(dict(memory_budget_bytes=64 << 10, page_bytes=32 << 10), ValueError, "fewer than 4 log pages",
                 id="budget-too-small-for-pages"),
    pytest.param(dict(memory_budget_bytes=0), ValueError, "memory_budget_bytes", id="budget-zero"),
    pytest.param(dict(memory_budget_bytes=-1), ValueError, "memory_budget_bytes", id="budget-negative"),
    pytest.param(dict(page_bytes=1000), ValueError, "page_bytes must be a multiple of 4096", id="page-unaligned"),
    pytest.param(dict(mutable_fraction=0.0), ValueError, "mutable_fraction", id="mutable-zero"),
    pytest.param(dict(mutable_fraction=1.0), ValueError, "mutable_fraction", id="mutable-one"),
    pytest.param(dict(compaction_ratio=1.0), ValueError, "compaction_ratio", id="ratio-below-1.2"),
    pytest.param(dict(compaction_ratio=-2.0), ValueError, "compaction_ratio", id="ratio-negative"),
    pytest.param(dict(io_depth=0), ValueError, "positive", id="io_depth-zero"),
    pytest.param(dict(io_depth=5000), ValueError, "io_depth", id="io_depth-huge"),
    pytest.param(dict(io_threads=0, io_engine="threads"), ValueError, "positive", id="io_threads-zero"),
    pytest.param(dict(segment_bytes=0), ValueError, "positive", id="segment-zero"),
    pytest.param(dict(io_depth=2.5), TypeError, "io_depth", id="io_depth-float"),
    pytest.param(dict(memory_budget_bytes=True), TypeError, "memory_budget_bytes", id="budget-bool"),
    # Past what an index can be sized for: once a segfault (the bucket bytes wrapped around).
    pytest.param(dict(expected_rows=17 * 2**56), ValueError, "expected_rows must be at most", id="expected-rows-huge"),
    # 32-bit options: once cut to their low bits (2**32 read as 0).
    pytest.param(dict(io_depth=2**32), ValueError, "io_depth must be at most 4294967295, got 4294967296",
                 id="io_depth-past-32-bits"),
    pytest.param(dict(io_threads=2**32, io_engine="threads"), ValueError, "io_threads must be at most",
                 id="io_threads-past-32-bits"),
]


@pytest.mark.parametrize("options,error,match", BAD_OPTIONS)
def test_bad_options(tmp_path, options, error, match):
    path = str(tmp_path / "store")
    with pytest.raises(error, match=match):
        KVStore(path, DIM, **dict(SMALL_OPTIONS, **options))
    # The path is free afterwards and no checkpoint was written.
    assert not os.path.exists(os.path.join(path, "CHECKPOINT"))
    with KVStore(path, DIM, **SMALL_OPTIONS) as s:
        assert len(s) == 0


@pytest.mark.parametrize("dim,dtype,error,match", [
    (0, torch.float32, ValueError, "dim"),
    (-3, torch.float32, ValueError, "dim"),
    (2.0, torch.float32, TypeError, "dim"),
    (2**32 + 8, torch.float32, ValueError, "dim must be at most 4294967295"),  # once a store of dim 8
    (DIM, torch.float64, TypeError, "dtype"),
    (DIM, torch.int64, TypeError, "dtype"),
])
def test_bad_dim_or_dtype(tmp_path, dim, dtype, error, match):
    with pytest.raises(error, match=match):
        KVStore(str(tmp_path / "store"), dim, dtype, **SMALL_OPTIONS)
