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

With --link RATE each world's ranks are nodes (one rank a node, network namespaces on a bridge,
each link shaped to RATE, `shaped_network.py`) with their tables on their own disks, so the rows a
rank's new shards hold on another node cross the links (`mlkv_torch.train.shards_over_ranks`);
reported per reshard: the rows and bytes that crossed, and the time they take at the link's rate
against the reshard's (needs root).

    python benchmarks/bench_reshard.py [--rows 2000000] [--dim 64] [--budget 67108864] [--worlds 2,4,2] [--link 1gbit]
        [--smoke]
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

CONFIG = os.path.join(REPO, "configs", "quickstart.yaml")


def _overrides(args: argparse.Namespace, steps: int) -> List[str]:
    return [f"data.synthetic.cardinalities=[{args.rows},1000,1000]", "data.synthetic.scale=1",
            f"model.embedding_dim={args.dim}", "model.dense_arch=[64," + str(args.dim) + "]",
            "storage.sharding_types=[row_wise]", f"storage.memory_budget_bytes={args.budget}",
            f"train.steps={steps}", "train.checkpoint_every=1", "train.batch_size=256", "eval.batches=1",
            "eval.every=1000"]


def _run(out: str, world: int, steps: int, args: argparse.Namespace, *extra: str) -> str:
    """The runner on `world` ranks of this machine; returns what it wrote to stderr."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
                                 if world > 1 else [])
    cmd = launch + ["-m", "mlkv_torch.train", CONFIG, f"output_dir={out}", *_overrides(args, steps), "--no-progress",
                    *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the runner failed:\n{done.stderr[-4000:]}")
    return done.stderr


def _run_on_nodes(net: Any, out: str, world: int, steps: int, args: argparse.Namespace, *extra: str) -> str:
    """The runner on the first `world` nodes of `net`, one rank a node, each node's tables on its
    own disk; returns what rank 0 wrote."""
    from shaped_network import run_job

    run_job(net, CONFIG, out, os.path.join(os.path.dirname(out), "tables"), _overrides(args, steps) + list(extra),
            resume="--resume" in extra, nodes=world)
    with open(os.path.join(out, "node0.log")) as f:
        return f.read()


def _bits_per_second(rate: str) -> float:
    """tc's rate units (1gbit, 100mbit) in bits per second."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"--link: a rate in gbit, mbit or kbit, got {rate!r}")


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


def _reshard_figures(stderr: str, out: str) -> Dict[str, Any]:
    """The runner's own figures of a reshard: seconds in all and filling, rows received over the
    process group, rank 0's peak RSS."""
    found = re.search(r"resharded for .* in ([0-9.]+) s \(([0-9.]+) s filling", stderr)
    received = re.search(r"; ([0-9,]+) rows came over the process group .* in the first ([0-9.]+) s", stderr)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"seconds": float(found.group(1)), "filling_seconds": float(found.group(2)),
            "rows_received": int(received.group(1).replace(",", "")) if received else 0,
            "receiving_seconds": float(received.group(2)) if received else 0.0,
            "rank0_peak_rss_bytes": summary["peak_rss_bytes"]}


def _on_this_machine(args: argparse.Namespace, worlds: List[int], out: str) -> List[Dict[str, Any]]:
    """Each reshard of `worlds` against the store's sequential read of the same rows just before."""
    _run(out, worlds[0], 1, args, "storage.populate=true")
    rows_moved, reshards = args.rows + 2000, []
    for step, (source, target) in enumerate(zip(worlds, worlds[1:]), start=1):
        read = _sequential_read(out)
        figures = _reshard_figures(_run(out, target, step + 1, args, "--resume"), out)
        rows_per_s = rows_moved / figures["seconds"]
        reshards.append({"from": source, "to": target, "rows": rows_moved, **figures, "rows_per_s": rows_per_s,
                         "sequential_read_rows_per_s": read["rows_per_s"],
                         "over_sequential_read": rows_per_s / read["rows_per_s"]})
        print(f"[bench] {source} -> {target}: {figures['seconds']:.1f} s", file=sys.stderr)
    print("\n".join(markdown_table(["reshard", "seconds (filling)", "rows/s", "store's sequential read, rows/s",
                                    "ratio", "rank 0 peak RSS, MiB"],
                         [[f"{r['from']} -> {r['to']}", f"{r['seconds']:.1f} ({r['filling_seconds']:.1f})",
                           f"{r['rows_per_s']:,.0f}",
                           f"{r['sequential_read_rows_per_s']:,.0f}", f"{r['over_sequential_read']:.2f}x",
                           f"{r['rank0_peak_rss_bytes'] / 2**20:.0f}"] for r in reshards])))
    return reshards


