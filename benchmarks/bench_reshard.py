#!/usr/bin/env python3
"""Resuming a checkpoint on another number of ranks (`--resume`), against the store's own
sequential read of the same rows, in the same run.

The runner under torchrun trains DLRM with one large table of --rows rows x --dim (row-wise Adagrad
state, sharded row-wise over the ranks, on disk behind a small budget) and small ones, populated,
and checkpoints; the checkpoint is then resumed on the other world sizes in turn (--worlds, e.g.
2 -> 4 -> 2), each resume resharding every table and training one step. Reported per reshard: its
seconds (the runner's own figure: filling the new plan's tables and checkpointing them), the rows
it moved per second against the store's sequential read rate (every stored shard of the large
table read back with `read_shard`, read-only, just before), and rank 0's peak RSS against the
budget (the page cache holds the freshly written stores for both: the ratio compares the reshard's
work with a plain read of the same rows).

    python benchmarks/bench_reshard.py [--rows 2000000] [--dim 64] [--worlds 2,4,2] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from common import REPO, markdown_table, write_json_report

BUDGET = 64 << 20


def _run(out: str, world: int, steps: int, args: argparse.Namespace, *extra: str) -> subprocess.CompletedProcess:
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
                                 if world > 1 else [])
    cmd = launch + ["-m", "mlkv_torch.train", os.path.join(REPO, "configs", "quickstart.yaml"), f"output_dir={out}",
                    f"data.synthetic.cardinalities=[{args.rows},1000,1000]", "data.synthetic.scale=1",
                    f"model.embedding_dim={args.dim}", "model.dense_arch=[64," + str(args.dim) + "]",
                    "storage.sharding_types=[row_wise]", f"storage.memory_budget_bytes={BUDGET}",
                    f"train.steps={steps}", "train.checkpoint_every=1", "train.batch_size=256", "eval.batches=1",
                    "eval.every=1000", "--no-progress", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the runner failed:\n{done.stderr[-4000:]}")
    return done


def _sequential_read(out: str) -> Dict[str, float]:
    """Rows/s of reading every stored shard of the large table back with `read_shard`."""
    sys.path.insert(0, REPO)
    from mlkv_torch.stored_shards import read_shard
    from mlkv_torch.train.checkpoint_tables import row_layout_of, written_checkpoint

    written = written_checkpoint(out)
    entry = written.tables["t_cat_0"]
    began, rows = time.perf_counter(), 0
    for shard in written.disk_shards("t_cat_0"):
        for ids, _, _ in read_shard(shard, row_layout_of(entry, shard.columns)):
            rows += ids.numel()
    seconds = time.perf_counter() - began
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--worlds", default="2,4,2", help="world sizes in turn (1: one process, no torchrun)")
    parser.add_argument("--smoke", action="store_true", help="100k rows, worlds 2,4,1")
    parser.add_argument("--out", default="bench-out/bench_reshard.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.worlds = 100_000, "2,4,1"
    worlds = [int(w) for w in args.worlds.split(",")]
    directory = tempfile.mkdtemp(prefix="mlkv-bench-reshard-")
    out = os.path.join(directory, "run")
    try:
        began = time.perf_counter()
        _run(out, worlds[0], 1, args, "storage.populate=true")
        print(f"[bench] {args.rows:,} rows x {args.dim} written by {worlds[0]} ranks in "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr)
        rows_moved = args.rows + 2000
        reshards: List[Dict[str, Any]] = []
        for step, (source, target) in enumerate(zip(worlds, worlds[1:]), start=1):
            read = _sequential_read(out)
            done = _run(out, target, step + 1, args, "--resume")
            found = re.search(r"resharded for .* in ([0-9.]+) s \(([0-9.]+) s filling", done.stderr)
            seconds, filling = float(found.group(1)), float(found.group(2))
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            reshards.append({"from": source, "to": target, "seconds": seconds, "filling_seconds": filling,
                             "rows": rows_moved, "filling_rows_per_s": rows_moved / filling,
                             "rows_per_s": rows_moved / seconds, "sequential_read_rows_per_s": read["rows_per_s"],
                             "over_sequential_read": rows_moved / seconds / read["rows_per_s"],
                             "rank0_peak_rss_bytes": summary["peak_rss_bytes"], "budget_bytes": BUDGET})
            print(f"[bench] {source} -> {target}: {seconds:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("\n".join(markdown_table(["reshard", "seconds (filling)", "rows/s", "store's sequential read, rows/s",
                                    "ratio", "rank 0 peak RSS, MiB"],
                         [[f"{r['from']} -> {r['to']}", f"{r['seconds']:.1f} ({r['filling_seconds']:.1f})",
                           f"{r['rows_per_s']:,.0f}",
                           f"{r['sequential_read_rows_per_s']:,.0f}", f"{r['over_sequential_read']:.2f}x",
                           f"{r['rank0_peak_rss_bytes'] / 2**20:.0f}"] for r in reshards])))
    write_json_report(os.path.join(REPO, args.out), {"rows": args.rows, "dim": args.dim, "reshards": reshards})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
