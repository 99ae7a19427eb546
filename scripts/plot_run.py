#!/usr/bin/env python3
"""Plots a training run: loss, evaluation AUC and throughput over steps, from metrics.jsonl.

    python scripts/plot_run.py runs/quickstart              # writes runs/quickstart/run.png
    python scripts/plot_run.py runs/a runs/b -o compare.png  # several runs on the same axes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List


def read_metrics(run_dir: str) -> List[Dict[str, float]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} does not exist (is {run_dir!r} a run's output_dir?)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="output_dir of each run")
    ap.add_argument("-o", "--output", help="the PNG (default: <first run>/run.png)")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("loss", "training loss"), ("eval_auc", "held-out AUC"), ("samples_per_s", "samples/s")]
    for run_dir in args.runs:
        records = read_metrics(run_dir)
        label = os.path.basename(os.path.normpath(run_dir))
        for ax, (key, _) in zip(axes, panels):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if key == "eval_auc" else None, markersize=3, label=label)
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if len(args.runs) > 1:
        axes[0].legend()
    fig.tight_layout()
    output = args.output or os.path.join(args.runs[0], "run.png")
    fig.savefig(output, dpi=100)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
