#!/usr/bin/env python3
"""Benchmarks one large disk table sharded table-wise against row-wise under torchrun: the rows each
rank reads from its stores a step, and the step time, in one run.

Table-wise, one rank owns the table and reads every miss of every rank's batch; row-wise, each rank
owns a block of its rows and reads the misses in its block: a quarter each at 4 ranks, if the ids
spread over the blocks. The table is populated first (every row written to the store), so a row
missing from memory is read from disk, as in a table trained for a while.

    python benchmarks/bench_row_wise.py [--rows 4000000] [--nproc 2] [--steps 60] [--budget 0.1] [--smoke]

Each configuration is a fresh `torchrun -m mlkv_torch.train configs/four_tables_dim64.yaml` with one
table of `--rows` rows x 64 (`storage.sharding_types` forces the sharding); its summary.json gives
samples/s (all steps, one evaluation of 2 batches at the end) and `store_reads_per_step_by_rank`.
One machine: every rank's stores share its disk (4 nodes in network namespaces, each its own disk
path, are still to be run).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List

from common import REPO, markdown_table, runner_summary, write_json_report

DIM = 64
BYTES_PER_ROW = DIM * 4 + 4  # float32 weights and a row-wise Adagrad accumulator
SHARDINGS = ("table_wise", "row_wise")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--budget", type=float, default=0.10, help="memory budget, fraction of the table's bytes")
    ap.add_argument("--depth", default="0", help="the runner's look-ahead depth (0: every miss read in its step)")
    ap.add_argument("--out", default="bench-out/bench_row_wise.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.steps, args.batch = 200_000, 4, 256  # too large for the planner to keep in memory
    # Per rank: what the table-wise owner gets for the whole table (the planner puts it on disk).
    budget = max(1 << 20, int(args.budget * args.rows * BYTES_PER_ROW))
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-row-wise-") as work:
        for sharding in SHARDINGS:
            out = os.path.join(work, sharding)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   "-m", "mlkv_torch.train", os.path.join(REPO, "configs", "four_tables_dim64.yaml"),
                   f"output_dir={out}", f"data.synthetic.cardinalities=[{args.rows}]", "storage.kind=disk",
                   f"storage.sharding_types=[{sharding}]", f"storage.memory_budget_bytes={budget}",
                   "storage.populate=true", f"pipeline.depth={args.depth}", f"train.steps={args.steps}",
                   f"train.batch_size={args.batch}", f"eval.every={args.steps}", "eval.batches=2",
                   f"train.log_every={args.steps}", "--no-progress"]
            summary = runner_summary(cmd, out)
            if summary is None:
                return 1
            results.append({"sharding": sharding, **summary})
            reads = summary["store_reads_per_step_by_rank"]
            print(f"{sharding}: {summary['samples_per_s']:,.0f} samples/s, rows read a step by rank "
                  f"{[round(r) for r in reads]} (populated in {summary['populate_s']:.0f} s)", flush=True)
    table_wise, row_wise = results
    owner = max(table_wise["store_reads_per_step_by_rank"])
    busiest = max(row_wise["store_reads_per_step_by_rank"])
    print(f"\none table of {args.rows:,} rows x {DIM} ({args.rows * BYTES_PER_ROW / 2**20:,.0f} MiB with row-wise "
          f"Adagrad), {args.nproc} ranks, memory budget {budget / 2**20:.1f} MiB a rank, {args.steps} steps of "
          f"{args.batch} a rank, look-ahead depth {args.depth}")
    print("\n".join(markdown_table(
        ["sharding", "samples/s", "x table-wise", "rows read a step, by rank", "busiest rank x owner / ranks",
         "hit rate (rank 0)", "AUC"],
        [[r["sharding"], f"{r['samples_per_s']:,.0f}", f"{r['samples_per_s'] / table_wise['samples_per_s']:.2f}x",
          " / ".join(f"{x:,.0f}" for x in r["store_reads_per_step_by_rank"]),
          f"{max(r['store_reads_per_step_by_rank']) / (owner / args.nproc):.2f}" if owner else "-",
          f"{r['hit_rate']:.1%}" if r.get("hit_rate") is not None else "-", f"{r['auc']:.4f}"] for r in results],
        align="l r r l r r r")))
    if owner:
        print(f"row-wise: the busiest rank reads {busiest / owner:.2f}x what the table-wise owner reads")
    write_json_report(args.out, {"args": vars(args), "budget_bytes": budget, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
