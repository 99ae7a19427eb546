#!/usr/bin/env python3
"""Benchmarks what each rank reads of a Parquet dataset: its own share of the rows against batches
dealt out in turn over all of them.

A generated dataset of parquet_example.yaml's layout (--rows rows, 40 columns, 20 declared, row
groups of --row-group-rows) is read by the loader of each rank of --world ranks in turn, one
process a rank, for one epoch of its batches (shuffle window 16, as the config has): row groups
decoded, bytes read from the files (/proc/self/io), samples/s. Against the same run's reference:
the batches numbered over all the rows (world 1 in ShuffledRows, step s of rank r training batch
s * world + r), where every rank's batches fall in every window's row groups.

    python benchmarks/bench_rank_shares.py [--rows 4000000] [--world 2] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from common import REPO, write_json_report


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def child(root: str, world: int, rank: int, shares: bool) -> Dict[str, Any]:
    """One rank's epoch of batches through its BatchLoader (the tuner's choices)."""
    sys.path.insert(0, REPO)
    from mlkv_torch.config import load_config
    from mlkv_torch.data.loader import BatchLoader
    from mlkv_torch.data.parquet import ParquetBatches
    from mlkv_torch.train.sources import batch_source, input_cpu_budget, loader_tuner
    from mlkv_torch.train import torch_threads

    config = load_config(os.path.join(REPO, "configs", "parquet_example.yaml"),
                         ["output_dir=/unused", f"data.parquet.train=[{root}]", "data.parquet.eval=[]"])
    threads = torch_threads(config)
    source = batch_source(config, input_cpu_budget(config, threads), world if shares else 1)
    batches = source.train_batches
    schema = (batches.files, batches.batch_size, batches.label, batches.dense, batches.sparse)
    if not shares:  # the numbering over all rows, the rank's own numbers from it
        batches = ParquetBatches(*schema, shuffle_window=config.data.parquet.shuffle_window,
                                 seed=config.data.parquet.seed)
    count = batches.batches_per_epoch // world
    # A batch of another reader first: the modules its making imports are not counted as the dataset's bytes.
    ParquetBatches(*schema)(0)
    read_before = _bytes_read()
    began = time.perf_counter()
    loader = BatchLoader(batches, first=rank, count=count, stride=world, tuner=loader_tuner(config, threads))
    delivered = sum(1 for _ in loader)
    seconds = time.perf_counter() - began
    return {"batches": delivered, "samples_per_s": delivered * batches.batch_size / seconds, "seconds": seconds,
            "row_groups_read": batches.row_groups_read, "row_groups": batches.row_groups,
            "bytes_read": _bytes_read() - read_before, "declared_bytes_per_epoch": batches.bytes_read_per_epoch,
            "workers": loader.stats()["workers"]}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--row-group-rows", type=int, default=65536)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a small dataset, to check the script runs")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "rank_shares.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    if args.smoke:
        args.rows, args.row_group_rows = 200_000, 8192
    work = tempfile.mkdtemp(prefix="rank_shares-")
    try:
        sys.path.insert(0, REPO)
        from mlkv_torch.data.parquet_generate import generate

        root = os.path.join(work, "train")
        generate(root, args.rows, files=4, row_group_rows=args.row_group_rows)
        report: Dict[str, Any] = {"rows": args.rows, "row_group_rows": args.row_group_rows, "world": args.world}
        for shares in (True, False):
            label = "its own share" if shares else "batches dealt out over all rows"
            ranks = []
            for rank in range(args.world):
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                       json.dumps([root, args.world, rank, shares])],
                                      capture_output=True, text=True, check=True)
                ranks.append(json.loads(done.stdout.strip().splitlines()[-1]))
                r = ranks[-1]
                print(f"world {args.world}, {label}, rank {rank}: {r['row_groups_read']} of {r['row_groups']} row "
                      f"groups decoded, {r['bytes_read'] / 2**20:.1f} MiB read, {r['samples_per_s']:,.0f} samples/s "
                      f"({r['batches']} batches, {r['workers']} thread(s))", flush=True)
            report["shares" if shares else "dealt_out"] = ranks
        for key in ("row_groups_read", "bytes_read"):
            ours = sum(r[key] for r in report["shares"])
            theirs = sum(r[key] for r in report["dealt_out"])
            print(f"{key}, all ranks: {ours:,} with shares, {theirs:,} dealt out ({ours / theirs:.2f}x)")
        rate = [sum(r["samples_per_s"] for r in report[k]) / args.world for k in ("shares", "dealt_out")]
        print(f"samples/s a rank: {rate[0]:,.0f} with shares, {rate[1]:,.0f} dealt out ({rate[0] / rate[1]:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json_report(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
