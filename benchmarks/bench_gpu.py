#!/usr/bin/env python3
"""Benchmarks the table-batched disk kernel with its cache in GPU memory against torch's embedding
bag held entirely in GPU memory, on the same batches, in one run.

    python benchmarks/bench_gpu.py [--rows 10000000] [--dim 128] [--tables 26] [--batch 8192] [--smoke]

Workload: `--tables` tables of `--rows` / `--tables` rows each (10M x 128 in all by default),
`--bag` Zipf(`--zipf`) ids per feature per sample (hot ids scattered over each table), one
feature per table, `--batch` samples; the loss is the pooled rows against a fixed random target,
so the step is the tables' forward, backward and optimizer alone.

  reference  one torch.nn.EmbeddingBag(sparse=True) over every table's rows (the tables
             concatenated, as a table-batched kernel holds them), with torch.optim.SGD or
             SparseAdam, all in GPU memory;
  disk       DiskTableBatch with `cache` x rows in its GPU cache, the same initial rows,
             staleness 0. At 1.0 every row is brought into the cache before timing (the
             all-cached regime: no misses); under 1.0 the tables are populated first, so misses
             read rows from the store.

`--configs` lists optimizer:cache[:look-ahead depth[:bag backward]] entries (by default every row
cached with SGD, both ways of reducing gradients, and Adam; 10% cached with SGD without look-ahead
and with depths 2 and 4). With a depth d, before step i the batch of step i + d is read ahead
(`DiskTableBatch.lookahead`): on CUDA its misses go into device slots ahead of its step, and the step
names its batch as the one read ahead (`pool(read_ahead=ticket)`: the read-ahead's host deduplication
and slots, no synchronisation; at cache 1.0 that is all a depth changes). The bag
backward is `DiskTableBatch.bag_backward` ("index_add", the default, or "sorted"). Reported
per configuration: samples/s and the ratio to the reference of the same optimizer, hit rate,
store reads per step, the stores' read rate on this machine (rows/s, one thread, as the read-ahead
thread reads) and the roofline it sets (store reads per step / that rate), host<->device copies and
synchronisations per step (torch profiler over
`--profile-steps` steps), where the time goes (the profiler's top operators), and whether the
losses equal the reference's step by step (they must, within float rounding: staleness 0).
Runs on the CPU as well (the smoke test in the suite does), where "GPU memory" is host memory.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from common import REPO, ReportLog, markdown_table, torch_embedding_bag, write_json_report

sys.path.insert(0, REPO)
from mlkv_torch import initial_rows, optim  # noqa: E402
from mlkv_torch.embedding import DiskEmbeddingBag, DiskTable  # noqa: E402
from mlkv_torch.opening import open_table_batch  # noqa: E402

LR = 0.05


def parse_args(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000, help="rows of all tables together")
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--bag", type=int, default=1, help="ids per feature per sample")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--configs",
                    default="sgd:1.0,sgd:1.0:1,sgd:1.0:0:sorted,adam:1.0,adam:1.0:1,sgd:0.1,sgd:0.1:2,sgd:0.1:4",
                    help="optimizer:cache fraction[:look-ahead depth[:bag backward]] entries; optimizers sgd, adam; "
                         "bag backward index_add or sorted")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--into-slots", action="store_true",
                    help="read ahead into slots on the CPU too (the default on CUDA): the named lookup's CPU path")
    ap.add_argument("--unnamed", action="store_true",
                    help="do not name batches as the ones read ahead (each lookup deduplicates and finds its rows)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--out", default="bench-out/gpu.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny run on the CPU: checks that the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.tables, args.dim, args.batch, args.warmup, args.steps = 3000, 3, 8, 64, 2, 4
        args.profile_steps, args.configs, args.device = 1, "sgd:1.0,sgd:1.0:0:sorted,sgd:0.1,sgd:0.1:2,adam:1.0", "cpu"
    return args


@dataclass
class Batch:
    values: torch.Tensor  # ids, feature after feature, host memory (pinned with a GPU)
    global_ids: torch.Tensor  # the same ids in the concatenated table (the reference's input)
    offsets: torch.Tensor  # [tables * batch + 1], include_last_offset
    target: torch.Tensor  # [tables * batch, dim] on the device


def make_batches(args: argparse.Namespace, rows_per_table: int, count: int, device: torch.device) -> List[Batch]:
    """`count` batches of Zipf ids, the same for every configuration (seeded)."""
    g = torch.Generator().manual_seed(1234)
    ranks = torch.arange(1, rows_per_table + 1, dtype=torch.float64)
    cdf = (ranks ** -args.zipf).cumsum(0)
    cdf /= cdf[-1].clone()
    # Hot ids scattered over the table, differently per table (a fixed permutation of the ranks).
    scatter = [torch.randperm(rows_per_table, generator=g) for _ in range(args.tables)]
    per_feature = args.batch * args.bag
    base = torch.arange(args.tables, dtype=torch.int64).repeat_interleave(per_feature) * rows_per_table
    offsets = torch.arange(args.tables * args.batch + 1, dtype=torch.int64) * args.bag
    pin = device.type == "cuda"
    batches = []
    for _ in range(count):
        ranks_drawn = torch.searchsorted(cdf, torch.rand(args.tables, per_feature, generator=g, dtype=torch.float64))
        values = torch.cat([scatter[t][ranks_drawn[t].clamp_max_(rows_per_table - 1)] for t in range(args.tables)])
        target = torch.randn(args.tables * args.batch, args.dim, generator=g)
        batches.append(Batch(values.pin_memory() if pin else values,
                             (values + base).pin_memory() if pin else values + base,
                             offsets.pin_memory() if pin else offsets, target.to(device)))
    return batches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Reference:
    """torch.nn.EmbeddingBag over the concatenated tables, with torch's sparse optimizer."""

    def __init__(self, args: argparse.Namespace, optimizer: str, weights: torch.Tensor, device: torch.device) -> None:
        self.device = device
        self.bag, self.opt = torch_embedding_bag(weights.shape[0], args.dim, LR, optimizer, weights,
                                                 include_last_offset=True, device=device)

    def step(self, batches: List[Batch], i: int) -> torch.Tensor:
        b = batches[i]
        ids = b.global_ids.to(self.device, non_blocking=True)
        offsets = b.offsets.to(self.device, non_blocking=True)
        loss = (self.bag(ids, offsets) * b.target).sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


