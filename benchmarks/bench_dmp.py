#!/usr/bin/env python3
"""Benchmarks DLRM training under DistributedModelParallel: the planner's mixed plan with a 10%
memory budget (tables that do not fit go to disk) against the all-in-memory plan, same data,
same run.

    python benchmarks/bench_dmp.py [--smoke]          # launches torchrun --nproc_per_node 2 itself

Model: torchrec's DLRM (13 dense features, dense arch [64, dim], over arch [64, 1]) with the 26
Criteo Kaggle tables (mlkv_torch.data.CRITEO_KAGGLE_CARDINALITIES), each scaled down by `--scale` (at least 2 rows),
`--dim` float32 columns, one id per feature per sample, SGD (lr 0.05) fused in backward on
every table and on the dense part. Ids per feature are Zipf(`--zipf`) over the table's rows
(hot ids scattered by a fixed permutation); labels are random.

Plans (both by DiskAwarePlanner, 2 ranks, table-wise):
  memory   a host-memory cap above the model: every table keeps TorchRec's fused kernel;
  mixed    a host-memory cap per rank of `--budget` (10%) of the tables' bytes over the
           ranks (plus 8 MiB for the dense part and inputs): the planner moves the tables that do not fit to disk,
           each with
           `--memory-fraction` of its bytes as cache and store log.
Both start from the same initial rows (mlkv_torch.initial_rows), which also writes every row
of the disk tables to their stores, so misses read the disk. Each plan runs `--warmup`
untimed steps, then `--steps` timed steps on the same pre-generated batches. Reported:
samples/s over both ranks and the ratio to the memory plan; the losses of the two plans
(equal at staleness 0); which tables went to disk, their hit rate, store reads per step and
peak RSS per rank during training (VmHWM reset after the set-up).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

from common import (criteo_kaggle_rows, dlrm, dlrm_batches, dlrm_train_step, losses_equal, markdown_table,
                    proc_status_kib, reset_peak_rss, set_initial_rows, table_configs, write_json_report)

RESERVED_FRACTION = 0.15  # the planner's default storage reservation
DENSE_HEADROOM = 8 << 20  # what the planner reserves per rank for the dense model and input buffers


def parse_args(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=10, help="divide Criteo Kaggle's table sizes by this")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--budget", type=float, default=0.10, help="host memory for tables, fraction of their bytes")
    ap.add_argument("--memory-fraction", type=float, default=0.05, help="of a disk table's bytes, for its memory")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--dir", default=None, help="storage directory (default: a temporary one)")
    ap.add_argument("--out", default="bench-out/bench_dmp.json")
    ap.add_argument("--smoke", action="store_true", help="a small, quick run that checks the script works")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.scale, args.batch, args.warmup, args.steps = 100, 256, 2, 3
    return args


def build(args: argparse.Namespace, rows: Dict[str, int], ddr_cap: int, storage_dir: str):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskAwarePlanner, DiskEmbeddingBagCollectionSharder

    model = dlrm(EmbeddingBagCollection(table_configs(rows, args.dim), device=torch.device("meta")), args.dim)
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=optim.SGD(lr=0.05),
                                                memory_fraction=args.memory_fraction)
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu", ddr_cap=ddr_cap, ssd_cap=64 << 30)
    constraints = {name: ParameterConstraints(sharding_types=["table_wise"]) for name in rows}
    planner = DiskAwarePlanner(topology=topology, batch_size=args.batch, constraints=constraints, debug=False)
    plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.05))
    kernels = {name: ps.compute_kernel for name, ps in plan.plan["sparse_arch.embedding_bag_collection"].items()}
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), kernels


def disk_stats(dmp) -> Dict[str, Dict[str, Any]]:
    from mlkv_torch.torchrec import ShardedDiskEmbeddingBagCollection

    sharded = dmp.module.sparse_arch.embedding_bag_collection
    if not isinstance(sharded, ShardedDiskEmbeddingBagCollection):
        return {}
    return sharded.stats()


def run_plan(args, rows, name: str, ddr_cap: int, storage_dir: str, batches) -> Dict[str, Any]:
    import torch.distributed as dist

    dmp, opt, kernels = build(args, rows, ddr_cap, storage_dir)
    set_initial_rows(dmp, rows, args.dim)
    gc.collect()
    reset_peak_rss()  # VmHWM from here: this plan's training alone, not its set-up
    losses = []

    def step(batch) -> None:
        dlrm_train_step(dmp, opt, batch, losses)  # noqa: F821 (deleted below, once training is over)

    for batch in batches[:args.warmup]:
        step(batch)
    before = disk_stats(dmp)
    dist.barrier()
    start = time.perf_counter()
    for batch in batches[args.warmup:]:
        step(batch)
    dist.barrier()
    seconds = time.perf_counter() - start
    after = disk_stats(dmp)
    tables = {}
    for table, stats in after.items():
        hits = stats["cache_hits"] - before[table]["cache_hits"]
        looked_up = hits + stats["cache_misses"] - before[table]["cache_misses"]
        tables[table] = {"rows": rows[table.rsplit("_rows", 1)[0]], "hit_rate": hits / max(1, looked_up),
                         "store_reads_per_step": (stats["store_reads"] - before[table]["store_reads"]) / args.steps}
    result = {"plan": name, "kernels": kernels, "seconds": seconds,
              "samples_per_s": args.batch * dist.get_world_size() * args.steps / seconds, "losses": losses,
              "disk_tables": tables, "peak_rss_mib": proc_status_kib("VmHWM") / 1024}
    sharded = dmp.module.sparse_arch.embedding_bag_collection
    if hasattr(sharded, "close"):  # disk tables checkpoint and release their directories now
        sharded.close()
    del dmp, opt
    return result


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from mlkv_torch.ranks import all_gather_objects

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = criteo_kaggle_rows(args.scale)
    table_bytes = sum(rows.values()) * args.dim * 4
    batches = dlrm_batches(rows, args.batch, args.zipf, rank, args.warmup + args.steps)
    storage = args.dir or tempfile.mkdtemp(prefix="bench-dmp-")
    mixed_cap = int((args.budget * table_bytes / world + DENSE_HEADROOM) / (1 - RESERVED_FRACTION))
    results = [run_plan(args, rows, "memory", 64 << 30, os.path.join(storage, "memory"), batches),
               run_plan(args, rows, "mixed", mixed_cap, os.path.join(storage, "mixed"), batches)]
    everyone = all_gather_objects(results)  # not a gloo collective: see mlkv_torch.ranks
    if rank == 0:
        report = {"args": vars(args), "table_bytes": table_bytes, "mixed_ddr_cap_per_rank": mixed_cap,
                  "ranks": everyone}
        write_json_report(args.out, report)
        print_report(report)
    dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(storage, ignore_errors=True)


def print_report(report: Dict[str, Any]) -> None:
    ranks = report["ranks"]
    memory, mixed = ranks[0][0], ranks[0][1]
    on_disk = sorted((t for t, k in mixed["kernels"].items() if k == "customized_kernel"), key=lambda t: int(t[1:]))
    disk_rows = sum(d["rows"] for r in ranks for d in r[1]["disk_tables"].values())
    print(f"tables: {report['table_bytes'] / 2**20:.1f} MiB; mixed plan's host-memory cap: "
          f"{report['mixed_ddr_cap_per_rank'] / 2**20:.1f} MiB per rank; on disk: {on_disk} ({disk_rows:,} rows)")
    rates = [ranks[0][i]["samples_per_s"] for i in range(2)]
    print("\n".join(markdown_table(
        ["plan", "samples/s", "ratio to memory", "peak RSS per rank (MiB)"],
        [[name, f"{rates[i]:,.0f}", f"{rates[i] / memory['samples_per_s']:.2f}x",
          ", ".join(f"{r[i]['peak_rss_mib']:.0f}" for r in ranks)] for i, name in enumerate(("memory", "mixed"))],
        align="l r r l")))
    same = all(losses_equal(r[0]["losses"], r[1]["losses"]) for r in ranks)
    print(f"losses of the two plans equal at every step: {same}; last loss {memory['losses'][-1]:.4f} "
          f"/ {mixed['losses'][-1]:.4f}")
    for r in ranks:
        for table, d in r[1]["disk_tables"].items():
            print(f"  disk table {table} ({d['rows']:,} rows): hit rate {d['hit_rate']:.1%}, "
                  f"{d['store_reads_per_step']:,.0f} store reads per step")


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
