"""The benchmark scripts still run (their --smoke modes): an API change must not break them silently."""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# The longest first, so the two at a time end together.
SCRIPTS = ["bench_input.py", "bench_replicas.py", "bench_pipeline.py", "bench_billion_rows.py", "bench_row_wise.py",
           "bench_embedding.py", "bench_dmp.py", "bench_kernel.py", "bench_gpu.py", "bench_checkpoint.py",
           "bench_checkpoint.py --runner", "bench_sequence.py", "bench_virtual.py", "bench_reopen.py"]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Every script's --smoke run, two at a time: most of each is one process importing torch, and the
    suite's other tests leave the second core idle."""
    pytest.importorskip("torchrec")

    def run(script: str) -> subprocess.CompletedProcess:
        name, *extra = script.split()
        output = "--json" if name == "bench_embedding.py" else "--out"
        out = tmp_path_factory.mktemp(name.replace(".", "_")) / "out.json"
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / name), "--smoke", *extra, output, str(out)],
                              capture_output=True, text=True, timeout=600, cwd=REPO)

    tmp_path_factory.getbasetemp()  # made here: two threads making it at once disagree on where it is
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(SCRIPTS, pool.map(run, SCRIPTS)))


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_runs(smoke_runs, script):
    done = smoke_runs[script]
    script, *extra = script.split()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "ERROR" not in done.stdout, done.stdout[-4000:]
    if script == "bench_input.py":  # every stage ran: conversion, stalls with the tuning off and on, loaders alone
        for line in ("conversion of 10,000 rows", "quickstart, in memory:", "criteo_kaggle, tuning off",
                     "criteo_kaggle, auto:",
                     "loader alone, criteo_terabyte"):
            assert line in done.stdout, done.stdout[-4000:]
    if script == "bench_replicas.py":  # two namespaces as two nodes, and a multi-node run resumed from its checkpoint
        assert "| 2 ranks, 1gbit, no replicas |" in done.stdout and ": ok" in done.stdout, done.stdout[-4000:]
        assert "| 2 ranks, 1gbit, replicas 0.05, bounds 1/1 |" in done.stdout, done.stdout[-4000:]
    if script == "bench_row_wise.py":  # both shardings ran; row-wise spread the reads over both ranks
        assert "| table_wise |" in done.stdout and "| row_wise |" in done.stdout, done.stdout[-4000:]
        assert "row-wise: the busiest rank reads" in done.stdout, done.stdout[-4000:]
    if extra == ["--runner"]:  # a row for each checkpoint whose steps it compares
        assert "\n| 12 | " in done.stdout, done.stdout[-4000:]
    if script == "bench_sequence.py":  # memory and both disk budgets ran
        assert "| memory |" in done.stdout and "| disk-10% |" in done.stdout, done.stdout[-4000:]
    if script == "bench_virtual.py":  # the three configurations ran, the virtual one evicted
        assert "| virtual |" in done.stdout and "| hashed-memory |" in done.stdout, done.stdout[-4000:]
        assert "distinct raw ids trained on:" in done.stdout, done.stdout[-4000:]
    if script in ("bench_kernel.py", "bench_gpu.py"):  # the disk kernel trains as the in-memory reference does
        assert "| False |" not in done.stdout and "| True |" in done.stdout, done.stdout[-4000:]
