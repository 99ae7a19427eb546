#!/usr/bin/env python3
"""Benchmarks virtual tables (TorchRec's use_virtual_table: raw ids, each its own row, ids gone cold
evicted) against hashing the raw ids into fixed-size tables, collisions and all, in one run of the
runner (`python -m mlkv_torch.train`) on the same planted model.

Workload: the synthetic generator with raw ids (`--features` features, each a vocabulary of
`--vocabulary` items drawn Zipf(`--zipf`), `--new-ids` new items entering it a batch as its
hottest, every item's id spread over 2**40 by a bijection); the labels follow each raw id's hidden
effect, so a row shared by two ids (a collision) learns neither. DLRM, row-wise Adagrad, batches of
`--batch`, `--steps` steps, one process. Configurations, each in its own run:

  virtual        every table a virtual table of 2**40 ids; once a table holds more than
                 `--cap` ids, a round evicts those looked up in fewer than 2 batches (counts decayed
                 0.95 a round) and unseen for 10 minutes (a minute: 5 steps), then the weakest
                 down to 0.9 of the cap;
  hashed-disk    the raw ids hashed (modulo) into `--cap` rows a table: the same rows on disk as
                 the virtual tables' cap, a fixed-size disk table of their live size;
  hashed-memory  hashed into as many rows as the memory budget caches (every row a hit).

All three have the same `--budget` of host memory. Reported per configuration: the AUC on
held-out batches drawn from the vocabulary where training ends (and the planted model's own AUC
there), samples/s and its ratio to hashed-disk, the ids a table holds at the end and the most a
table held after a batch (virtual: at most the cap plus one batch's new ids), ids evicted, and the
hit rate.
The distinct raw ids trained on are counted from the generator.

    python benchmarks/bench_virtual.py [--features 8] [--batch 16384] [--steps 1200] [--checkpoint-every 300] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

from common import REPO, markdown_table, runner_summary, write_json_report

ID_SPACE = 2**40
ROW_BYTES = 16 * 4 + 4  # dim 16 float32 and row-wise Adagrad's one state word


def distinct_ids(args: argparse.Namespace) -> int:
    """The distinct raw ids of every feature over the run's training batches (the generator's truth)."""
    import numpy as np

    sys.path.insert(0, REPO)
    from mlkv_torch.data.synthetic import SyntheticCTR

    generator = SyntheticCTR(cardinalities=(args.vocabulary,) * args.features, id_space=ID_SPACE,
                             new_ids_per_batch=args.new_ids, zipf=args.zipf, num_dense=args.dense)
    seen = [np.empty(0, dtype=np.int64) for _ in range(args.features)]
    pending: List[Any] = []
    for b in range(args.steps):
        pending.append(generator.batch_ids(b, args.batch).numpy())
        if len(pending) == 64 or b == args.steps - 1:  # merged a few batches at a time: memory stays small
            chunk = np.concatenate(pending)
            seen = [np.union1d(seen[f], chunk[:, f]) for f in range(args.features)]
            pending = []
    return sum(s.size for s in seen)


def common_overrides(args: argparse.Namespace, out: str) -> List[str]:
    return [f"output_dir={out}", "--no-progress",
            "model.embedding_dim=16", "model.dense_arch=[64,16]", "model.over_arch=[64,1]",
            f"data.synthetic.cardinalities={[args.vocabulary] * args.features}", "data.synthetic.scale=1",
            f"data.synthetic.num_dense={args.dense}", f"data.synthetic.zipf={args.zipf}",
            f"data.synthetic.id_space={ID_SPACE}", f"data.synthetic.new_ids_per_batch={args.new_ids}",
            "storage.kind=disk", f"storage.memory_budget_bytes={args.budget}",
            f"train.batch_size={args.batch}", f"train.steps={args.steps}", "train.optimizer=rowwise_adagrad",
            "train.lr=0.05", f"train.log_every={max(1, args.steps // 10)}", f"eval.every={args.steps}",
            f"eval.batches={args.eval_batches}",
            *([f"train.checkpoint_every={args.checkpoint_every}"] if args.checkpoint_every else [])]


def configurations(args: argparse.Namespace) -> Dict[str, List[str]]:
    memory_rows = max(2, args.budget // (2 * ROW_BYTES * args.features))  # half the budget caches rows
    return {
        "virtual": ["storage.virtual_tables.enabled=true", "storage.virtual_tables.eviction=count_and_timestamp",
                    f"storage.virtual_tables.trigger_ids={args.cap}", "storage.virtual_tables.count_threshold=2",
                    "storage.virtual_tables.decay_rate=0.95", "storage.virtual_tables.ttl_minutes=10",
                    "storage.virtual_tables.minute_steps=5"],
        "hashed-disk": [f"data.synthetic.hash_rows={args.cap}"],
        "hashed-memory": [f"data.synthetic.hash_rows={memory_rows}"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--vocabulary", type=int, default=2_000_000)
    parser.add_argument("--new-ids", type=int, default=8000)
    parser.add_argument("--zipf", type=float, default=1.03)
    parser.add_argument("--dense", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--cap", type=int, default=400_000, help="ids a virtual table keeps (its eviction trigger)")
    parser.add_argument("--budget", type=int, default=256 << 20, help="host memory of every configuration")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=300,
                        help="steps between checkpoints (0: none); a store frees compacted space at a cut")
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a tiny run that checks the script works")
    args = parser.parse_args()
    if args.smoke:
        args.features, args.vocabulary, args.new_ids, args.batch, args.steps = 2, 2000, 50, 256, 20
        args.cap, args.budget, args.eval_batches, args.checkpoint_every = 1500, 4 << 20, 2, 10
    base = args.dir or tempfile.mkdtemp(prefix="mlkv-bench-virtual-")
    print(f"# virtual tables against hashing: {args.features} features x vocabulary {args.vocabulary:,} "
          f"(+{args.new_ids:,} new ids a batch), batches of {args.batch:,}, {args.steps} steps, cap "
          f"{args.cap:,} ids a table, budget {args.budget / (1 << 20):.0f} MiB", flush=True)
    distinct = distinct_ids(args)
    print(f"distinct raw ids trained on: {distinct:,}", flush=True)
    results: Dict[str, Any] = {}
    for name, extra in configurations(args).items():
        out = os.path.join(base, name)
        summary = runner_summary([sys.executable, "-m", "mlkv_torch.train", "configs/quickstart.yaml",
                                  *common_overrides(args, out), *extra], out)
        if summary is None:
            print(f"ERROR: {name} failed", flush=True)
            return 1
        results[name] = {k: summary.get(k) for k in ("auc", "oracle_auc", "samples_per_s", "live_ids",
                                                         "evicted_ids", "peak_live_ids", "hit_rate", "disk_bytes")}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    reference = results["hashed-disk"]["samples_per_s"]
    rows = [[name, f"{r['auc']:.4f}", f"{r['oracle_auc']:.4f}", f"{r['samples_per_s']:,.0f}",
             f"{r['samples_per_s'] / reference:.2f}", f"{(r['live_ids'] or 0) // args.features:,}",
             f"{r['peak_live_ids']:,}" if r["peak_live_ids"] is not None else "-",
             f"{r['evicted_ids']:,}" if r["evicted_ids"] is not None else "-", f"{r['hit_rate']:.3f}"]
            for name, r in results.items()]
    for line in markdown_table(["configuration", "AUC", "planted AUC", "samples/s", "x hashed-disk",
                                "ids a table at the end", "most ids a table held", "evicted", "hit rate"],
                               rows, "l r r r r r r r r"):
        print(line)
    if args.out:
        write_json_report(args.out, {"args": vars(args), "distinct_ids": distinct, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
