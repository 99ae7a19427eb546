"""The torch-free engine and cache parts under AddressSanitizer/UBSan and ThreadSanitizer, and the
lock annotations under clang's thread-safety analysis.

Runs scripts/sanitize.sh, which builds csrc/engine and the cache's torch-free parts with
csrc/tests/store_stress.cc (random operation sequences against std::unordered_map, then concurrent
readers, writers, lookahead and checkpoints) and csrc/tests/cache_stress.cc (the admission policy,
slot index, staging area, write-back buffer and read-ahead queue driven from several threads against a
reference model) and csrc/tests/base_run_test.cc (the store's sorted runs against std::map, damaged
files), and fails on any sanitizer report.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("sanitizer", ["asan", "tsan"])
def test_engine_stress_under_sanitizer(sanitizer, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh"), sanitizer], env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert ("8 passed, 0 failed" if sanitizer == "asan" else "6 passed, 0 failed") in output  # store_stress
    assert "12 passed, 0 failed" in output  # cache_stress
    assert "base_run: 14 passed, 0 failed" in output
    assert "ERROR: AddressSanitizer" not in output and "WARNING: ThreadSanitizer" not in output


@pytest.mark.skipif(shutil.which("clang++") is None, reason="needs clang++ (scripts/setup.sh installs it)")
def test_lock_annotations_hold_under_clang_thread_safety_analysis(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHON=sys.executable)
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh"), "threads"], env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "thread-safety analysis: clean" in output
    assert "thread-safety analysis of the cache's torch files: clean" in output
