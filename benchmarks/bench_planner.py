#!/usr/bin/env python3
"""Benchmarks the planner's job budget (`storage.memory_fraction: auto`) against today's rule (one
memory fraction for every disk table) under torchrun, configuration by configuration (on 2 ranks:
one process already shares one budget among its tables, by their rows' frequency).

Each configuration is the quickstart's DLRM on synthetic Criteo-shaped data (Zipf ids), populated
tables, run under torchrun with the same per-rank `storage.memory_budget_bytes` three ways:
- `fraction 0.1`: each disk table 0.1 of its bytes in memory (the default);
- `fraction fill`: the one fraction that spends the budget (the tables' bytes over the job's budget,
  what a user tuning today's rule by hand would give);
- `auto`: the planner's choice from the input's first batches and this machine's calibration.
Per run: samples/s, the distinct rows a step missed in the caches and read from the stores (all
ranks); for `auto` the predicted misses a step (its printed choice), beside the measured.

    python benchmarks/bench_planner.py [--out bench-out/bench_planner.json] [--smoke] [--only NAME]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

from common import REPO, markdown_table, write_json_report

# name, ranks, overrides. Tables: scale 10 is 3.4M rows (230 MB with row-wise Adagrad), 100 is 0.34M.
CONFIGS = [
    ("zipf1.05-5%-tw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05"], 0.05),
    ("zipf1.2-5%-tw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.2"], 0.05),
    ("zipf1.05-1%-tw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05"], 0.01),
    ("zipf1.05-20%-tw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05"], 0.20),
    ("zipf1.05-50%-tw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05"], 0.50),
    ("zipf1.05-5%-rw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05",
                             "storage.sharding_types=[row_wise,table_wise,data_parallel]"], 0.05),
    ("zipf1.05-5%-cw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05",
                             "storage.sharding_types=[column_wise,data_parallel]"], 0.05),
    ("zipf1.1-2%-rw-2", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.1",
                            "storage.sharding_types=[row_wise,data_parallel]"], 0.02),
    ("zipf1.05-5%-tw-2-depth0", 2, ["data.synthetic.scale=10", "data.synthetic.zipf=1.05", "pipeline.depth=0"],
     0.05),
    ("zipf1.3-10%-tw-2-small", 2, ["data.synthetic.scale=100", "data.synthetic.zipf=1.3"], 0.10),
]
SMOKE = [("smoke", 2, ["data.synthetic.scale=1000", "data.synthetic.zipf=1.1"], 0.2)]
_ROW_BYTES = 16 * 4 + 4  # dim 16 float32 and row-wise Adagrad's one state value


def _table_bytes(overrides: List[str]) -> int:
    sys.path.insert(0, REPO)
    from mlkv_torch.config import load_config
    from mlkv_torch.train.sources import batch_source

    config = load_config(os.path.join(REPO, "configs", "quickstart.yaml"), ["output_dir=/unused", *overrides])
    return sum(rows for _, rows, _ in batch_source(config, 1, 1).tables) * _ROW_BYTES


def _run(out: str, ranks: int, overrides: List[str], steps: int, batch: int) -> Optional[Dict[str, Any]]:
    """The runner under torchrun; its summary with the predicted reads it printed (auto), or None."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "mlkv_torch.train", os.path.join(REPO, "configs", "quickstart.yaml"), f"output_dir={out}",
           "--no-progress", f"train.steps={steps}", f"train.batch_size={batch}", "eval.batches=2",
           f"eval.every={steps}", "storage.populate=true", "train.log_every=1000", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    import json

    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    total = re.search(r"^\[train\]\s+total\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", done.stderr, re.M)
    summary["predicted_reads_per_step"] = float(total.group(1)) if total else None
    return summary


def _row(name: str, budget: int, measured: Dict[str, Optional[Dict[str, Any]]]) -> List[str]:
    """A configuration's line of the table; an arm that did not plan shows "no plan"."""
    def rate(arm: str) -> str:
        return f"{measured[arm]['samples_per_s']:,.0f}" if measured[arm] else "no plan"

    auto, today = measured["auto"], measured["fraction 0.1"]
    ran = [m["samples_per_s"] for m in measured.values() if m]
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
    return [name, f"{budget / 2**20:.1f}", *(rate(arm) for arm in measured),
            ratio(auto and auto["samples_per_s"], today and today["samples_per_s"]),
            ratio(auto and auto["samples_per_s"], max(ran, default=0)),
            f"{(auto or {}).get('predicted_reads_per_step') or 0:,.0f}",
            f"{(auto or {}).get('misses_per_step', 0):,.0f}", f"{(auto or {}).get('reads_per_step', 0):,.0f}",
            f"{(today or {}).get('misses_per_step', 0):,.0f}"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out/bench_planner.json")
    ap.add_argument("--smoke", action="store_true", help="one small configuration, few steps")
    ap.add_argument("--only", help="the configurations whose name contains this")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args(argv)
    configs = SMOKE if args.smoke else [c for c in CONFIGS if not args.only or args.only in c[0]]
    steps = 12 if args.smoke else args.steps
    work = tempfile.mkdtemp(prefix="bench-planner-")
    results, rows = [], []
    try:
        for name, ranks, overrides, budget_share in configs:
            table_bytes = _table_bytes(overrides)
            budget = max(1 << 20, int(budget_share * table_bytes / ranks))  # a rank's
            fill = min(1.0, budget * ranks / table_bytes)
            arms = {"fraction 0.1": ["storage.memory_fraction=0.1"],
                    "fraction fill": [f"storage.memory_fraction={fill:.6f}"],
                    "auto": ["storage.memory_fraction=auto"]}
            measured = {}
            for arm, extra in arms.items():
                out = os.path.join(work, f"{name}-{arm.replace(' ', '-')}")
                summary = _run(out, ranks, [*overrides, f"storage.memory_budget_bytes={budget}", *extra], steps,
                               args.batch)
                shutil.rmtree(out, ignore_errors=True)
                if summary is None:  # a plan that does not fit the budget (today's rule at a small one)
                    measured[arm] = None
                    continue
                measured[arm] = {"samples_per_s": summary["samples_per_s"], "hit_rate": summary["hit_rate"],
                                 "reads_per_step": sum(summary["store_reads_per_step_by_rank"] or [0]),
                                 "misses_per_step": sum(summary["cache_misses_per_step_by_rank"] or [0]),
                                 "predicted_reads_per_step": summary["predicted_reads_per_step"]}
            results.append({"name": name, "ranks": ranks, "budget_per_rank": budget, "table_bytes": table_bytes,
                            "arms": measured})
            rows.append(_row(name, budget, measured))
            print(f"[bench_planner] {name}: {measured}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ["config", "MiB/rank", "fraction 0.1 samples/s", "fraction fill", "auto", "auto / 0.1",
              "auto / best", "auto misses/step predicted", "measured", "auto store reads/step",
              "0.1 misses/step"]
    print("\n".join(markdown_table(header, rows, "l r r r r r r r r r r")))
    write_json_report(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