def _across_nodes(args: argparse.Namespace, worlds: List[int], out: str) -> List[Dict[str, Any]]:
    """Each reshard of `worlds`, one rank a node, each node's tables on its own disk, against the
    time the rows that crossed the links take at the link's rate."""
    from shaped_network import ShapedNetwork, available

    if available() is not None:
        raise SystemExit(f"--link: {available()}")
    os.makedirs(out)
    row_bytes, reshards = (args.dim + 1) * 4 + 8, []  # weights and row-wise Adagrad's word, and the key
    with ShapedNetwork(nodes=max(worlds), rate=args.link, prefix="mlkv-reshard") as net:
        _run_on_nodes(net, out, worlds[0], 1, args, "storage.populate=true")
        for step, (source, target) in enumerate(zip(worlds, worlds[1:]), start=1):
            figures = _reshard_figures(_run_on_nodes(net, out, target, step + 1, args, "--resume"), out)
            at_link_rate = figures["rows_received"] * row_bytes * 8 / _bits_per_second(args.link)
            reshards.append({"from": source, "to": target, "link": args.link, **figures,
                             "bytes_received": figures["rows_received"] * row_bytes,
                             "seconds_at_link_rate": at_link_rate, "of_link_rate": at_link_rate / figures["seconds"],
                             "receiving_of_link_rate": at_link_rate / figures["receiving_seconds"]})
            print(f"[bench] {source} -> {target}: {figures['seconds']:.1f} s", file=sys.stderr)
    print("\n".join(markdown_table(["reshard", "seconds (filling)", "rows over the links", "MB over the links",
                                    "seconds at the link's rate", "ratio", "receiving them, s", "ratio",
                                    "rank 0 peak RSS, MiB"],
                         [[f"{r['from']} -> {r['to']}", f"{r['seconds']:.1f} ({r['filling_seconds']:.1f})",
                           f"{r['rows_received']:,}", f"{r['bytes_received'] / 1e6:.0f}",
                           f"{r['seconds_at_link_rate']:.1f}", f"{r['of_link_rate']:.2f}x",
                           f"{r['receiving_seconds']:.1f}", f"{r['receiving_of_link_rate']:.2f}x",
                           f"{r['rank0_peak_rss_bytes'] / 2**20:.0f}"] for r in reshards])))
    return reshards


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64 << 20, help="each rank's storage.memory_budget_bytes")
    parser.add_argument("--worlds", default="2,4,2", help="world sizes in turn (1: one process, no torchrun)")
    parser.add_argument("--link", default=None, help="one rank a node, in network namespaces, each link shaped to "
                                                     "this rate (tc's units: 1gbit); needs root")
    parser.add_argument("--smoke", action="store_true", help="100k rows, worlds 2,4,1")
    parser.add_argument("--out", default="bench-out/bench_reshard.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.worlds = 100_000, "2,4,1"
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.link and min(worlds) < 2:
        raise SystemExit("--link: every world has ranks on nodes (at least 2)")
    directory = tempfile.mkdtemp(prefix="mlkv-bench-reshard-")
    try:
        began = time.perf_counter()
        reshards = (_across_nodes if args.link else _on_this_machine)(args, worlds, os.path.join(directory, "run"))
        print(f"[bench] {args.rows:,} rows x {args.dim}, worlds {worlds}: {time.perf_counter() - began:.0f} s",
              file=sys.stderr)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    write_json_report(os.path.join(REPO, args.out), {"rows": args.rows, "dim": args.dim, "budget": args.budget,
                                                     "link": args.link,
                                                     "reshards": reshards})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
