#!/usr/bin/env python3
"""What a table really costs in memory, measured as a new user would: anonymous resident memory
(RssAnon: what the kernel cannot drop) above the baseline of the same process after torch and the
imports, and apart from it the mapped file pages (RssFile, which the kernel can drop), beside the
bytes the tables hold on disk and their ratio to the process's memory.

- `populated`: one table of --rows x 16 (row-wise Adagrad) with a --budget, every row written by
  `populate()`, closed; then a new process reopens it and trains --steps steps of --batch ids at
  Zipf(1.05): memory after populate, after the reopen and its peak while training (sampled each
  step), and the disk reads a miss cost (4 KiB blocks read / rows read from the disk);
- `empty`: --tables empty tables of 2**40 rows in one DiskEmbeddingBagCollection with a 12 MiB
  budget: memory at open, before a row exists.

Each part runs in a fresh process, so one's memory is not another's.

    python benchmarks/bench_memory.py [--rows 20000000] [--budget-mib 12] [--steps 200] [--smoke]
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
from typing import Any, Dict

from common import MiB, REPO, dir_bytes, markdown_table, proc_status_kib, write_json_report, zipf_cdf, zipf_ranks


def memory_now() -> Dict[str, int]:
    """This process's anonymous and file-backed resident bytes."""
    return {"anon": proc_status_kib("RssAnon") * 1024, "file": proc_status_kib("RssFile") * 1024}


def above(now: Dict[str, int], base: Dict[str, int]) -> Dict[str, float]:
    return {"anon_mib": (now["anon"] - base["anon"]) / MiB, "file_mib": (now["file"] - base["file"]) / MiB}


def populate_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from mlkv_torch import DiskEmbeddingBag, optim

    base = memory_now()
    began = time.perf_counter()
    table = DiskEmbeddingBag(args.rows, 16, path=args.path, optimizer=optim.RowWiseAdagrad(lr=0.05),
                             memory_budget_bytes=args.budget_mib * MiB, seed=1)
    opened = above(memory_now(), base)
    table.populate()
    populated = above(memory_now(), base)
    stats = table.stats()
    table.close()
    del torch
    return dict(open=opened, populated=populated, populate_s=time.perf_counter() - began,
                index_mib=stats["index_bytes"] / MiB, rows_stored=int(stats["rows"]))


def train_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from mlkv_torch import DiskEmbeddingBag, optim

    cdf = zipf_cdf(args.rows, 1.05)  # the workload's own memory, in the baseline
    generator = torch.Generator().manual_seed(0)
    base = memory_now()
    table = DiskEmbeddingBag(args.rows, 16, path=args.path, optimizer=optim.RowWiseAdagrad(lr=0.05),
                             memory_budget_bytes=args.budget_mib * MiB, seed=1, reopen=True)
    reopened = above(memory_now(), base)
    peak = dict(reopened)
    before = table.stats()
    began = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.from_numpy(zipf_ranks(cdf, torch.rand(args.batch, generator=generator, dtype=torch.float64)))
        out = table(ids, torch.arange(0, args.batch, 8))
        out.sum().backward()
        now = above(memory_now(), base)
        peak = {k: max(peak[k], now[k]) for k in peak}
    table.flush()
    seconds = time.perf_counter() - began
    after = table.stats()
    misses = after["disk_rows"] - before["disk_rows"]  # rows a cache miss read from the disk
    reads = after["disk_reads"] - before["disk_reads"]
    table.close()
    return dict(reopened=reopened, training_peak=peak, steps=args.steps, train_s=seconds,
                index_mib=after["index_bytes"] / MiB, hit_rate=after["hit_rate"], disk_rows=int(misses),
                disk_reads=int(reads),
                disk_reads_per_miss=reads / misses if misses else None)


