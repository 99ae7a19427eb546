"""The benchmark scripts still run (their --smoke modes): an API change must not break them silently."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench_embedding.py", "bench_dmp.py", "bench_pipeline.py", "bench_kernel.py",
                                    "bench_gpu.py", "bench_checkpoint.py", "bench_checkpoint.py --runner",
                                    "bench_billion_rows.py", "bench_reopen.py", "bench_input.py",
                                    "bench_replicas.py"])
def test_benchmark_smoke_runs(tmp_path, script):
    script, *extra = script.split()
    if script not in ("bench_embedding.py", "bench_gpu.py", "bench_reopen.py"):
        pytest.importorskip("torchrec")
    output = "--json" if script == "bench_embedding.py" else "--out"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", *extra, output,
                           str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "ERROR" not in done.stdout, done.stdout[-4000:]
    if script == "bench_input.py":  # every stage ran: conversion, stalls with the tuning off and on, loaders alone
        for line in ("conversion of 20,000 rows", "quickstart, auto:", "criteo_kaggle, tuning off",
                     "loader alone, criteo_terabyte"):
            assert line in done.stdout, done.stdout[-4000:]
    if script == "bench_replicas.py":  # two namespaces as two nodes, and a multi-node run resumed from its checkpoint
        assert "| 2 ranks, 1gbit, no replicas |" in done.stdout and ": ok" in done.stdout, done.stdout[-4000:]
        assert "| 2 ranks, 1gbit, replicas 0.05, bounds 1/1 |" in done.stdout, done.stdout[-4000:]
    if extra == ["--runner"]:  # a row for each checkpoint whose steps it compares
        assert "\n| 12 | " in done.stdout, done.stdout[-4000:]
    if script in ("bench_kernel.py", "bench_gpu.py"):  # the disk kernel trains as the in-memory reference does
        assert "| False |" not in done.stdout and "| True |" in done.stdout, done.stdout[-4000:]
