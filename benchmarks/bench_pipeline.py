#!/usr/bin/env python3
"""Benchmarks training throughput of the runner on the synthetic_large shape, scaled to fit:
look-ahead depth 0, 1, 4 and auto with the tables on disk at a 10% memory budget, the same
over RocksDB (the offloading baseline: the same cache and op), and the tables in memory
(TorchRec's fused kernels), in one run, on the same batches.

Disk tables are populated first (storage.populate: every row written to the store before
training), so a row missing from memory is read from disk, as in a table trained for a while;
`--fresh` leaves them empty (rows never written are generated, not read).

    python benchmarks/bench_pipeline.py [--scale 10] [--steps 200] [--nproc 2] [--smoke]

With ``--nproc N`` every configuration runs under torchrun with N processes (DistributedModelParallel,
DiskAwarePlanner; the budget is split evenly over the ranks).

Each configuration is a fresh process (`python -m mlkv_torch.train configs/synthetic_large.yaml
...`); its summary.json gives samples/s (over all steps, including one evaluation of 4 batches at the
end), the disk tables' hit rate and the held-out AUC. Ratios are against depth 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List

from common import REPO, markdown_table, runner_summary, write_json_report

BYTES_PER_ROW = 16 * 4 + 4  # 16 float32 weights and a row-wise Adagrad accumulator


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=10, help="divide synthetic_large's cardinalities by this")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.10, help="memory budget, fraction of the tables' bytes")
    ap.add_argument("--out", default="bench-out/bench_pipeline.json")
    ap.add_argument("--nproc", type=int, default=1, help="processes per configuration (torchrun when > 1)")
    ap.add_argument("--depths", default="0,1,4,auto", help="look-ahead depths of the disk store (rocksdb: 0, 1, auto)")
    ap.add_argument("--fresh", action="store_true", help="do not populate the disk tables first")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    args = ap.parse_args(argv)
    rocksdb_depths = ("0", "1", "auto")
    if args.smoke:  # each store with and without look-ahead, and the in-memory reference
        args.scale, args.steps, args.batch, args.depths, rocksdb_depths = 1000, 6, 256, "0,auto", ("auto",)
    sys.path.insert(0, REPO)
    from mlkv_torch.config import cardinalities_of, load_config

    base = load_config(os.path.join(REPO, "configs", "synthetic_large.yaml"), ["output_dir=/unused"])
    rows = sum(cardinalities_of(base.data.synthetic.cardinalities, args.scale))
    budget = max(1 << 20, int(args.budget * rows * BYTES_PER_ROW / args.nproc))  # per rank
    populate = [] if args.fresh else ["storage.populate=true"]
    configs = [(f"{kind}, depth {depth}", [f"storage.kind={kind}", f"pipeline.depth={depth}", *populate])
               for kind, depths in (("disk", args.depths.split(",")), ("rocksdb", rocksdb_depths))
               for depth in depths]
    configs.append(("memory (TorchRec fused)", ["storage.kind=memory"]))
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as work:
        for i, (name, extra) in enumerate(configs):
            out = os.path.join(work, str(i))
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"] \
                if args.nproc > 1 else []
            cmd = [sys.executable, *launcher, "-m", "mlkv_torch.train",
                   os.path.join(REPO, "configs", "synthetic_large.yaml"),
                   f"output_dir={out}", f"data.synthetic.scale={args.scale}", f"train.steps={args.steps}",
                   f"train.batch_size={args.batch}", f"storage.memory_budget_bytes={budget}",
                   f"eval.every={args.steps}", "eval.batches=4", "train.checkpoint_every=null", "--no-progress",
                   *extra]
            summary = runner_summary(cmd, out)
            if summary is None:
                return 1
            results.append({"config": name, **summary})
            print(f"{name}: {summary['samples_per_s']:,.0f} samples/s (populated in {summary['populate_s']:.0f} s)",
                  flush=True)
    reference, in_memory = results[0]["samples_per_s"], results[-1]["samples_per_s"]
    print(f"\n{rows:,} rows ({rows * BYTES_PER_ROW / 2**20:,.0f} MiB with row-wise Adagrad), memory budget "
          f"{budget / 2**20:.1f} MiB for disk tables{' per rank' if args.nproc > 1 else ''}; {args.steps} steps of "
          f"{args.batch}{f' per rank, {args.nproc} processes' if args.nproc > 1 else ''}")
    print(f"tables {'left empty (fresh rows generated)' if args.fresh else 'populated before training'}")
    print("\n".join(markdown_table(
        ["configuration", "samples/s", "vs disk depth 0", "vs memory", "hit rate", "final depth", "AUC (oracle)",
         "peak RSS (MiB)", "on disk (MiB)"],
        [[r["config"], f"{r['samples_per_s']:,.0f}", f"{r['samples_per_s'] / reference:.2f}x",
          f"{r['samples_per_s'] / in_memory:.2f}x", f"{r['hit_rate']:.1%}" if r.get("hit_rate") is not None else "-",
          r["lookahead_depth"] if r["storage"] != "memory" else "-", f"{r['auc']:.4f} ({r['oracle_auc']:.4f})",
          f"{r['peak_rss_bytes'] / 2**20:,.0f}", f"{r['disk_bytes'] / 2**20:,.0f}"] for r in results],
        align="l r r r r r l r r")))
    write_json_report(args.out, {"args": vars(args), "rows": rows, "budget_bytes": budget, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