def empty_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torchrec

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection

    base = memory_now()
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=2 ** 40,
                                           feature_names=[f"f{i}"]) for i in range(args.tables)]
    collection = DiskEmbeddingBagCollection(configs, path=args.path, memory_budget_bytes=12 * MiB,
                                            optimizer=optim.SGD(lr=0.01))
    opened = above(memory_now(), base)
    index = sum(s["index_bytes"] for s in collection.stats().values()) / MiB
    collection.close()
    return dict(tables=args.tables, rows_each=2 ** 40, budget_mib=12, open=opened, index_mib=index)


PARTS = {"populate": populate_part, "train": train_part, "empty": empty_part}


def run_part(part: str, args: argparse.Namespace, path: str) -> Dict[str, Any]:
    """Runs one part in a fresh process and returns its JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--path", path, "--rows", str(args.rows),
           "--budget-mib", str(args.budget_mib), "--steps", str(args.steps), "--batch", str(args.batch),
           "--tables", str(args.tables)]
    done = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--budget-mib", type=int, default=12)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4096, help="ids a step (bags of 8)")
    parser.add_argument("--tables", type=int, default=26, help="empty tables of 2**40 rows")
    parser.add_argument("--dir", default=None, help="where the tables go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="a small run: 200k rows, 20 steps, 4 empty tables")
    parser.add_argument("--only-empty", action="store_true", help="only the empty tables")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None,
                        help="the JSON report (bench-out/memory.json; with --smoke, memory-smoke.json)")
    args = parser.parse_args()
    if args.part:
        print(json.dumps(PARTS[args.part](args)))
        return
    if args.smoke:
        args.rows, args.steps, args.tables = 200_000, 20, 4
    args.out = args.out or os.path.join(REPO, "bench-out", "memory-smoke.json" if args.smoke else "memory.json")
    work = tempfile.mkdtemp(prefix="mlkv-bench-memory-", dir=args.dir)
    try:
        if args.only_empty:
            print(json.dumps(run_part("empty", args, os.path.join(work, "empty"))))
            return
        table_path = os.path.join(work, "table")
        report: Dict[str, Any] = {"rows": args.rows, "dim": 16, "budget_mib": args.budget_mib}
        report["populate"] = run_part("populate", args, table_path)
        report["disk_mib"] = dir_bytes(table_path) / MiB
        report["train"] = run_part("train", args, table_path)
        report["empty"] = run_part("empty", args, os.path.join(work, "empty"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    trained = report["train"]
    resident = trained["training_peak"]["anon_mib"]
    report["disk_to_memory"] = report["disk_mib"] / max(resident, 1e-9)
    rows = [["populated", f"{report['populate']['populated']['anon_mib']:.0f}",
             f"{report['populate']['populated']['file_mib']:.0f}", f"{report['populate']['index_mib']:.0f}"],
            ["reopened", f"{trained['reopened']['anon_mib']:.0f}", f"{trained['reopened']['file_mib']:.0f}", ""],
            ["training peak", f"{resident:.0f}", f"{trained['training_peak']['file_mib']:.0f}",
             f"{trained['index_mib']:.0f}"],
            [f"{args.tables} empty tables of 2**40", f"{report['empty']['open']['anon_mib']:.0f}",
             f"{report['empty']['open']['file_mib']:.0f}", f"{report['empty']['index_mib']:.0f}"]]
    print(f"{args.rows:,} rows x 16, budget {args.budget_mib} MiB: {report['disk_mib']:.0f} MiB on disk, "
          f"{report['disk_mib'] / max(resident, 1e-9):.1f}x the training peak's anonymous memory; "
          f"{(resident * MiB) / args.rows:.1f} bytes a row above the import baseline; disk reads a miss "
          f"{trained['disk_reads_per_miss'] or 0:.2f}")
    print("\n".join(markdown_table(["state", "anon MiB above baseline", "file MiB", "index MiB"], rows)))
    write_json_report(args.out, report)


if __name__ == "__main__":
    main()
