"""The torch-free engine and cache parts under AddressSanitizer/UBSan and ThreadSanitizer, and the
lock annotations under clang's thread-safety analysis.

Runs scripts/sanitize.sh, which builds csrc/engine and the cache's torch-free parts with
csrc/tests/store_stress.cc (random operation sequences against std::unordered_map, then concurrent
readers, writers, lookahead and checkpoints) and csrc/tests/cache_stress.cc (the admission policy,
slot index, staging area, write-back buffer and read-ahead queue driven from several threads against a
reference model) and csrc/tests/base_run_test.cc (the store's sorted runs against std::map, damaged
files), and fails on any sanitizer report.

The builds are minutes of CPU on cores the other tests leave idle: they start when the collection
ends, beside the other tests at the lowest priority (tests/helpers/background_runs.py), and these
tests run last, waiting for them.
"""
import shutil
import sys

import pytest
from background_runs import Run, results

ASAN_TSAN = ["asan", "tsan"]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
needs_clang = pytest.mark.skipif(shutil.which("clang++") is None,
                                 reason="needs clang++ (scripts/setup.sh installs it)")


def _run(check: str) -> Run:
    return Run(f"sanitize {check}", ["bash", "scripts/sanitize.sh", check],
               {"TMPDIR": "{scratch}", "PYTHON": sys.executable})


def background_runs(items) -> list:
    """The checks of the selected tests (tests/conftest.py starts them when the collection ends)."""
    checks = {item.callspec.params["sanitizer"] if hasattr(item, "callspec") else "threads" for item in items}
    available = {"asan": shutil.which("g++"), "tsan": shutil.which("g++"), "threads": shutil.which("clang++")}
    return [_run(check) for check in ("tsan", "asan", "threads") if check in checks and available[check]]


def _done(check: str) -> str:
    done = results([_run(c) for c in ("tsan", "asan", "threads")])[f"sanitize {check}"]
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@needs_gxx
@pytest.mark.parametrize("sanitizer", ASAN_TSAN)
def test_engine_stress_under_sanitizer(sanitizer):
    output = _done(sanitizer)
    assert ("8 passed, 0 failed" if sanitizer == "asan" else "6 passed, 0 failed") in output  # store_stress
    assert "12 passed, 0 failed" in output  # cache_stress
    assert "base_run: 14 passed, 0 failed" in output
    assert "ERROR: AddressSanitizer" not in output and "WARNING: ThreadSanitizer" not in output


@needs_clang
def test_lock_annotations_hold_under_clang_thread_safety_analysis():
    output = _done("threads")
    assert "thread-safety analysis: clean" in output
    assert "thread-safety analysis of the cache's torch files: clean" in output