class Disk:
    """The tables on DiskTableBatch, the cache on the device."""

    def __init__(self, args: argparse.Namespace, optimizer: str, cache: float, depth: int, rows_per_table: int,
                 root: str, device: torch.device) -> None:
        self.depth = depth
        self.named = depth > 0 and not args.unnamed
        rule = optim.SGD(lr=LR) if optimizer == "sgd" else optim.Adam(lr=LR)
        self.tables = list(range(args.tables))
        self.counts = [args.batch * args.bag] * args.tables
        self.batch = open_table_batch(
            [DiskTable(f"t{t}", rows_per_table, os.path.join(root, f"t{t}"), seed=t) for t in self.tables], args.dim,
            optimizer=rule, cache_rows=int(cache * rows_per_table * args.tables), memory_budget_bytes=512 << 20,
            device=device, read_ahead_into_slots=True if args.into_slots else None)

    def populate(self) -> float:
        start = time.perf_counter()
        for t in self.tables:
            DiskEmbeddingBag.of_batch(self.batch, t).populate()
        return time.perf_counter() - start

    def load_all(self, chunk: int = 1 << 20) -> float:
        """Brings every row into the cache (a cache of every row: the all-cached regime)."""
        start = time.perf_counter()
        with torch.no_grad():
            for t in self.tables:
                rows = self.batch.tables[t].num_embeddings
                for first in range(0, rows, chunk):
                    ids = torch.arange(first, min(rows, first + chunk))
                    self.batch.pool(ids, [ids.numel()], [t], torch.arange(ids.numel() + 1))
        synchronize(self.batch.device)
        return time.perf_counter() - start

    def read_ahead_first(self, batches: List[Batch]) -> None:
        """Reads ahead the batches before step 0's look-ahead window."""
        self.tickets = {i: self.batch.lookahead(b.values, self.counts, self.tables)
                        for i, b in enumerate(batches[:self.depth])}

    def step(self, batches: List[Batch], i: int) -> torch.Tensor:
        if self.depth and i + self.depth < len(batches):
            self.tickets[i + self.depth] = self.batch.lookahead(batches[i + self.depth].values, self.counts,
                                                                self.tables)
        b = batches[i]
        # Every batch was read ahead when there is a depth: the step names it by its ticket (no
        # synchronisation on CUDA).
        ticket = self.tickets.pop(i, None) if self.named else None
        loss = (self.batch.pool(b.values, self.counts, self.tables, b.offsets, read_ahead=ticket) * b.target).sum()
        loss.backward()
        return loss.detach()

    def store_read_rate(self, rows: int = 1 << 16, threads: int = 1) -> float:
        """Rows a second the stores deliver, in one batched read per table of random rows (as the
        read-ahead reads a batch's misses), the tables read by `threads` threads side by side."""
        from concurrent.futures import ThreadPoolExecutor

        g = torch.Generator().manual_seed(7 + threads)
        per_table = max(1, rows // len(self.tables))
        ids = [torch.randint(0, self.batch.tables[t].num_embeddings, (per_table,), generator=g) for t in self.tables]
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(lambda t: self.batch.stores[t].lookup(ids[t]), self.tables))
            return per_table * len(self.tables) / (time.perf_counter() - start)

    def counters(self) -> Dict[str, int]:
        """The cache's hits, misses and store reads over every table; the rows the read-ahead thread
        read (counted for the tables together), into slots or the staging area, among the reads."""
        stats = [self.batch.stats(t) for t in self.tables]
        counts = {k: sum(s[k] for s in stats) for k in ("cache_hits", "cache_misses", "store_reads")}
        counts["store_reads"] += stats[0]["read_ahead_rows"] + stats[0]["read_ahead_placed_rows"]
        return counts

    def close(self) -> None:
        self.batch.close()


