#!/usr/bin/env python3
"""Benchmarks one large disk table sharded table-wise against row-wise under torchrun: the rows each
rank reads from its stores a step, and the step time, in one run.

Table-wise, one rank owns the table and reads every miss of every rank's batch; row-wise, each rank
owns a block of its rows and reads the misses in its block: a quarter each at 4 ranks, if the ids
spread over the blocks. The table is populated first (every row written to the store), so a row
missing from memory is read from disk, as in a table trained for a while.

    python benchmarks/bench_row_wise.py [--rows 4000000] [--nproc 2] [--steps 60] [--budget 0.1] [--smoke]
    sudo python benchmarks/bench_row_wise.py --nodes 4 [--rate 1gbit] [--rows 20000000] [--dir DIR]

Each configuration is a fresh `torchrun -m mlkv_torch.train configs/four_tables_dim64.yaml` with one
table of `--rows` rows x 64 (`storage.sharding_types` forces the sharding); its summary.json gives
the step time (the runner's train seconds over its steps), samples/s (all steps, one evaluation of
2 batches at the end) and `store_reads_per_step_by_rank`. By default `--nproc` ranks on this
machine, their stores in one directory. With `--nodes N` (root, `ip netns`), a multi-node torchrun
job of N nodes, each a network namespace (`shaped_network.py`; links unshaped unless `--rate`) with
one rank and its tables in its own `storage.path`, only `output_dir` shared. The namespaces part the
network only: the nodes still share this machine's cores and disk.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

from common import REPO, markdown_table, runner_summary, write_json_report
from shaped_network import ShapedNetwork, available, run_job

DIM = 64
BYTES_PER_ROW = DIM * 4 + 4  # float32 weights and a row-wise Adagrad accumulator
SHARDINGS = ("table_wise", "row_wise")
CONFIG = os.path.join(REPO, "configs", "four_tables_dim64.yaml")
NET_PREFIX = "mlkv-rw"  # not bench_replicas' namespaces: a run of it at the same time keeps its own

Summary = Optional[Dict[str, Any]]


def runner_overrides(args: argparse.Namespace, sharding: str, budget: int) -> List[str]:
    """The runner's keys of one configuration, the same on one machine and across nodes."""
    return [f"data.synthetic.cardinalities=[{args.rows}]", "storage.kind=disk",
            f"storage.sharding_types=[{sharding}]", f"storage.memory_budget_bytes={budget}",
            "storage.populate=true", f"pipeline.depth={args.depth}", f"train.steps={args.steps}",
            f"train.batch_size={args.batch}", f"eval.every={args.steps}", "eval.batches=2",
            f"train.log_every={args.steps}"]


