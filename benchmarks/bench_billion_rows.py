#!/usr/bin/env python3
"""A billion-row table, measured: DLRM over `configs/billion_rows.yaml` (one table of 1,000,000,000
rows, dim 16, beside 25 smaller tables, 64 MiB budget) against the same run with that table at
10,000,000 rows, each in its own process, one after the other:

- peak RSS (the runner's summary: the process's high-water mark), and its ratio to the 10M run's;
- disk: bytes the tables' directories hold, rows the stores hold (rows training wrote: a row
  reaches the disk only once written), and bytes per stored row, for the big table and in all;
- reopen: a new process reopens every table at the last checkpoint's cut (each store loads its
  index checkpoint, or scans its log), with the page cache dropped first where that is allowed;
- resume: the same and the dense model and optimizer loaded, what `--resume` does before its
  first step.

    python benchmarks/bench_billion_rows.py [--steps 2000] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from common import REPO, drop_caches, markdown_table, write_json_report  # drop_caches: root only

CONFIG = os.path.join(REPO, "configs", "billion_rows.yaml")
BIG_FEATURE = 2  # cat_2 is the billion-row table of the config


def overrides_for(rows: int, out: str, steps: int, smoke: bool) -> List[str]:
    sys.path.insert(0, REPO)
    from mlkv_torch.config import load_config

    cardinalities = list(load_config(CONFIG).data.synthetic.cardinalities)
    cardinalities[BIG_FEATURE] = rows
    extra = ["train.batch_size=256", "eval.batches=2"] if smoke else []
    return [f"output_dir={out}", f"data.synthetic.cardinalities={cardinalities}", f"train.steps={steps}",
            f"train.checkpoint_every={steps}", f"eval.every={steps}"] + extra


def reopen(overrides: List[str]) -> Dict[str, Any]:
    """In this (fresh) process: the reopen and resume times and what the stores hold."""
    sys.path.insert(0, REPO)
    from mlkv_torch.config import load_config
    # Not public API: mlkv_torch.train has no public experiment object to reopen and resume
    # (benchmarks/README.md, "Private names still used").
    from mlkv_torch.train import Experiment

    import torchrec.distributed.model_parallel  # noqa: F401  (what Experiment imports: read before the
    import torchrec.models.dlrm  # noqa: F401   page cache goes, so the timing is the tables')

    import mlkv_torch.torchrec  # noqa: F401

    config = load_config(CONFIG, overrides)
    dropped = drop_caches() is None
    began = time.perf_counter()
    experiment = Experiment(config, resume=True)
    reopen_s = time.perf_counter() - began
    step = experiment.load()
    resume_s = time.perf_counter() - began
    stats = experiment.collection.stats()
    big = stats[f"t_cat_{BIG_FEATURE}"]
    result = dict(step=step, reopen_s=reopen_s, resume_s=resume_s, page_cache_dropped=dropped,
                  rows_stored=sum(int(s["rows"]) for s in stats.values()), big_table_rows_stored=int(big["rows"]),
                  big_table_disk_bytes=int(big["disk_bytes"]),
                  from_index_image=sum(bool(s.get("recovered_from_index_image")) for s in stats.values()),
                  tables=len(stats))
    experiment.collection.close()
    return result


def measure(rows: int, work: str, steps: int, smoke: bool) -> Dict[str, Any]:
    out = os.path.join(work, f"rows-{rows}")
    overrides = overrides_for(rows, out, steps, smoke)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlkv_torch.train", CONFIG, *overrides, "--no-progress"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - began
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    reopened = subprocess.run([sys.executable, os.path.abspath(__file__), "--reopen", json.dumps(overrides)],
                              cwd=REPO, check=True, capture_output=True, text=True)
    result = dict(json.loads(reopened.stdout.strip().splitlines()[-1]), table_rows=rows, wall_s=wall_s,
                  samples_per_s=summary["samples_per_s"], peak_rss_bytes=summary["peak_rss_bytes"],
                  disk_bytes=summary["disk_bytes"], auc=summary["auc"])
    result["disk_bytes_per_stored_row"] = result["disk_bytes"] / max(1, result["rows_stored"])
    result["big_table_disk_bytes_per_stored_row"] = result["big_table_disk_bytes"] / max(
        1, result["big_table_rows_stored"])
    return result


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, nargs=2, default=[10_000_000, 1_000_000_000],
                    help="the big table's rows: reference, then measured")
    ap.add_argument("--out", default="bench-out/bench_billion_rows.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    ap.add_argument("--reopen", help=argparse.SUPPRESS)  # the child's part: its overrides, as JSON
    args = ap.parse_args(argv)
    if args.reopen:
        print(json.dumps(reopen(json.loads(args.reopen))))
        return 0
    if args.smoke:
        args.steps = 4
    os.makedirs(os.path.join(REPO, "bench-out"), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-billion-", dir=os.path.join(REPO, "bench-out")) as work:
        reference, measured = (measure(rows, work, args.steps, args.smoke) for rows in args.rows)
    ratio = dict(peak_rss=measured["peak_rss_bytes"] / reference["peak_rss_bytes"],
                 samples_per_s=measured["samples_per_s"] / reference["samples_per_s"],
                 disk_bytes_per_stored_row=measured["disk_bytes_per_stored_row"]
                 / reference["disk_bytes_per_stored_row"],
                 reopen=measured["reopen_s"] / reference["reopen_s"])
    print(f"{args.steps} steps; the big table at {reference['table_rows']:,} rows (reference) and "
          f"{measured['table_rows']:,} rows; page cache dropped before reopening: {measured['page_cache_dropped']}")
    print("\n".join(markdown_table(
        ["big table rows", "samples/s", "peak RSS MB", "disk MB", "rows stored", "bytes per stored row",
         "big table: rows stored, MB", "reopen s", "resume s"],
        [[f"{r['table_rows']:,}", f"{r['samples_per_s']:,.0f}", f"{r['peak_rss_bytes'] / 1e6:.0f}",
          f"{r['disk_bytes'] / 1e6:.0f}", f"{r['rows_stored']:,}", f"{r['disk_bytes_per_stored_row']:.0f}",
          f"{r['big_table_rows_stored']:,}, {r['big_table_disk_bytes'] / 1e6:.0f}", f"{r['reopen_s']:.2f}",
          f"{r['resume_s']:.2f}"] for r in (reference, measured)], align="r r r r r r r r r")))
    print("ratios, billion / reference: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    write_json_report(os.path.join(REPO, args.out),
                      dict(reference=reference, measured=measured, ratio=ratio, steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
