"""Shared fixtures for the KVStore tests.

The default options keep the memory budget far below the data (32 KiB of log
pages: 8 pages of 4 KiB, about 680 rows of dim 8 float32), so a few thousand
keys are enough to push most rows into segment files and run the disk path.
"""
from __future__ import annotations

import inspect
import os
import sys
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import pytest
import torch

from mlkv_torch import KVStore

# Tests import by name, as when tests/ was one folder: the helpers, a worker's constants and a few of each other's
# modules (pytest's default import mode refuses two test files of one name). Child processes that import conftest
# get the same path.
TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in ("helpers", "workers", "engine", "core", "torchrec_integration", "data", "train"):
    if os.path.join(TESTS, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(TESTS, _folder))

import background_runs  # noqa: E402  (tests/helpers, on the path above)

DIM = 8
SMALL_OPTIONS = dict(memory_budget_bytes=32 << 10, expected_rows=1024, segment_bytes=16 << 10)

# Builds with background promotion of hot disk reads: tests that count exact
# memory hits and disk reads turn it off.
HAS_PROMOTE = "promote_hot_reads" in inspect.signature(KVStore.__init__).parameters
NO_PROMOTE = {"promote_hot_reads": False} if HAS_PROMOTE else {}


# torch's vectorized CPU kernels (AVX2, AVX-512) run an add with alpha as one fused multiply-add, as
# our SGD does; its scalar kernel (ATEN_CPU_CAPABILITY=default) rounds the product first.
TORCH_FUSES_MULTIPLY_ADD = torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def rounding_tolerance(steps: int, lr: float, step_bound: float) -> Dict[str, float]:
    """assert_close's tolerances between rows trained by our rule and by a reference that rounds some
    operations differently. torch's CPU sqrt is not correctly rounded (1 ulp off for 0.7% of float32
    values, measured); fbgemm adds Adagrad's eps in double and sums row-wise squares in SIMD lanes;
    torch's coalesce and autograd sum a repeated id's gradients in their own order. Each step then
    differs by a few (4) roundings of the update, at most lr * step_bound, and of the row: over
    `steps` steps, 4 * 2^-24 * steps of each. Where the computation is the same, compare exactly."""
    unit = 4 * 2**-24 * steps
    return {"rtol": unit, "atol": unit * lr * step_bound}


def rows_for(keys: torch.Tensor, tag: int, dim: int = DIM, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic rows that encode (key, tag); identical bits in every process."""
    keys = torch.as_tensor(keys, dtype=torch.int64)
    base = keys.to(torch.float64).unsqueeze(1) * 64 + torch.arange(dim, dtype=torch.float64) + tag * 1e6
    return base.to(dtype)


def _crc32c_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as the store's files are checked: to write files of older formats."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def assert_store_equals(store: KVStore, model: Dict[int, torch.Tensor]) -> None:
    """The store holds exactly the rows of `model` (key -> row tensor)."""
    assert len(store) == len(model)
    stats = store.stats()
    if stats["base_runs"] == 0:  # stats() counts from memory: exact but where a base may hold a log key
        assert stats["rows"] == len(model)
    if not model:
        return
    keys = sorted(model)
    key_tensor = torch.tensor(keys, dtype=torch.int64)
    assert bool(store.contains(key_tensor).all())
    got = store.get(key_tensor)
    expected = torch.stack([model[k] for k in keys])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def assert_reopens_equal(store: KVStore, model: Dict[int, torch.Tensor]) -> None:
    """Closes the store, reopens its path with SMALL_OPTIONS, and checks it holds `model`."""
    store.close()
    with KVStore(store.path, DIM, **SMALL_OPTIONS) as reopened:
        assert_store_equals(reopened, model)


def directory_bytes(path: str) -> Dict[str, bytes]:
    """Every file under a store directory (but the LOCK), name -> contents."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name == "LOCK":
            continue
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A gloo process group of this process alone, for DistributedModelParallel in one process."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def runner_here(capfd) -> Callable[[Sequence[str]], Tuple[int, str]]:
    """runner_here(argv) -> (exit code, stderr): `python -m mlkv_torch.train argv` for one process,
    through its main in this process (no new interpreter importing torch and TorchRec again)."""
    from mlkv_torch.train import main

    def run(argv: Sequence[str]) -> Tuple[int, str]:
        capfd.readouterr()  # the test's own output so far
        code = main(list(argv))
        return code, capfd.readouterr().err
    return run


@pytest.fixture
def open_store(tmp_path):
    """Factory: open_store(path=None, dim=DIM, dtype=float32, **options).

    Small budgets by default; every store it opens is closed at teardown.
    """
    opened = []

    def factory(path=None, dim: int = DIM, dtype: torch.dtype = torch.float32, **options) -> KVStore:
        opts = dict(SMALL_OPTIONS)
        opts.update(options)
        store = KVStore(str(path if path is not None else tmp_path / "store"), dim, dtype, **opts)
        opened.append(store)
        return store

    yield factory
    for store in reversed(opened):
        try:
            store.close()
        except Exception:  # a test may leave a store broken on purpose
            pass


def put_model(store: KVStore, model: Dict[int, torch.Tensor], keys: Iterable[int], values: torch.Tensor) -> None:
    """store.put and the same upsert on the model (last duplicate wins)."""
    keys = list(keys)
    store.put(torch.tensor(keys, dtype=torch.int64), values)
    for k, v in zip(keys, values):
        model[k] = v.clone()


@pytest.fixture(autouse=True)
def _converted_files_in_a_temporary_cache(tmp_path_factory, monkeypatch):
    """Criteo files converted by a test go to a cache of its own, not the user's ~/.cache."""
    monkeypatch.setenv("MLKV_CACHE_DIR", str(tmp_path_factory.mktemp("mlkv-cache")))


# In CI (CI=true, as .ci/run sets) every test runs but the CUDA twins: a test skipped for anything
# else (torchrec or strace missing, a sandbox that blocks ptrace) fails, naming what is missing,
# instead of leaving its claim untested while the run looks green.
REQUIRE_ALL = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SKIPS_ALLOWED_IN_CI = ("no GPU",)


def _refused_skip(report) -> None:
    if not (REQUIRE_ALL and report.skipped):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(allowed in reason for allowed in SKIPS_ALLOWED_IN_CI):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI ({reason}): CI runs every test but the GPU ones; install what it needs "
                       f"(bash scripts/setup.sh installs torchrec; strace is a system package)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refused_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refused_skip(outcome.get_result())


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(session, config, items):
    """The commands some tests check (the benchmarks' smoke runs, the sanitizers) start now, beside
    the other tests, and those tests run last (tests/helpers/background_runs.py says why)."""
    by_module = {}
    for item in items:
        if hasattr(getattr(item, "module", None), "background_runs"):
            by_module.setdefault(item.module, []).append(item)
    if not by_module or config.option.collectonly:
        return
    waiting = [item for module_items in by_module.values() for item in module_items]
    items[:] = [item for item in items if item not in waiting] + waiting
    background_runs.start([run for module, module_items in by_module.items()
                           for run in module.background_runs(module_items)])


def pytest_sessionfinish(session):
    background_runs.stop()
