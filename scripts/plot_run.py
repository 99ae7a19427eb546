#!/usr/bin/env python3
"""Plots a training run: loss, evaluation AUC, throughput and hit rate over steps, from metrics.jsonl.

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


# Each panel: the metric, its title, and its y range (None: the data's). AUC and the hit rate keep
# their whole scale, so a wobble of 0.002 looks like one.
PANELS = [("loss", "training loss", None), ("eval_auc", "held-out AUC (dashed: the planted model's)", (0.5, 1.0)),
          ("samples_per_s", "samples/s", (0, None)), ("hit_rate", "disk tables' hit rate", (0.0, 1.0))]


def figure(run_dirs: List[str]):
    """The runs' metrics drawn panel by panel, each run in its own colour; the planted model's AUC
    (eval_oracle_auc, synthetic data only), the ceiling, dashed beside each run's AUC."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        label = os.path.basename(os.path.normpath(run_dir))
        for ax, (key, _, _) in zip(axes, PANELS):
            points = sorted((r["step"], r[key]) for r in records if key in r)
            if not points:
                continue
            steps, values = zip(*points)
            line, = ax.plot(steps, values, marker="o" if key == "eval_auc" else None, markersize=3, label=label)
            oracle = sorted((r["step"], r["eval_oracle_auc"]) for r in records if "eval_oracle_auc" in r)
            if key == "eval_auc" and oracle:
                ax.plot(*zip(*oracle), linestyle="--", color=line.get_color())
    for ax, (_, title, limits) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if limits:
            ax.set_ylim(*limits)
    if len(run_dirs) > 1:
        axes[0].legend()
    fig.tight_layout()
    return fig


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="output_dir of each run")
    ap.add_argument("-o", "--output", help="the PNG (default: <first run>/run.png)")
    args = ap.parse_args(argv)
    output = args.output or os.path.join(args.runs[0], "run.png")
    figure(args.runs).savefig(output, dpi=100)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
