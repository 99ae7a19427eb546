#!/usr/bin/env python3
"""Benchmarks the table-batched disk kernel in DLRM against TorchRec's fused in-memory kernel, in
one process, on the same batches: the op layer's overhead, with the disk out of the way.

    python benchmarks/bench_kernel.py [--scale 10] [--batch 2048] [--steps 150] [--smoke]

Model: torchrec's DLRM (13 dense features, dense arch [64, dim], over arch [64, 1]) over the 26
Criteo Kaggle tables divided by `--scale`, `--dim` float32 columns, one Zipf(`--zipf`) id per
feature per sample (bench_dmp.py's batches), SGD (lr 0.05) on tables and dense part alike.

Configurations, each from the same initial rows (mlkv_torch.initial_rows) and dense weights:
  memory   TorchRec's EmbeddingBagCollection under DistributedModelParallel (a one-process gloo
           group), fbgemm's fused CPU kernel with SGD in backward: the reference;
  cached   DiskEmbeddingBagCollection (every table on the disk kernel), a memory budget that
           holds every row, every row brought into the cache before timing: no store reads;
  disk     the same at `--budget` (10%) of the tables' bytes, tables populated first, so misses
           read the disk, looking `--depth` batches ahead.
  io       the disk configuration without the dense model (the tables' forward and backward only):
           how fast the store-to-model path reads when the compute does not hold the cores.
`--configs` picks which run (memory always: it is the reference).
Reported: samples/s and the ratio to memory, hit rate and store reads per step, peak RSS, and
whether the losses equal the reference's at every step (they must: staleness 0); for disk
configurations also the stores' merges into base runs and the rows they wrote, and the CPU seconds
each thread (by name) spent in the timed steps.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import torch

from common import (criteo_kaggle_rows, dlrm, dlrm_batches, dlrm_train_step, losses_equal, markdown_table,
                    proc_status_kib, reset_peak_rss, set_initial_rows, table_configs, write_json_report)

LR = 0.05


def parse_args(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=10, help="divide Criteo Kaggle's table sizes by this")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--configs", default="memory,cached", help="which of memory, cached, disk to run (memory first: "
                    "the reference)")
    ap.add_argument("--budget", type=float, default=0.10, help="disk configuration: memory, fraction of table bytes")
    ap.add_argument("--depth", type=int, default=1, help="disk configuration: batches looked ahead")
    ap.add_argument("--iops", type=float, default=None,
                    help="4 KiB random-read IOPS of the disk (benchmarks/disk_limits.py, queue depth 64): "
                         "reports the disk configuration against the rate the disk allows for its reads")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice); "
                    "the disk tables' I/O threads share the cores with them")
    ap.add_argument("--dir", default=None, help="storage directory (default: a temporary one)")
    ap.add_argument("--out", default="bench-out/bench_kernel.json")
    ap.add_argument("--smoke", action="store_true", help="a small, quick run that checks the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.scale, args.batch, args.warmup, args.steps, args.configs = 1000, 256, 2, 3, "memory,cached,disk,io"
    return args


def build_memory(args: argparse.Namespace, rows: Dict[str, int]):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    model = dlrm(EmbeddingBagCollection(table_configs(rows, args.dim), device=torch.device("meta")), args.dim)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    # Table-wise, so every table runs fbgemm's fused kernel (a data-parallel plan would not).
    topology = Topology(world_size=1, compute_device="cpu")
    constraints = {name: ParameterConstraints(sharding_types=["table_wise"]) for name in rows}
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch, constraints=constraints,
                                    debug=False).plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    set_initial_rows(dmp, rows, args.dim)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), None


def build_disk(args: argparse.Namespace, rows: Dict[str, int], path: str, budget: int, populate: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection

    # seed=0: the memory plan's rows (table_seed(0, name))
    collection = DiskEmbeddingBagCollection(table_configs(rows, args.dim), path=path, optimizer=optim.SGD(lr=LR),
                                            memory_budget_bytes=budget, seed=0)
    if populate:
        collection.populate()
    else:
        # Every row into the cache (a read, no update): the timed steps find every row there.
        with torch.no_grad():
            chunk = 1 << 16
            for start in range(0, max(rows.values()), chunk):
                counts = [max(0, min(n, start + chunk) - start) for n in rows.values()]
                values = torch.cat([torch.arange(start, start + c) for c in counts])
                collection(KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{name}" for name in rows], values=values,
                                                               lengths=_padded_lengths(counts, chunk)))
    model = dlrm(collection, args.dim)
    dense = [p for name, p in model.named_parameters() if "embedding_bag" not in name]
    return model, torch.optim.SGD(dense, lr=LR), collection


class TablesOnly(torch.nn.Module):
    """The embedding tables of a model with nothing after them: the logit of a sample is the sum of
    its pooled rows (one parameter, so the optimizer has one)."""

    def __init__(self, collection: torch.nn.Module) -> None:
        super().__init__()
        self.collection = collection
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return self.collection(sparse).values().sum(1, keepdim=True) + self.bias


def _padded_lengths(counts: List[int], chunk: int) -> torch.Tensor:
    """One id per sample for the first counts[f] samples of feature f, none for the rest of `chunk`."""
    return torch.cat([torch.cat([torch.ones(c, dtype=torch.int64), torch.zeros(chunk - c, dtype=torch.int64)])
                      for c in counts])


def run(args: argparse.Namespace, name: str, model, opt, collection, batches, depth: int = 0) -> Dict[str, Any]:
    """Trains on `batches`, reading the rows of batch t + `depth` as batch t starts (LookaheadPipeline's
    window, without its data loading); times the steps after the warm-up."""
    gc.collect()
    reset_peak_rss()
    rss_at_start_mib = proc_status_kib("VmRSS") / 1024
    losses: List[float] = []
    for batch in batches[:depth]:
        collection.lookahead(batch[1])

    def step(t: int) -> None:
        if depth and t + depth < len(batches):
            collection.lookahead(batches[t + depth][1])
        dlrm_train_step(model, opt, batches[t], losses)

    for t in range(args.warmup):
        step(t)
    before = _counters(collection)
    cpu_before = _thread_cpu()
    disk_before = _device_io(args.storage)
    start = time.perf_counter()
    for t in range(args.warmup, len(batches)):
        step(t)
    if collection is not None:
        collection.flush()  # every update applied inside the timed window
    seconds = time.perf_counter() - start
    after = _counters(collection)
    cpu_after = _thread_cpu()
    disk_after = _device_io(args.storage)
    result: Dict[str, Any] = {"config": name, "seconds": seconds, "samples_per_s": args.batch * args.steps / seconds,
                              "losses": losses, "peak_rss_mib": proc_status_kib("VmHWM") / 1024,
                              "rss_at_start_mib": rss_at_start_mib,
                              "threads": len(os.listdir("/proc/self/task")),
                              "thread_cpu_s": _since(cpu_before, cpu_after, 0),
                              "thread_core_wait_s": _since(cpu_before, cpu_after, 1)}
    if collection is not None:
        result.update(memory_of(collection))
        looked_up = after["hits"] - before["hits"] + after["misses"] - before["misses"]
        result.update(hit_rate=(after["hits"] - before["hits"]) / max(1, looked_up),
                      disk_reads_per_step=(after["disk_reads"] - before["disk_reads"]) / args.steps,
                      misses_per_step=(after["misses"] - before["misses"]) / args.steps,
                      base_merges=after["base_merges"] - before["base_merges"],
                      base_rows_written_per_step=(after["base_rows_written"]
                                                  - before["base_rows_written"]) / args.steps,
                      write_stalls=after["write_stalls"] - before["write_stalls"],
                      write_back_wait_ms_per_step=(after["write_back_wait_ms"]
                                                   - before["write_back_wait_ms"]) / args.steps,
                      store_reads_per_step=(after["store_reads"] - before["store_reads"]) / args.steps,
                      read_ahead_dropped_per_step=(after["read_ahead_dropped"]
                                                   - before["read_ahead_dropped"]) / args.steps,
                      read_ahead_wait_ms_per_step=(after["read_ahead_wait_ms"]
                                                   - before["read_ahead_wait_ms"]) / args.steps,
                      step_ms=seconds / args.steps * 1e3)
        if disk_before and disk_after:  # the whole device's, other processes' reads included
            per_step = [(a - b) / args.steps for a, b in zip(disk_after, disk_before)]
            result.update(device_reads_per_step=per_step[0], device_read_merges_per_step=per_step[1],
                          device_read_kib_per_step=per_step[2], device_writes_per_step=per_step[3],
                          device_write_kib_per_step=per_step[4])
    return result


def kernels_of(collection) -> List[List[str]]:
    """The collection's tables grouped by kernel: a DiskEmbeddingBagCollection runs one
    DiskTableBatch per row layout (dim, weight type, pooling), whose tables share its cache, its
    budget and its counters."""
    kernels: Dict[Any, List[str]] = {}
    for name, bag in collection.embedding_bags.items():
        kernels.setdefault((bag.embedding_dim, bag.dtype, bag.mode), []).append(name)
    return list(kernels.values())


def memory_of(collection) -> Dict[str, float]:
    """MiB of what the collection holds by its own count: the cache (rows, optimizer state and what
    the cache keeps beside them), the staging area and write-back buffer, the stores' in-memory
    logs and their indexes (within their share of the budget). The buffers follow from each
    kernel's budget by the budget rule (`split_host_memory`), as the kernel sized them."""
    from mlkv_torch.memory_budget import buffer_host_bytes, cache_host_bytes, split_host_memory
    from mlkv_torch.row_layout import row_bytes

    stats = collection.stats().values()
    cache = buffers = 0
    for names in kernels_of(collection):
        bags = [collection.embedding_bags[name] for name in names]
        bag = bags[0]
        size = row_bytes(bag.embedding_dim, bag.dtype, bag.optimizer)
        split = split_host_memory(bag.memory_budget_bytes, len(bags), sum(b.num_embeddings for b in bags), size,
                                  True, bag.cache_rows)
        cache += cache_host_bytes(bag.cache_rows, size)
        buffers += buffer_host_bytes(split.staging_rows, split.write_back_rows, size)
    return {"cache_mib": cache / 2**20, "buffers_mib": buffers / 2**20,
            "store_logs_mib": sum(s["log_memory_bytes"] for s in stats) / 2**20,
            "store_indexes_mib": sum(s["index_bytes"] for s in stats) / 2**20}


