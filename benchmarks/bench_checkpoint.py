#!/usr/bin/env python3
"""Checkpoint and restart costs of one-process training, against a training step of the same run.

DLRM on the quickstart's tables (synthetic Criteo Kaggle / --scale, row-wise Adagrad, disk tables
behind a 12 MiB budget, populated), trained --steps steps; then, in one run:

- step: the mean training step;
- background cut: the runner's checkpoint (`Experiment.save`: a cut of every table begun at the
  step boundary and written by the kernels' writer threads while training goes on, then the dense
  model, its optimizer and the cut's record committed in checkpoint.pt): the stall at the boundary,
  and every step trained while it is written, each against the mean step;
- synchronous cut: the next checkpoint, as many steps later, waited for at once (how the runner
  took one before): the step that takes one lasts step + cut;
- full copy: what the runner wrote before cuts, every row and optimizer state of every table in one
  file (`snapshot(include_state=True)`, which reads each store in one sequential scan);
- per-row reads: the same rows read key by key (`export_rows`, a 4 KiB read per row off the
  cache), how snapshots read before the scan;
- reopen: the tables reopened at the cut (every store recovers its checkpoint).

With --runner, or --nproc N (N > 1), the runner trains instead (`python -m mlkv_torch.train`, with
its look-ahead pipeline; under torchrun with N processes: DistributedModelParallel, the planner's
disk tables, every rank cutting its own), --steps steps with a checkpoint every --steps / 4 (or
--every), without checkpoints and with them, --repeat times alternated; each step's time comes
from rank 0's metrics (log_every 1). Reported for each checkpoint: the mean and the worst of the 4
steps after it against the median of the 8 steps before it in the same run (a shared machine
drifts between runs and within one), the median over the repeats; and the same for the same steps
of the runs without checkpoints, which is the noise of such a comparison.

    python benchmarks/bench_checkpoint.py [--scale 10] [--steps 100] [--nproc 1] [--runner [--every N] [--repeat R]]
        [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

from common import REPO, Timer, markdown_table, median, write_json_report

ROWS_PER_READ = 1 << 18  # rows per export_rows call of the key-by-key pass (the scan's chunk)
SPANNED = 4  # steps after a checkpoint whose worst is its cost through the runner (its work spans three)


def _runner_steps(args: argparse.Namespace, out: str, checkpoint_every: int, batch: int) -> List[float]:
    """One run of the runner (under torchrun with --nproc > 1): each step's seconds, from rank 0's metrics."""
    import subprocess

    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  str(args.nproc)] if args.nproc > 1 else [])
    done = subprocess.run(launch + ["-m", "mlkv_torch.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                                    f"output_dir={out}", f"data.synthetic.scale={args.scale}",
                                    f"train.steps={args.steps}",
                                    f"train.batch_size={batch}", "train.log_every=1", f"eval.every={10 * args.steps}",
                                    f"train.checkpoint_every={checkpoint_every or 'null'}", "storage.populate=true",
                                    "--no-progress"],
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run with checkpoint_every={checkpoint_every} failed: {done.stderr[-6000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"samples_per_s"' in line]
    shutil.rmtree(out)  # its tables: a few hundred MB a run
    return [batch * args.nproc / r["samples_per_s"] for r in records]


def _mean_after_warm_up(run: List[float], warm_up: int) -> float:
    return sum(run[warm_up:]) / len(run[warm_up:])


def _window_over_before(run: List[float], c: int) -> Tuple[float, float]:
    """The SPANNED steps after the boundary at step c against the median of the 8 steps before it
    (the same run: a shared machine drifts between runs and within one): their mean, their worst."""
    window, before = run[c:c + SPANNED], median(run[c - 8:c])
    return sum(window) / len(window) / before, max(window) / before


def through_the_runner(args: argparse.Namespace) -> int:
    """The runner (under torchrun with --nproc > 1) without checkpoints and with one every --every
    steps (default steps / 4, at least 12), --repeat times alternated: the steps after each checkpoint against
    the steps before it, and the same steps of the runs without checkpoints (their noise)."""
    every = args.every or max(8 + SPANNED, args.steps // 4)
    # The 8 steps before a checkpoint must not hold the previous one's SPANNED steps.
    if every < 8 + SPANNED:
        raise SystemExit(f"--every {every}: at least {8 + SPANNED} steps between checkpoints, so the 8 steps "
                         "before each are clear of the previous one's work")
    batch = 256 if args.smoke else 2048
    runs: Dict[str, List[List[float]]] = {"plain": [], "checkpointed": []}
    os.makedirs(os.path.join(REPO, "bench-out"), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=os.path.join(REPO, "bench-out")) as work:
        for repeat in range(args.repeat):
            order = (("plain", 0), ("checkpointed", every))
            for run, checkpoint_every in order if repeat % 2 == 0 else order[::-1]:  # drift falls on both alike
                runs[run].append(_runner_steps(args, os.path.join(work, f"{run}-{repeat}"), checkpoint_every, batch))
    warm_up = max(1, args.steps // 5)
    step_s = median([_mean_after_warm_up(r, warm_up) for r in runs["plain"]])
    # The step after a checkpoint at step c is step c + 1 (index c): it pays the boundary. The
    # runner spreads the checkpoint's work over the steps after it, one piece per step (the cut's
    # rows, the stores' syncs, the rest of the state): SPANNED steps carry it.
    boundaries = list(range(every, args.steps - SPANNED + 1, every))
    table: Dict[str, Dict[int, Dict[str, Any]]] = {run: {} for run in runs}
    for run, rs in runs.items():
        for c in boundaries:
            means, worsts = zip(*(_window_over_before(r, c) for r in rs))
            table[run][c] = dict(mean=means, worst=worsts, median_mean=median(means), median_worst=median(worsts))
    result = dict(nproc=args.nproc, steps=args.steps, checkpoint_every=every, repeat=args.repeat, step_s=step_s,
                  mean_checkpointed_run_over_plain=median([_mean_after_warm_up(r, warm_up)
                                                           for r in runs["checkpointed"]]) / step_s,
                  spanned_steps_over_8_before=table["checkpointed"], the_same_without_checkpoints=table["plain"],
                  step_s_of_runs=runs)
    where = f"torchrun, {args.nproc} processes" if args.nproc > 1 else "the runner, one process"
    print(f"{where}; a step {step_s * 1e3:.1f} ms without checkpoints (median of {args.repeat} runs' mean "
          "after warm-up); "
          f"the runs with checkpoints every {every} steps: {result['mean_checkpointed_run_over_plain']:.2f}x")
    print(f"The {SPANNED} steps after each checkpoint against the median of the 8 steps before it, the median of "
          f"{args.repeat} runs (each run's in brackets); without checkpoints: the same steps of the runs without.")
    print("\n".join(markdown_table(
        ["checkpoint at step", "their mean", "without checkpoints", "their worst", "without checkpoints"],
        [[c, *(f"{table[run][c]['median_' + what]:.2f} ({' '.join(f'{v:.2f}' for v in table[run][c][what])})"
               for what in ("mean", "worst") for run in ("checkpointed", "plain"))] for c in boundaries],
        align="r r r r r")))
    for what in ("mean", "worst"):
        on, off = ([table[run][c]["median_" + what] for c in boundaries] for run in ("checkpointed", "plain"))
        if on:
            print(f"their {what}: at most {max(on):.2f}x, median {median(on):.2f}x over {len(on)} checkpoints "
                  f"(without checkpoints: at most {max(off):.2f}x, median {median(off):.2f}x)")
    write_json_report(os.path.join(REPO, args.out), result)
    return 0


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=10, help="divide Criteo Kaggle's cardinalities by this")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="bench-out/bench_checkpoint.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    ap.add_argument("--nproc", type=int, default=1, help="processes under torchrun (1: one process, in this one)")
    ap.add_argument("--runner", action="store_true", help="train through the runner (implied by --nproc > 1)")
    ap.add_argument("--every", type=int, default=0,
                    help="with --runner: steps between checkpoints (0: steps / 4, at least 12)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --runner: runs with checkpoints and without, alternated, this many times each")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.smoke:
        args.scale, args.steps = 1000, (28 if args.nproc > 1 or args.runner else 4)
        args.every = 12 if args.nproc > 1 or args.runner else args.every
    if args.nproc > 1 or args.runner:
        return through_the_runner(args)
    sys.path.insert(0, REPO)
    import torch

    from mlkv_torch.config import load_config
    # Not public API: mlkv_torch.train has no public experiment object to train, checkpoint and reopen
    # step by step (benchmarks/README.md, "Private names still used").
    from mlkv_torch.train import Experiment, torch_threads

    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=os.path.join(REPO, "bench-out")
                                     if os.path.isdir(os.path.join(REPO, "bench-out")) else None) as work:
        config = load_config(os.path.join(REPO, "configs", "quickstart.yaml"), [
            f"output_dir={work}", f"data.synthetic.scale={args.scale}", f"train.steps={args.steps}",
            "storage.populate=true"] + (["train.batch_size=256"] if args.smoke else []))
        torch.set_num_threads(torch_threads(config))  # as the runner trains this config
        experiment = Experiment(config)
        rows = experiment.populate()
        most_steps_while_writing = 60
        batches = iter(list(experiment.loader(0, 2 * args.steps + most_steps_while_writing + 1)))

        steps = Timer()

        def step() -> float:
            with steps:
                loss, _ = experiment.model(next(batches))
                experiment.optimizer.zero_grad()
                loss.backward()
                experiment.optimizer.step()
                experiment.boundaries.passed()  # as the runner marks each step: the checkpoint's work follows them
            return steps.seconds[-1]

        warm_up = max(1, args.steps // 5)
        for _ in range(warm_up):  # the cache fills
            step()
        steps.seconds.clear()
        for _ in range(args.steps - warm_up):
            step()
        step_s = steps.total / max(1, args.steps - warm_up)

        began = time.perf_counter()
        experiment.save(args.steps)  # begins the cut, returns; checkpoint.pt follows in the background
        boundary_s = time.perf_counter() - began
        during: List[float] = []
        while experiment.saving and len(during) < most_steps_while_writing:
            during.append(step())
        experiment.finish_save()
        background_write_s = time.perf_counter() - began

        for _ in range(args.steps - len(during)):  # as many steps since the last cut as the background one had
            step()
        began = time.perf_counter()
        experiment.save(2 * args.steps)
        experiment.finish_save()  # waited for at once: the synchronous cut, as the runner took it before
        sync_cut_s = time.perf_counter() - began

        bags = experiment.collection.embedding_bags
        began = time.perf_counter()
        torch.save({name: bag.snapshot(include_state=True) for name, bag in bags.items()},
                   os.path.join(work, "full.pt"))
        full_copy_s = time.perf_counter() - began
        os.unlink(os.path.join(work, "full.pt"))

        began = time.perf_counter()
        for bag in bags.values():
            for first in range(0, bag.num_embeddings, ROWS_PER_READ):
                bag.export_rows(torch.arange(first, min(bag.num_embeddings, first + ROWS_PER_READ)),
                                include_state=True)
        per_row_s = time.perf_counter() - began

        experiment.collection.close()
        cut = torch.load(experiment.checkpoint_path(), weights_only=False)["cut"]
        began = time.perf_counter()
        reopened = Experiment(config, resume=True)
        reopen_s = time.perf_counter() - began
        assert reopened.collection.checkpoint(label=cut["label"])["tables"] == cut["tables"]
        reopened.collection.close()

    first = boundary_s + (during[0] if during else step_s)  # the step the checkpoint falls in
    result: Dict[str, Any] = dict(rows=rows, torch_threads=torch.get_num_threads(), steps=args.steps, step_s=step_s,
                                  boundary_stall_s=boundary_s,
                                  background_write_s=background_write_s, steps_while_writing=len(during),
                                  step_times_while_writing_s=during,
                                  first_step_with_background_cut_over_step=first / step_s,
                                  worst_step_while_writing_over_step=max([first] + during) / step_s,
                                  mean_step_while_writing_over_step=(sum(during) / len(during)
                                                                     / step_s) if during else None,
                                  sync_cut_s=sync_cut_s, full_copy_s=full_copy_s,
                                  per_row_reads_s=per_row_s, reopen_s=reopen_s,
                                  step_with_sync_cut_over_step=(step_s + sync_cut_s) / step_s,
                                  step_with_full_copy_over_step=(step_s + full_copy_s) / step_s,
                                  per_row_over_scan=per_row_s / full_copy_s)
    print(f"{rows:,} rows; a step {step_s * 1e3:.1f} ms ({torch.get_num_threads()} torch threads, as the runner)")
    print("| checkpoint | seconds | the worst step while it is taken, x a step |")
    print("|---|---:|---:|")
    print(f"| background cut (now): {boundary_s * 1e3:.1f} ms at the boundary, written over {len(during)} steps "
          f"({background_write_s:.3f} s) | {background_write_s:.3f} | "
          f"{result['worst_step_while_writing_over_step']:.2f} |")
    print(f"| synchronous cut | {sync_cut_s:.3f} | {result['step_with_sync_cut_over_step']:.2f} |")
    print(f"| full copy (before cuts), rows read by scan | {full_copy_s:.3f} | "
          f"{result['step_with_full_copy_over_step']:.2f} |")
    print(f"| every row read key by key (before the scan) | {per_row_s:.3f} | {(step_s + per_row_s) / step_s:.2f} |")
    if during:
        print("steps while the cut is written, x a step: " + " ".join(f"{t / step_s:.2f}" for t in during))
    print(f"reopen at the cut: {reopen_s:.2f} s; key-by-key reads / scan: {result['per_row_over_scan']:.1f}x")
    write_json_report(os.path.join(REPO, args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
