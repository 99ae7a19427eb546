"""The benchmark scripts still run (their --smoke modes): an API change must not break them silently.

Most of a run is one process importing torch, and the suite's other tests leave the second core
idle most of the time: the runs start when the collection ends (tests/conftest.py), one at a time
at a low priority beside the other tests (tests/helpers/background_runs.py), and these tests run
last, where what has not run yet runs two at a time."""
import importlib.util
import sys
from pathlib import Path

import pytest
from background_runs import Run, results

REPO = Path(__file__).resolve().parents[1]


# The longest first, so the two at a time end together.
SCRIPTS = ["bench_input.py", "bench_replicas.py", "bench_pipeline.py", "bench_billion_rows.py", "bench_store.py",
           "bench_reshard.py", "bench_row_wise.py",
           "bench_embedding.py", "bench_dmp.py", "bench_kernel.py", "bench_gpu.py", "bench_checkpoint.py",
           "bench_checkpoint.py --runner", "bench_sequence.py", "bench_virtual.py", "bench_reopen.py",
           "bench_rank_shares.py", "bench_memory.py", "bench_load.py"]


def _run(script: str) -> Run:
    name, *extra = script.split()
    output = "--json" if name in ("bench_embedding.py", "bench_store.py") else "--out"
    return Run(script, [sys.executable, str(REPO / "benchmarks" / name), "--smoke", *extra, output,
                        "{scratch}/out.json"])


def background_runs(items) -> list:
    """The runs of the selected scripts (tests/conftest.py starts them when the collection ends)."""
    if importlib.util.find_spec("torchrec") is None:
        return []
    selected = {item.callspec.params["script"] for item in items}
    return [_run(script) for script in SCRIPTS if script in selected]


@pytest.fixture(scope="module")
def smoke_runs():
    pytest.importorskip("torchrec")
    return results([_run(script) for script in SCRIPTS])


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_runs(smoke_runs, script):
    assert script in smoke_runs, "not run: the runs started without it"
    done = smoke_runs[script]
    script, *extra = script.split()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "ERROR" not in done.stdout, done.stdout[-4000:]
    if script == "bench_input.py":  # every stage ran: conversion, a tuned run, one in memory, the loader alone
        for line in ("conversion of 10,000 rows", "criteo_kaggle, auto:", "criteo_terabyte, in memory:",
                     "parquet_example, in memory:", "loader alone, parquet_example"):
            assert line in done.stdout, done.stdout[-4000:]
    if script == "bench_replicas.py":  # two namespaces as two nodes, and a multi-node run resumed from its checkpoint
        assert "| 2 ranks, 1gbit, no replicas |" in done.stdout and ": ok" in done.stdout, done.stdout[-4000:]
        assert "| 2 ranks, 1gbit, replicas 0.05, bounds 1/1 |" in done.stdout, done.stdout[-4000:]
    if script == "bench_row_wise.py":  # both shardings ran; row-wise spread the reads over both ranks
        assert "| table_wise |" in done.stdout and "| row_wise |" in done.stdout, done.stdout[-4000:]
        assert "row-wise: the busiest rank reads" in done.stdout, done.stdout[-4000:]
    if extra == ["--runner"]:  # a row for each checkpoint whose steps it compares
        assert "\n| 12 | " in done.stdout, done.stdout[-4000:]
    if script == "bench_store.py":  # every storage system gave back the rows written
        assert "every system returns the rows written: all sample checks passed" in done.stdout, done.stdout[-4000:]
    if script == "bench_reshard.py":  # the runner resharded 2 ranks' checkpoint for 4, then 4's for one process
        assert "| 2 -> 4 |" in done.stdout and "| 4 -> 1 |" in done.stdout, done.stdout[-4000:]
    if script == "bench_load.py":  # both ways filled the store, and gave back the rows written
        assert "| put |" in done.stdout and "| load |" in done.stdout, done.stdout[-4000:]
    if script == "bench_sequence.py":  # memory and both disk budgets ran
        assert "| memory |" in done.stdout and "| disk-10% |" in done.stdout, done.stdout[-4000:]
    if script == "bench_virtual.py":  # the three configurations ran, the virtual one evicted
        assert "| virtual |" in done.stdout and "| hashed-memory |" in done.stdout, done.stdout[-4000:]
        assert "distinct raw ids trained on:" in done.stdout, done.stdout[-4000:]
    if script == "bench_rank_shares.py":  # both numberings read by every rank
        for line in ("row_groups_read, all ranks:", "dealt out over all rows, rank 1:"):
            assert line in done.stdout, done.stdout[-4000:]
    if script == "bench_memory.py":  # the populated table trained after its reopen, and the empty tables opened
        assert "| training peak |" in done.stdout and "| 4 empty tables of 2**40 |" in done.stdout, done.stdout[-4000:]
    if script in ("bench_kernel.py", "bench_gpu.py"):  # the disk kernel trains as the in-memory reference does
        assert "| False |" not in done.stdout and "| True |" in done.stdout, done.stdout[-4000:]
