#!/usr/bin/env python3
"""Benchmarks DLRM training under DistributedModelParallel: the planner's mixed plan with a 10%
memory budget (tables that do not fit go to disk) against the all-in-memory plan, same data,
same run.

    python benchmarks/bench_dmp.py [--smoke]          # launches torchrun --nproc_per_node 2 itself

Model: torchrec's DLRM (13 dense features, dense arch [64, dim], over arch [64, 1]) with the 26
Criteo Kaggle tables (../shared/DESIGN.md), each scaled down by `--scale` (at least 2 rows),
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

import numpy as np
import torch

from bench_store import proc_status_kib, reset_peak_rss, write_json_report

CRITEO_KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                      5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
DENSE_FEATURES = 13
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


def table_rows(args: argparse.Namespace) -> Dict[str, int]:
    return {f"t{i}": max(2, n // args.scale) for i, n in enumerate(CRITEO_KAGGLE_ROWS)}


def make_batches(args: argparse.Namespace, rows: Dict[str, int], rank: int, count: int):
    """`count` batches of this rank: dense features, one Zipf id per table per sample, labels."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(1000 + rank)
    id_samplers = []
    for i, n in enumerate(rows.values()):
        cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -args.zipf)
        id_samplers.append((cdf / cdf[-1], np.random.default_rng(i).permutation(n)))  # same ids on every rank
    batches = []
    for _ in range(count):
        ids = [perm[np.minimum(np.searchsorted(cdf, rng.random(args.batch), side="right"), len(perm) - 1)]
               for cdf, perm in id_samplers]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{name}" for name in rows], values=torch.from_numpy(np.concatenate(ids)),
            lengths=torch.ones(len(rows) * args.batch, dtype=torch.int64))
        batches.append((torch.from_numpy(rng.standard_normal((args.batch, DENSE_FEATURES), dtype=np.float32)),
                        sparse, torch.from_numpy(rng.integers(0, 2, args.batch).astype(np.float32))))
    return batches


def build(args: argparse.Namespace, rows: Dict[str, int], ddr_cap: int, storage_dir: str):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskAwarePlanner, DiskEmbeddingBagCollectionSharder

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=name, embedding_dim=args.dim, num_embeddings=n, feature_names=[f"f_{name}"])
              for name, n in rows.items()]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
                 dense_in_features=DENSE_FEATURES, dense_arch_layer_sizes=[64, args.dim], over_arch_layer_sizes=[64, 1],
                 dense_device=torch.device("cpu"))
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


def set_initial_rows(dmp, rows: Dict[str, int], dim: int) -> None:
    """Every table starts from mlkv_torch.initial_rows (disk tables: every row written to the store)."""
    from mlkv_torch import initial_rows
    from mlkv_torch.torchrec.tables import table_seed

    state = dmp.state_dict()
    for name, n in rows.items():
        for shard in state[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"].local_shards():
            for start in range(0, n, 1 << 20):
                ids = torch.arange(start, min(n, start + (1 << 20)))
                shard.tensor.detach()[start:start + ids.numel()] = initial_rows(ids, dim, seed=table_seed(0, name),
                                                                                 num_embeddings=n)
    dmp.load_state_dict(state)


def disk_stats(dmp) -> Dict[str, Dict[str, Any]]:
    from mlkv_torch.torchrec import ShardedDiskEmbeddingBagCollection

    sharded = dmp.module.sparse_arch.embedding_bag_collection
    if not isinstance(sharded, ShardedDiskEmbeddingBagCollection):
        return {}
    return sharded.stats()


def train_step(model, opt, batch, losses: List[float]) -> None:
    """One DLRM training step on (dense, sparse, labels); appends the loss."""
    dense, sparse, labels = batch
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))


def run_plan(args, rows, name: str, ddr_cap: int, storage_dir: str, batches) -> Dict[str, Any]:
    import torch.distributed as dist

    dmp, opt, kernels = build(args, rows, ddr_cap, storage_dir)
    set_initial_rows(dmp, rows, args.dim)
    gc.collect()
    reset_peak_rss()  # VmHWM from here: this plan's training alone, not its set-up
    losses = []

    def step(batch) -> None:
        train_step(dmp, opt, batch, losses)  # noqa: F821 (deleted below, once training is over)

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
    rows = table_rows(args)
    table_bytes = sum(rows.values()) * args.dim * 4
    batches = make_batches(args, rows, rank, args.warmup + args.steps)
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
    print("| plan | samples/s | ratio to memory | peak RSS per rank (MiB) |")
    print("|---|---:|---:|---|")
    for i, name in enumerate(("memory", "mixed")):
        rate = ranks[0][i]["samples_per_s"]
        rss = ", ".join(f"{r[i]['peak_rss_mib']:.0f}" for r in ranks)
        print(f"| {name} | {rate:,.0f} | {rate / memory['samples_per_s']:.2f}x | {rss} |")
    same = all(np.allclose(r[0]["losses"], r[1]["losses"], rtol=1e-5, atol=1e-6) for r in ranks)
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