def first_time_ids_per_step(batches, warmup: int) -> float:
    """Mean count, over the steps after `warmup`, of (feature, id) pairs no earlier step had."""
    seen: Dict[str, set] = {}
    new = 0
    for t, (_, sparse, _) in enumerate(batches):
        for key, jt in sparse.to_dict().items():
            ids = set(jt.values().tolist())
            if t >= warmup:
                new += len(ids - seen.get(key, set()))
            seen.setdefault(key, set()).update(ids)
    return new / max(1, len(batches) - warmup)


def _thread_cpu() -> Dict[str, Tuple[float, float]]:
    """Seconds this process's threads have run so far and waited, runnable, for a core (the
    scheduler's run-queue wait: on 2 cores the read-ahead can be ready and still not run), summed by
    thread name."""
    out: Dict[str, Tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran_ns, waited_ns = (int(v) for v in f.read().split()[:2])
        except OSError:
            continue
        ran, waited = out.get(name, (0.0, 0.0))
        out[name] = (ran + ran_ns / 1e9, waited + waited_ns / 1e9)
    return out


def _device_io(path: str) -> Tuple[int, ...]:
    """The block device under `path`: reads it has completed, reads the kernel merged into a
    neighbour before sending (this disk is bound by operations, so merged reads are free), KiB
    read, writes completed and KiB written; () where the file system has no block device (tmpfs)."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            fields = f.read().split()
    except OSError:
        return ()
    return (int(fields[0]), int(fields[1]), int(fields[2]) // 2, int(fields[4]), int(fields[6]) // 2)


def _since(before: Dict[str, Tuple[float, float]], after: Dict[str, Tuple[float, float]],
           field: int) -> Dict[str, float]:
    """Seconds of `field` (0: ran, 1: waited for a core) each thread name added between two reads."""
    since = {k: v[field] - before.get(k, (0.0, 0.0))[field] for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(since.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def _counters(collection) -> Dict[str, int]:
    if collection is None:
        return {}
    stats = collection.stats()
    # The cache's own counters are shared by its tables: read them once per kernel.
    return {"hits": sum(s["cache_hits"] for s in stats.values()),
            "misses": sum(s["cache_misses"] for s in stats.values()),
            "disk_reads": sum(s["disk_reads"] for s in stats.values()),
            "base_merges": sum(s.get("base_merges", 0) for s in stats.values()),
            "base_rows_written": sum(s.get("base_rows_written", 0) for s in stats.values()),
            "write_stalls": sum(s.get("write_stalls", 0) for s in stats.values()),
            "read_ahead_wait_ms": sum(stats[names[0]]["read_ahead_wait_ms"] for names in kernels_of(collection)),
            "write_back_wait_ms": sum(stats[names[0]]["write_back_wait_ms"] for names in kernels_of(collection)),
            "store_reads": sum(stats[names[0]]["store_reads"] for names in kernels_of(collection)),
            "read_ahead_dropped": sum(stats[names[0]]["read_ahead_dropped_rows"] for names in kernels_of(collection))}


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    from mlkv_torch.memory_budget import host_memory_for_all_rows

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = criteo_kaggle_rows(args.scale)
    total_rows = sum(rows.values())
    table_bytes = total_rows * args.dim * 4
    batches = dlrm_batches(rows, args.batch, args.zipf, 0, args.warmup + args.steps)
    storage = args.dir or tempfile.mkdtemp(prefix="bench-kernel-")
    args.storage = storage
    rendezvous = os.path.join(storage, ".process_group")
    os.makedirs(storage, exist_ok=True)
    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 1), rank=0, world_size=1)
    results = []
    configs = args.configs.split(",")
    try:
        results.append(run(args, "memory (TorchRec fused)", *build_memory(args, rows), batches))
        if "cached" in configs:
            cached_budget = host_memory_for_all_rows(len(rows), total_rows, args.dim * 4)
            model, opt, collection = build_disk(args, rows, os.path.join(storage, "cached"), cached_budget, False)
            results.append(run(args, "cached (disk kernel, every row in memory)", model, opt, collection, batches))
            collection.close()
        if "disk" in configs:
            budget = max(1 << 20, int(args.budget * table_bytes))
            gc.collect()
            rss_before_mib = proc_status_kib("VmRSS") / 1024
            model, opt, collection = build_disk(args, rows, os.path.join(storage, "disk"), budget, True)
            results.append(run(args, f"disk ({args.budget:.0%} budget, populated, look-ahead {args.depth})", model, opt,
                               collection, batches, args.depth))
            results[-1].update(budget_mib=budget / 2**20, rss_before_build_mib=rss_before_mib)
            collection.close()
        if "io" in configs:
            budget = max(1 << 20, int(args.budget * table_bytes))
            _, _, collection = build_disk(args, rows, os.path.join(storage, "io"), budget, True)
            tables_only = TablesOnly(collection)
            results.append(run(args, "io (the disk configuration's tables alone)", tables_only,
                               torch.optim.SGD(tables_only.parameters(), lr=LR), collection, batches, args.depth))
            collection.close()
    finally:
        dist.destroy_process_group()
        if args.dir is None:
            shutil.rmtree(storage, ignore_errors=True)
    reference = results[0]
    print(f"{len(rows)} tables, {total_rows:,} rows x {args.dim} ({table_bytes / 2**20:.0f} MiB), batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup}; torch threads {torch.get_num_threads()}")
    rows_out = []
    for r in results:
        equal = losses_equal(r["losses"], reference["losses"]) \
            if not r["config"].startswith("io") else "- (no dense model)"
        disk = "hit_rate" in r
        rows_out.append([r["config"], f"{r['samples_per_s']:,.0f}",
                         f"{r['samples_per_s'] / reference['samples_per_s']:.2f}x",
                         f"{r['hit_rate']:.1%}" if disk else "-", f"{r['disk_reads_per_step']:,.0f}" if disk else "-",
                         f"{r['misses_per_step']:,.0f}" if disk else "-", f"{r['peak_rss_mib']:,.0f}", r["threads"],
                         equal])
    print("\n".join(markdown_table(["configuration", "samples/s", "vs memory", "hit rate", "disk reads/step",
                                    "misses/step", "peak RSS (MiB)", "threads", "losses equal memory's"], rows_out,
                                   align="l r r r r r r r l")))
    for r in results:
        if "budget_mib" in r:
            growth = r["peak_rss_mib"] - r["rss_before_build_mib"]
            print(f"{r['config']}, memory (MiB): budget {r['budget_mib']:,.0f} (cache {r['cache_mib']:,.0f}, "
                  "staging and "
                  f"write-back {r['buffers_mib']:,.0f}, store logs {r['store_logs_mib']:,.0f}); "
                  f"store indexes {r['store_indexes_mib']:,.0f} beside it; peak RSS "
                  f"{r['peak_rss_mib']:,.0f}; {r['rss_before_build_mib']:,.0f} before the tables were built "
                  "(and populated), "
                  f"{r['rss_at_start_mib']:,.0f} after: they and training added {growth:,.0f}, the budget + indexes + "
                  f"{growth - r['budget_mib'] - r['store_indexes_mib']:,.0f}")
            print(f"{r['config']}, the stores' merges into base runs in the timed steps: {r['base_merges']}, "
                  f"{r['base_rows_written_per_step']:,.0f} rows written a step; CPU seconds by thread: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["thread_cpu_s"].items())
                  + "; seconds waiting for a core: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                 r["thread_core_wait_s"].items()))
            if "device_reads_per_step" in r:
                print(f"{r['config']}, the device's reads a step: {r['device_reads_per_step']:,.0f} sent, "
                      f"{r['device_read_merges_per_step']:,.0f} merged into a neighbour, "
                      f"{r['device_read_kib_per_step']:,.0f} KiB; writes {r['device_writes_per_step']:,.0f}, "
                      f"{r['device_write_kib_per_step']:,.0f} KiB; the training thread waited "
                      f"{r['read_ahead_wait_ms_per_step']:.1f} ms a step for the read-ahead, "
                      f"{r['write_back_wait_ms_per_step']:.1f} ms for room in the write-back buffer, and read "
                      f"{r['store_reads_per_step']:,.0f} rows a step from the stores itself (the read-ahead "
                      f"dropped {r['read_ahead_dropped_per_step']:,.0f})")
    first_seen = first_time_ids_per_step(batches, args.warmup)
    print(f"first-time ids per timed step (an infinite cache's misses): {first_seen:,.0f}")
    for r in results:
        if args.iops and r.get("disk_reads_per_step"):
            allowed = args.iops / r["disk_reads_per_step"] * args.batch
            print(f"{r['config']}: {r['disk_reads_per_step']:,.0f} disk reads per step at {args.iops:,.0f} IOPS allow "
                  f"{allowed:,.0f} samples/s; measured {r['samples_per_s'] / allowed:.2f}x of that, reading "
                  f"{r['disk_reads_per_step'] * r['samples_per_s'] / args.batch:,.0f} rows/s "
                  f"({r['disk_reads_per_step'] * r['samples_per_s'] / args.batch / args.iops:.0%} of the IOPS); "
                  f"a step {r['step_ms']:.1f} ms, of which {r['read_ahead_wait_ms_per_step']:.1f} ms waiting for the "
                  f"look-ahead's reads")
    write_json_report(args.out, {"args": vars(args), "rows": total_rows, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
