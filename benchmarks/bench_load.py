#!/usr/bin/env python3
"""Filling an empty store from rows in key order: a load (`KVStore.begin_load`, each row written
once, straight into the base run) against puts (each row written to the log, and again when it
moves into the base past the index's budget), in the same run, runs alternating A B A B.

The store is a disk table's as the runner makes it for one large table behind --budget (the log's
share, the index's budget: `memory_budget.split_host_memory`), rows of --dim weights and a row-wise
Adagrad word; filled in chunks of 64k rows, then checkpointed (both synced). Reported per way: the
seconds (median of --repeats), rows/s, the rows written to the base runs and the bytes on disk.

    python benchmarks/bench_load.py [--rows 2000000] [--dim 64] [--budget 67108864] [--repeats 3] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

from common import REPO, dir_bytes, markdown_table, write_json_report

sys.path.insert(0, REPO)
from mlkv_torch import KVStore  # noqa: E402
from mlkv_torch.memory_budget import index_budgets, split_host_memory  # noqa: E402

CHUNK = 1 << 16


def _fill(path: str, rows: torch.Tensor, way: str, log_bytes: int, index_budget: int) -> Dict[str, Any]:
    """Fills a fresh store at `path` with `rows` (keys 0..n-1) by `way`; its figures."""
    shutil.rmtree(path, ignore_errors=True)
    n = rows.shape[0]
    with KVStore(path, rows.shape[1], torch.float32, log_bytes, mutable_fraction=0.5, cut_checkpoints=True,
                 index_budget_bytes=index_budget, key_limit=n) as store:
        began = time.perf_counter()
        if way == "load" and not store.begin_load(n):
            raise SystemExit("a fresh store refused a load")
        for start in range(0, n, CHUNK):
            keys = torch.arange(start, min(start + CHUNK, n))
            (store.load_rows if way == "load" else store.put)(keys, rows[start:start + keys.numel()])
        if way == "load":
            store.end_load()
        store.checkpoint()
        seconds = time.perf_counter() - began
        sample = torch.randint(0, n, (4096,), generator=torch.Generator().manual_seed(0))
        if not torch.equal(store.get(sample), rows[sample]):
            raise SystemExit(f"{way}: the store gives back other rows than were written")
        stats = store.stats()
    return {"seconds": seconds, "base_rows_written": stats["base_rows_written"], "appends": stats["appends"],
            "disk_bytes": dir_bytes(path)}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64 << 20, help="the table batch's memory budget, bytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="100k rows, one repeat")
    parser.add_argument("--out", default="bench-out/bench_load.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats = 100_000, 1
    words = args.dim + 1  # the weights and row-wise Adagrad's word
    split = split_host_memory(args.budget, 1, args.rows, words * 4, True)
    index_budget = index_budgets(split.index_bytes, [args.rows])[0]
    rows = torch.randn(args.rows, words, generator=torch.Generator().manual_seed(1))
    directory = tempfile.mkdtemp(prefix="mlkv-bench-load-")
    runs: Dict[str, List[Dict[str, Any]]] = {"put": [], "load": []}
    try:
        for _ in range(args.repeats):
            for way in ("put", "load"):
                runs[way].append(_fill(os.path.join(directory, way), rows, way, split.log_bytes, index_budget))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures = {way: {"seconds": [r["seconds"] for r in done], "median_seconds": statistics.median(
        r["seconds"] for r in done), **{k: done[-1][k] for k in ("base_rows_written", "appends", "disk_bytes")}}
        for way, done in runs.items()}
    put_seconds = figures["put"]["median_seconds"]
    print("\n".join(markdown_table(
        ["way", "seconds (each run)", "rows/s", "x puts", "rows written to the log", "rows written to base runs",
         "MB on disk"],
        [[way, f"{f['median_seconds']:.2f} ({', '.join(f'{s:.2f}' for s in f['seconds'])})",
          f"{args.rows / f['median_seconds']:,.0f}", f"{put_seconds / f['median_seconds']:.2f}x", f"{f['appends']:,}",
          f"{f['base_rows_written']:,}", f"{f['disk_bytes'] / 1e6:.0f}"] for way, f in figures.items()])))
    write_json_report(os.path.join(REPO, args.out), {"rows": args.rows, "dim": args.dim, "budget": args.budget,
                                                     "log_bytes": split.log_bytes, "index_budget": index_budget,
                                                     "ways": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