def compare(args: argparse.Namespace, ranks: int, budget: int, where: str, run: Callable[[str], Summary]) -> int:
    """Runs each sharding with `run(sharding)` (its summary, or None if it failed), prints the
    comparison and writes the JSON report."""
    results: List[Dict[str, Any]] = []
    for sharding in SHARDINGS:
        summary = run(sharding)
        if summary is None:
            return 1
        summary["step_ms"] = summary["train_seconds"] / summary["steps"] * 1e3
        results.append({"sharding": sharding, **summary})
        reads = summary["store_reads_per_step_by_rank"]
        print(f"{sharding}: {summary['samples_per_s']:,.0f} samples/s, {summary['step_ms']:.1f} ms a step, rows "
              f"read a step by rank {[round(r) for r in reads]} (populated in {summary['populate_s']:.0f} s)",
              flush=True)
    table_wise, row_wise = results
    owner = max(table_wise["store_reads_per_step_by_rank"])
    busiest = max(row_wise["store_reads_per_step_by_rank"])
    # Each row-wise rank's reads against its even share of what the table-wise owner reads: 1.00 each if spread.
    shares = [r / (owner / ranks) for r in row_wise["store_reads_per_step_by_rank"]] if owner else None
    print(f"\none table of {args.rows:,} rows x {DIM} ({args.rows * BYTES_PER_ROW / 2**20:,.0f} MiB with row-wise "
          f"Adagrad), {ranks} ranks {where}, memory budget {budget / 2**20:.1f} MiB a rank, {args.steps} steps of "
          f"{args.batch} a rank, look-ahead depth {args.depth}")
    print("\n".join(markdown_table(
        ["sharding", "step (ms)", "samples/s", "x table-wise", "rows read a step, by rank",
         "busiest rank x owner / ranks", "hit rate (rank 0)", "AUC"],
        [[r["sharding"], f"{r['step_ms']:.1f}", f"{r['samples_per_s']:,.0f}",
          f"{r['samples_per_s'] / table_wise['samples_per_s']:.2f}x",
          " / ".join(f"{x:,.0f}" for x in r["store_reads_per_step_by_rank"]),
          f"{max(r['store_reads_per_step_by_rank']) / (owner / ranks):.2f}" if owner else "-",
          f"{r['hit_rate']:.1%}" if r.get("hit_rate") is not None else "-", f"{r['auc']:.4f}"] for r in results],
        align="l r r r l r r r")))
    if shares is not None:
        print(f"row-wise: each rank's reads x (owner / {ranks}): {' / '.join(f'{s:.2f}' for s in shares)}")
        print(f"row-wise: the busiest rank reads {busiest / owner:.2f}x what the table-wise owner reads "
              f"(1/{ranks} = {1 / ranks:.2f} if the ids spread evenly); a step takes {row_wise['step_ms']:.1f} ms "
              f"against {table_wise['step_ms']:.1f} ms table-wise ({table_wise['step_ms'] / row_wise['step_ms']:.2f}x "
              f"as fast)")
    write_json_report(args.out, {"args": vars(args), "ranks": ranks, "budget_bytes": budget,
                                 "row_wise_reads_x_owner_share": shares, "results": results})
    return 0


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--nproc", type=int, default=2, help="ranks on this machine (without --nodes)")
    ap.add_argument("--nodes", type=int, default=0,
                    help="N > 0: a multi-node job, N network namespaces of one rank each (root); 0: --nproc ranks")
    ap.add_argument("--rate", default=None, help="with --nodes, each link's rate (tc units: 1gbit; default unshaped)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--budget", type=float, default=0.10, help="memory budget, fraction of the table's bytes")
    ap.add_argument("--depth", default="0", help="the runner's look-ahead depth (0: every miss read in its step)")
    ap.add_argument("--dir", default=None, help="where runs and their tables go (default: a temporary directory)")
    ap.add_argument("--out", default="bench-out/bench_row_wise.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.steps, args.batch = 200_000, 4, 256  # too large for the planner to keep in memory
    # Per rank (the runner's budget is each rank's): what the table-wise owner gets for the whole
    # table (the planner puts it on disk).
    budget = max(1 << 20, int(args.budget * args.rows * BYTES_PER_ROW))
    if args.nodes <= 0:
        with tempfile.TemporaryDirectory(prefix="bench-row-wise-", dir=args.dir) as work:
            def one_machine(sharding: str) -> Summary:
                out = os.path.join(work, sharding)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={args.nproc}", "-m", "mlkv_torch.train", CONFIG, f"output_dir={out}",
                       *runner_overrides(args, sharding, budget), "--no-progress"]
                return runner_summary(cmd, out)

            return compare(args, args.nproc, budget, "on one machine", one_machine)
    why_not = available()
    if why_not:
        print(f"bench_row_wise --nodes {args.nodes} makes a network namespace a node and {why_not}; run it as root, "
              f"or without --nodes for --nproc ranks on this machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-row-wise-", dir=args.dir) as work, \
            ShapedNetwork(args.nodes, args.rate, prefix=NET_PREFIX) as net:
        def across_nodes(sharding: str) -> Summary:
            out = os.path.join(work, sharding)
            os.makedirs(out)
            try:
                return run_job(net, CONFIG, out, os.path.join(out, "tables"), runner_overrides(args, sharding, budget))
            except RuntimeError as e:  # a node failed: its log's end
                print(e, file=sys.stderr)
                return None

        where = (f"on {args.nodes} nodes (network namespaces, links {args.rate or 'unshaped'}; "
                 "one machine's cores and disk)")
        return compare(args, args.nodes, budget, where, across_nodes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