def time_steps(model: Any, batches: List[Batch], steps: range, device: torch.device) -> Tuple[float, List[float]]:
    """Seconds for the steps of `batches` in `steps`, and their losses (read after the clock stops)."""
    synchronize(device)
    start = time.perf_counter()
    losses = [model.step(batches, i) for i in steps]
    synchronize(device)
    return time.perf_counter() - start, [float(x) for x in losses]


def profile_steps(model: Any, batches: List[Batch], steps: range, device: torch.device, out_dir: Optional[str],
                  name: str) -> Dict[str, Any]:
    """Host<->device copies and synchronisations per step, and the operators that take the time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in steps:
            model.step(batches, i)
        synchronize(device)
    n = len(steps)
    counts = {"h2d": 0, "d2h": 0, "syncs": 0}
    for e in prof.events():
        if e.name.startswith("Memcpy HtoD"):
            counts["h2d"] += 1
        elif e.name.startswith("Memcpy DtoH"):
            counts["d2h"] += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            counts["syncs"] += 1
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    if out_dir:  # one file for every configuration's profile
        with open(os.path.join(out_dir, "profiles.txt"), "a") as f:
            f.write(f"## {name}\n" + table + "\n\n" + prof.key_averages().table(sort_by=sort_by, row_limit=15) + "\n\n")
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:8]
    return {"copies_h2d_per_step": counts["h2d"] / n, "copies_d2h_per_step": counts["d2h"] / n,
            "syncs_per_step": counts["syncs"] / n,
            "top_cpu_ops_ms_per_step": {a.key: round(a.self_cpu_time_total / 1e3 / n, 3) for a in top}}


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    log = ReportLog()
    rows_per_table = args.rows // args.tables
    configs = []
    for item in args.configs.split(","):
        name, cache, *rest = item.split(":")
        depth = rest[0] if rest else "0"
        backward = rest[1] if len(rest) > 1 else "index_add"
        if name not in ("sgd", "adam") or backward not in ("index_add", "sorted") or len(rest) > 2:
            raise SystemExit(f"--configs takes optimizer:cache[:depth[:backward]] with optimizer sgd or adam and "
                             f"backward index_add or sorted, got {item!r}")
        configs.append((name, float(cache), int(depth), backward))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    log(f"# bench_gpu {datetime.date.today()}: {gpu}, torch {torch.__version__}, {args.tables} tables x "
        f"{rows_per_table} rows x {args.dim}, batch {args.batch} x {args.tables} features x {args.bag} ids, "
        f"Zipf {args.zipf}, {args.steps} timed steps after {args.warmup}")
    batches = make_batches(args, rows_per_table, args.warmup + args.steps + args.profile_steps, device)
    warm, timed, profiled = (range(args.warmup), range(args.warmup, args.warmup + args.steps),
                             range(args.warmup + args.steps, len(batches)))
    root = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    results: List[Dict[str, Any]] = []
    try:
        initial = torch.cat([initial_rows(torch.arange(rows_per_table), args.dim, seed=t, num_embeddings=rows_per_table)
                             for t in range(args.tables)])
        reference_rate: Dict[str, float] = {}
        reference_losses: Dict[str, List[float]] = {}
        for opt_name in dict.fromkeys(c[0] for c in configs):
            ref = Reference(args, opt_name, initial, device)
            time_steps(ref, batches, warm, device)
            seconds, losses = time_steps(ref, batches, timed, device)
            reference_rate[opt_name] = args.batch * len(timed) / seconds
            reference_losses[opt_name] = losses
            prof = profile_steps(ref, batches, profiled, device, out_dir, f"reference-{opt_name}")
            results.append(dict(config=f"reference {opt_name}", samples_per_s=reference_rate[opt_name], ratio=1.0,
                                **prof))
            log(f"reference {opt_name}: {reference_rate[opt_name]:,.0f} samples/s")
            del ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for opt_name, cache, depth, backward in configs:
            label = (f"disk {opt_name} cache {cache:g}" + (f" look-ahead {depth}" if depth else "")
                     + (f" {backward} backward" if backward != "index_add" else ""))
            path = os.path.join(root, label.replace(" ", "-"))
            disk = Disk(args, opt_name, cache, depth, rows_per_table, path, device)
            disk.batch.bag_backward = backward
            populate_s = disk.populate() if cache < 1.0 else disk.load_all()
            read_rate = disk.store_read_rate() if cache < 1.0 else None
            # The stores' rate with every core reading a table of its own: what the machine can deliver.
            side_by_side = min(os.cpu_count() or 1, len(disk.tables))
            parallel_rate = disk.store_read_rate(1 << 18, side_by_side) if cache < 1.0 else None
            disk.read_ahead_first(batches)
            time_steps(disk, batches, warm, device)
            before = disk.counters()
            seconds, losses = time_steps(disk, batches, timed, device)
            after = disk.counters()
            looked_up = (after["cache_hits"] - before["cache_hits"]) + (after["cache_misses"] - before["cache_misses"])
            prof = profile_steps(disk, batches, profiled, device, out_dir, label.replace(" ", "-"))
            ref_losses = reference_losses[opt_name]
            # Relative to the losses' scale: a loss is a sum of signed terms, near zero at times.
            worst = max(abs(a - b) for a, b in zip(losses, ref_losses)) / max(1e-12, max(abs(b) for b in ref_losses))
            rate = args.batch * len(timed) / seconds
            store_reads = (after["store_reads"] - before["store_reads"]) / len(timed)
            # The I/O roofline: a step cannot be shorter than reading its rows at the stores' rate.
            roofline = (args.batch / (store_reads / read_rate)) if read_rate and store_reads else None
            results.append(dict(config=label, samples_per_s=rate, ratio=rate / reference_rate[opt_name],
                                hit_rate=(after["cache_hits"] - before["cache_hits"]) / looked_up if looked_up else 0.0,
                                store_reads_per_step=store_reads, store_read_rows_per_s=read_rate,
                                store_read_rows_per_s_side_by_side=parallel_rate, store_read_threads=side_by_side,
                                roofline_samples_per_s=roofline, of_roofline=rate / roofline if roofline else None,
                                populate_s=populate_s, loss_max_rel_diff=worst,
                                losses_equal=worst < (1e-5 if device.type == "cpu" else 1e-3), **prof))
            r = results[-1]
            # Each configuration's figures as it ends, so a run cut short by its time limit keeps them.
            log(f"{label}: {r['samples_per_s']:,.0f} samples/s ({r['ratio']:.3f}x), hit rate {r['hit_rate']:.3f}, "
                f"populated in {populate_s:.1f} s, losses equal {r['losses_equal']}")
            write_json_report(args.out, dict(args=vars(args), gpu=gpu, torch=torch.__version__,
                                             date=str(datetime.date.today()), results=results, lines=log.lines))
            disk.close()
            shutil.rmtree(path, ignore_errors=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log("")
    for line in markdown_table(
            ["configuration", "samples/s", "x reference", "hit rate", "store reads/step", "x I/O roofline",
             "H2D/step", "D2H/step", "syncs/step", "losses equal"],
            [[r["config"], f"{r['samples_per_s']:,.0f}", f"{r['ratio']:.3f}", f"{r.get('hit_rate', 1.0):.3f}",
              f"{r.get('store_reads_per_step', 0):,.0f}",
              f"{r['of_roofline']:.2f}" if r.get("of_roofline") else "-", f"{r['copies_h2d_per_step']:.1f}",
              f"{r['copies_d2h_per_step']:.1f}", f"{r['syncs_per_step']:.1f}", r.get("losses_equal", "-")]
             for r in results]):
        log(line)
    for r in results:
        if r.get("store_read_rows_per_s"):
            log(f"{r['config']}: stores read {r['store_read_rows_per_s']:,.0f} rows/s on one thread, "
                f"{r['store_read_rows_per_s_side_by_side']:,.0f} on {r['store_read_threads']} side by side; "
                f"roofline {r['roofline_samples_per_s']:,.0f} samples/s")
        log(f"{r['config']}: top host ops (ms/step) {r['top_cpu_ops_ms_per_step']}")
    write_json_report(args.out, dict(args=vars(args), gpu=gpu, torch=torch.__version__,
                                     date=str(datetime.date.today()), results=results, lines=log.lines))
    return 0 if all(r.get("losses_equal", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
