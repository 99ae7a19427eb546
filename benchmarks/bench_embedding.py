#!/usr/bin/env python3
"""Benchmarks DiskEmbeddingBag training side by side with in-memory references.

Measured: training throughput, as ids per second through forward + backward +
optimizer update (SGD, lr 0.01, mode "sum"), of one table of `--rows` rows x
`--dim` float32. All configurations run in one process, one after the other,
on the same pre-generated batches:

  torch     torch.nn.EmbeddingBag(sparse=True) + torch.optim.SGD, the table in memory;
  fbgemm    fbgemm-gpu-cpu's SplitTableBatchedEmbeddingBagsCodegen (HOST, CPU,
            EXACT_SGD: the update is fused into backward), the table in memory;
  disk-P%   DiskEmbeddingBag with memory_budget_bytes = P% of the table's bytes
            (rows x dim x 4; the default split: half of it the hot cache, half
            the store's in-memory log), each without and with lookahead one
            batch ahead (`emb.lookahead(next_ids)` right before the batch);
  policy    the smallest budget with cache_policy "lfu" (the default) and "lru",
            over a longer stream (`--policy-warmup` + `--policy-batches`) so
            that the cache fills and must choose what to keep: the hit rate of
            both on the same stream.

Workload: `--bags` bags per batch, each of a random length in 1..39 ids (mean
20), ids drawn Zipf(`--zipf`) over ranks 1..rows; ranks map to ids through a
fixed random permutation, so hot ids are scattered over the id space. The loss
is (out * target).sum() with one fixed random target, so gradients have both
signs and the weights stay bounded.

Before the disk configurations the store is filled with real rows (rows never
written are generated, not read): `import_rows` in chunks over every row at
the smallest budget, then flush and close; the import rate is reported. Each
disk configuration then opens a fresh copy of that directory (closing a table
writes its hot rows into the log's in-memory tail, which would warm the store
for the next configuration; `--reopen-same-store` skips the copy). Each
configuration runs `--warmup` untimed batches, then `--batches` timed ones; the
timed window ends when the last queued update is applied. Reported per
configuration: rows/s, ms per batch, the ratio to the faster in-memory
reference, process CPU cores busy, peak RSS (VmHWM since the configuration was
built), and for the disk configurations the cache hit rate over distinct ids in
the window beside two references: an oracle cache holding the `cache_rows`
hottest ids, and the share of ids seen in an earlier batch since the table was
opened (what an unbounded cache that starts empty could hit), plus the store's
counters over the window (rows read from disk, 4 KiB reads, lookahead).

Where time goes (disk configurations), by wall time around public calls: the
wait for the previous batch's update (`emb.synchronize()` right before the
forward: the applier thread's share, which a forward at staleness 0 would wait
for first), the lookahead, the forward (id checks, unique, the fetch through the
cache, pooling) and the backward (the gradient rows and queueing the update).
Unique alone is timed separately (DiskTableBatch.unique_keys).

Usage:
  python benchmarks/bench_embedding.py                  # 10M rows; about 5 minutes on 2 cores
  python benchmarks/bench_embedding.py --smoke          # tiny sizes, well under a minute
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from common import (REPO, MiB, ReportLog, cpu_seconds, dir_bytes, fmt_rate, machine_facts, markdown_table,
                    proc_status_kib, reset_peak_rss, system_busy_seconds, torch_embedding_bag, wait_for_quiet_machine,
                    write_json_report, zipf_cdf, zipf_ranks, Timer)

MAX_BAG_LENGTH = 39  # lengths uniform in 1..39: mean 20


# --------------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------------

@dataclass
class Batch:
    ids: torch.Tensor           # [n] int64
    offsets: torch.Tensor       # [bags] int64: bag starts (torch.nn.EmbeddingBag's convention)
    offsets_full: torch.Tensor  # [bags + 1] int64: with the end (fbgemm's convention)
    unique_ranks: np.ndarray    # sorted distinct Zipf ranks (0 = hottest) of the batch, for the oracle
    seen_before: int            # of those, how many occur in an earlier batch (a cold cache can hit no others)


class Workload:
    """The batches every configuration trains on, and the loss target."""

    def __init__(self, rows: int, dim: int, bags: int, count: int, zipf_s: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, MAX_BAG_LENGTH + 1, size=(count, bags))
        total = int(lengths.sum())
        # Bounded Zipf by inverse CDF; ranks go through a fixed permutation so hot ids are spread out.
        ranks = zipf_ranks(zipf_cdf(rows, zipf_s), rng.random(total))
        id_of_rank = rng.permutation(rows).astype(np.int64)
        ids = id_of_rank[ranks]
        del id_of_rank
        self.batches: List[Batch] = []
        seen = np.zeros(rows, dtype=bool)
        start = 0
        for b in range(count):
            n = int(lengths[b].sum())
            ends = np.cumsum(lengths[b])
            offsets_full = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int64))
            unique_ranks = np.unique(ranks[start:start + n])
            self.batches.append(Batch(ids=torch.from_numpy(ids[start:start + n].copy()),
                                      offsets=offsets_full[:-1].clone(), offsets_full=offsets_full,
                                      unique_ranks=unique_ranks, seen_before=int(seen[unique_ranks].sum())))
            seen[unique_ranks] = True
            start += n
        del seen
        self.top1pct_share = float(np.mean(ranks < max(1, rows // 100)))  # share of draws on the hottest 1% ids
        self.target = torch.randn(bags, dim, generator=torch.Generator().manual_seed(seed))

    def ids_in(self, first: int, count: int) -> int:
        return sum(b.ids.numel() for b in self.batches[first:first + count])

    def oracle_hit_rate(self, first: int, count: int, cache_rows: int) -> float:
        """Hit rate over these batches' distinct ids of a cache that always holds the `cache_rows` hottest ranks."""
        window = self.batches[first:first + count]
        hits = sum(int(np.searchsorted(b.unique_ranks, cache_rows)) for b in window)
        return hits / max(1, sum(b.unique_ranks.size for b in window))

    def seen_before_rate(self, first: int, count: int) -> float:
        """Share of these batches' distinct ids that occurred in an earlier batch since the first: the hit rate
        of an unbounded cache that starts empty at batch 0 (each configuration opens its table cold)."""
        window = self.batches[first:first + count]
        return sum(b.seen_before for b in window) / max(1, sum(b.unique_ranks.size for b in window))


# --------------------------------------------------------------------------------------------
# the configurations: one training step each
# --------------------------------------------------------------------------------------------

def add_time(times: Dict[str, float], phase: str, since: float) -> float:
    now = time.perf_counter()
    times[phase] += now - since
    return now


class InMemoryReference:
    """An in-memory table: its update is done when backward (or the optimizer step) returns."""

    def wait_for_updates(self) -> None:
        pass

    def counters(self) -> Dict[str, Any]:
        return {}


class TorchReference(InMemoryReference):
    """torch.nn.EmbeddingBag with a sparse gradient and torch.optim.SGD: the table in memory."""

    def __init__(self, rows: int, dim: int, lr: float, target: torch.Tensor) -> None:
        self.emb, self.optimizer = torch_embedding_bag(rows, dim, lr)
        self.target = target

    def step(self, batch: Batch, next_batch: Optional[Batch], times: Dict[str, float]) -> None:
        t = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        out = self.emb(batch.ids, batch.offsets)
        t = add_time(times, "forward", t)
        (out * self.target).sum().backward()
        t = add_time(times, "backward", t)
        self.optimizer.step()
        add_time(times, "optimizer_step", t)

    def close(self) -> None:
        del self.optimizer, self.emb


class FbgemmReference(InMemoryReference):
    """fbgemm's CPU table-batched embedding bag, one table, EXACT_SGD fused into backward."""

    def __init__(self, rows: int, dim: int, lr: float, target: torch.Tensor) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=lr, pooling_mode=PoolingMode.SUM)
        self.target = target

    def step(self, batch: Batch, next_batch: Optional[Batch], times: Dict[str, float]) -> None:
        t = time.perf_counter()
        out = self.tbe(batch.ids, batch.offsets_full)  # B*T+1 offsets, T = 1
        t = add_time(times, "forward", t)
        (out * self.target).sum().backward()  # the update is applied here
        add_time(times, "backward", t)

    def close(self) -> None:
        del self.tbe


class DiskBagRun:
    """DiskEmbeddingBag over a populated store directory, optionally with lookahead one batch ahead."""

    def __init__(self, rows: int, dim: int, lr: float, target: torch.Tensor, path: str, budget: int,
                 lookahead: bool, cache_policy: str = "lfu") -> None:
        from mlkv_torch import DiskEmbeddingBag, optim

        self.emb = DiskEmbeddingBag(rows, dim, path=path, mode="sum", optimizer=optim.SGD(lr=lr),
                                    memory_budget_bytes=budget, expected_rows=rows, cache_policy=cache_policy,
                                    reopen=True)  # the populated table
        self.lookahead = lookahead
        self.target = target

    def step(self, batch: Batch, next_batch: Optional[Batch], times: Dict[str, float]) -> None:
        t = time.perf_counter()
        if self.lookahead and next_batch is not None:
            self.emb.lookahead(next_batch.ids)
            t = add_time(times, "lookahead", t)
        # What the forward (staleness 0) waits for first, timed apart: the applier thread's share.
        self.emb.synchronize()
        t = add_time(times, "wait_for_update", t)
        out = self.emb(batch.ids, batch.offsets)
        t = add_time(times, "forward", t)
        (out * self.target).sum().backward()  # queues the fused SGD update for the applier thread
        add_time(times, "backward", t)

    def wait_for_updates(self) -> None:
        # Close the timed window only once every queued update is applied.
        self.emb.synchronize()

    def counters(self) -> Dict[str, Any]:
        return self.emb.stats()

    def close(self) -> None:
        self.emb.close()
        del self.emb


# Levels, not event counts: reported as they are at the end of the window, not as differences.
GAUGES = {"rows", "memory_bytes", "log_memory_bytes", "index_bytes", "disk_bytes", "page_bytes", "record_bytes",
          "cached_rows", "cache_rows", "pending_updates", "pending_rows", "max_staleness", "step"}


def counter_deltas(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, int]:
    return {k: after[k] - before[k] for k in after
            if k in before and k not in GAUGES and isinstance(after[k], int) and not isinstance(after[k], bool)
            and not k.endswith("_address")}


def run_config(name: str, make: Callable[[], Any], wl: Workload, warmup: int, batches: int,
               extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Builds one configuration, warms it up, times `batches` batches, frees it; returns its figures."""
    gc.collect()
    rss_base = proc_status_kib("VmRSS") / 1024
    reset_peak_rss()
    t0 = time.perf_counter()
    table = make()
    build_s = time.perf_counter() - t0
    res: Dict[str, Any] = {"name": name, **(extra or {}), "build_seconds": build_s, "rss_base_mib": rss_base}
    try:
        scratch: Dict[str, float] = defaultdict(float)
        for i in range(warmup):
            table.step(wl.batches[i], wl.batches[i + 1], scratch)
        table.wait_for_updates()
        before = table.counters()
        times: Dict[str, float] = defaultdict(float)
        timer = Timer()
        c0, busy0, w0 = cpu_seconds(), system_busy_seconds(), time.perf_counter()
        for i in range(warmup, warmup + batches):
            with timer:
                table.step(wl.batches[i], wl.batches[i + 1], times)
        t = time.perf_counter()
        table.wait_for_updates()
        times["wait_for_last_update"] += time.perf_counter() - t
        wall = time.perf_counter() - w0
        cpu = cpu_seconds() - c0
        other_busy = max(0.0, system_busy_seconds() - busy0 - cpu) / wall  # the machine is shared
        after = table.counters()
        ids = wl.ids_in(warmup, batches)
        batch_ms = timer.summary(1e3)  # median, p90, p99, max of the timed batches
        res.update(ids=ids, seconds=wall, rows_per_s=ids / wall, ms_per_batch=1e3 * wall / batches,
                   batch_ms=[1e3 * s for s in timer.seconds], batch_ms_summary=batch_ms,
                   batch_ms_median=batch_ms["median"], batch_ms_max=batch_ms["max"],
                   cpu_cores=cpu / wall, other_cores_busy=other_busy,
                   phase_ms_per_batch={k: 1e3 * v / batches for k, v in times.items()},
                   rss_mib=proc_status_kib("VmRSS") / 1024)
        if after:
            d = counter_deltas(before, after)
            looked_up = d["cache_hits"] + d["cache_misses"]
            res.update(counters=d, gauges={k: v for k, v in after.items() if k in GAUGES},
                       cache_rows=after["cache_rows"], hit_rate=d["cache_hits"] / max(1, looked_up),
                       hit_rate_since_open=after["hit_rate"], io_engine=after.get("io_engine"),
                       oracle_hit_rate=wl.oracle_hit_rate(warmup, batches, after["cache_rows"]),
                       seen_before_rate=wl.seen_before_rate(warmup, batches),
                       disk_rows_per_batch=d.get("disk_rows", 0) / batches,
                       disk_reads_per_batch=d.get("disk_reads", 0) / batches,
                       store_memory_bytes=after.get("memory_bytes"))
    finally:
        table.close()
        del table
        gc.collect()
    res["peak_rss_mib"] = proc_status_kib("VmHWM") / 1024
    res["peak_rss_over_base_mib"] = res["peak_rss_mib"] - rss_base
    return res


# --------------------------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------------------------

def populate_store(path: str, rows: int, dim: int, lr: float, budget: int, chunk: int, seed: int,
                   log: Callable[[str], None]) -> Dict[str, Any]:
    """Writes every row of the table with import_rows, then flushes and closes (checkpoints) the store."""
    from mlkv_torch import DiskEmbeddingBag, optim

    emb = DiskEmbeddingBag(rows, dim, path=path, mode="sum", optimizer=optim.SGD(lr=lr),
                           memory_budget_bytes=budget, expected_rows=rows)
    gen = torch.Generator().manual_seed(seed + 1)
    bound = (1.0 / rows) ** 0.5  # TorchRec's initial range, as rows never written
    import_s, t_start = 0.0, time.perf_counter()
    for start in range(0, rows, chunk):
        ids = torch.arange(start, min(rows, start + chunk), dtype=torch.int64)
        weights = torch.empty(ids.numel(), dim).uniform_(-bound, bound, generator=gen)
        t = time.perf_counter()
        emb.import_rows(ids, weights)
        import_s += time.perf_counter() - t
        done = start + ids.numel()
        log(f"#   imported {done:,} / {rows:,} rows ({done / import_s / 1e6:.2f}M rows/s in import_rows)")
    t = time.perf_counter()
    emb.flush()
    flush_s = time.perf_counter() - t
    t = time.perf_counter()
    emb.close()
    close_s = time.perf_counter() - t
    total = import_s + flush_s + close_s
    return {"rows": rows, "chunk": chunk, "budget": budget, "import_seconds": import_s, "flush_seconds": flush_s,
            "close_seconds": close_s, "rows_per_s": rows / total, "import_call_rows_per_s": rows / import_s,
            "wall_seconds": time.perf_counter() - t_start, "disk_mib": dir_bytes(path) / MiB}


def time_unique(wl: Workload, rows: int, first: int, count: int) -> Optional[float]:
    """ms per batch of the module's deduplication step alone (the kernel's unique_keys, which also
    checks each id's range); None when the module has no such step."""
    from mlkv_torch.embedding import DiskTable as TableSpec
    from mlkv_torch.opening import open_table_batch

    batches = wl.batches[first:first + count]
    with tempfile.TemporaryDirectory(prefix="bench-unique-") as work:
        kernel = open_table_batch([TableSpec("t", rows, os.path.join(work, "t"))], 8, memory_budget_bytes=1 << 20)
        if not hasattr(kernel, "unique_keys"):
            kernel.close()
            return None
        kernel.unique_keys(batches[0].ids, [batches[0].ids.numel()], [0])
        t = time.perf_counter()
        for b in batches:
            kernel.unique_keys(b.ids, [b.ids.numel()], [0])
        seconds = time.perf_counter() - t
        kernel.close()
    return 1e3 * seconds / count


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------

def markdown_report(results: List[Dict[str, Any]], best_ref: Optional[float], args: argparse.Namespace,
                    wl_facts: Dict[str, Any], populate: Optional[Dict[str, Any]], unique_ms: Optional[float],
                    policy: Optional[Dict[str, Any]], machine: Dict[str, Any]) -> str:
    ok = [r for r in results if "error" not in r]
    main_runs = [r for r in ok if not r.get("policy_comparison")]  # the policy runs have their own table
    lines = [f"Machine: {machine['cpus']} cores ({machine['cpu_model']}), {machine['memory_gib']:.0f} GiB, "
             f"torch {machine['torch']} ({machine['torch_threads']} threads), fbgemm-gpu {machine['fbgemm_gpu']}, "
             f"Linux {machine['kernel']}; commit {machine['commit']}"
             + (" with uncommitted changes." if machine["uncommitted_changes"] else "."),
             "",
             f"Table {args.rows:,} rows x {args.dim} float32 ({args.rows * args.dim * 4 / MiB:,.0f} MiB); batches of "
             f"{args.bags} bags of 1-{MAX_BAG_LENGTH} ids (mean {wl_facts['ids_per_batch']:,.0f} ids, "
             f"{wl_facts['unique_per_batch']:,.0f} distinct), Zipf({args.zipf}) over a permuted id space "
             f"(the hottest 1% of ids take {wl_facts['top1pct_share']:.0%} of draws); SGD lr {args.lr}, sum; "
             f"{args.warmup} warm-up + {args.batches} timed batches each.",
             ""]
    lines += ["| configuration | memory budget | rows/s | ms/batch | vs best in-memory | cache hit rate "
              "(hottest-rows oracle / seen before) | disk rows / 4 KiB reads per batch | CPU cores | peak RSS MiB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in main_runs:
        budget = f"{r['budget_fraction']:.0%} ({r['budget'] / MiB:,.0f} MiB)" if "budget" in r else "in memory"
        ratio = f"{r['rows_per_s'] / best_ref:.2f}x" if best_ref else "-"
        hit = (f"{r['hit_rate']:.1%} ({r['oracle_hit_rate']:.1%} / {r['seen_before_rate']:.1%})"
               if "hit_rate" in r else "-")
        disk = f"{r['disk_rows_per_batch']:,.0f} / {r['disk_reads_per_batch']:,.0f}" if "hit_rate" in r else "-"
        lines.append(f"| {r['label']} | {budget} | {fmt_rate(r['rows_per_s'])} | {r['ms_per_batch']:.1f} | {ratio} "
                     f"| {hit} | {disk} | {r['cpu_cores']:.2f} | {r['peak_rss_mib']:,.0f} |")
    for r in results:
        if "error" in r:
            lines.append(f"| {r.get('label', r['name'])} | - | error: {r['error'].splitlines()[0][:80]} | | | | | | |")
    busy = [r["other_cores_busy"] for r in ok]
    if busy and max(busy) > 0.25:
        lines += ["", f"Warning: other processes kept up to {max(busy):.2f} of {machine['cpus']} cores busy during "
                  f"the timed windows (mean {sum(busy) / len(busy):.2f}); rates are understated where that was high."]
    phases = ["lookahead", "wait_for_update", "forward", "backward", "optimizer_step", "wait_for_last_update"]
    lines += ["", "Where time goes, ms per batch (wait_for_update is the applier thread finishing the previous "
              "batch's update, waited for before the forward"
              + (f"; unique alone takes {unique_ms:.1f} ms of forward" if unique_ms is not None else "") + "):", ""]
    lines += markdown_table(["configuration", *phases],
                            [[r["label"], *(f"{r['phase_ms_per_batch'][k]:.1f}" if k in r["phase_ms_per_batch"]
                                            else "-" for k in phases)] for r in main_runs])
    counter_columns = [("cache_misses", "cache misses"), ("disk_rows", "rows read from disk"),
                       ("disk_reads", "4 KiB reads"), ("memory_hits", "store memory hits"),
                       ("rejected", "misses not admitted"), ("written_back", "rows written back"),
                       ("promoted_rows", "rows promoted"), ("read_ahead_rows", "rows read ahead, staged"),
                       ("read_ahead_hits", "rows read ahead, used"),
                       ("lookahead_rows", "lookahead rows to store memory")]
    disk_runs = [r for r in ok if "counters" in r]
    present = [(k, title) for k, title in counter_columns if any(k in r["counters"] for r in disk_runs)]
    if disk_runs:
        lines += ["", "Cache and store counters over the timed window, per batch:", ""]
        lines += markdown_table(["configuration", *(title for _, title in present)],
                                [[r["label"], *(f"{r['counters'][k] / r['batches']:,.0f}" if k in r["counters"]
                                                else "-" for k, _ in present)] for r in disk_runs])
    if populate:
        lines += ["", f"Populating the store: {populate['rows']:,} rows by import_rows in chunks of "
                  f"{populate['chunk']:,} at the {populate['budget'] / MiB:,.0f} MiB budget: "
                  f"{fmt_rate(populate['rows_per_s'])} rows/s including flush and close "
                  f"({populate['import_seconds']:.1f} s import_rows, {populate['flush_seconds']:.1f} s flush, "
                  f"{populate['close_seconds']:.1f} s close); {populate['disk_mib']:,.0f} MiB on disk."]
    if policy:
        lines += ["", f"Cache policy at the {policy['budget_fraction']:.0%} budget ({policy['cache_rows']:,} cache "
                  f"rows), same stream, no lookahead, {policy['warmup']} warm-up + {policy['batches']} timed batches "
                  f"(hit rates over the timed ones):", "",
                  "| policy | cache hit rate | rows/s |", "|---|---|---|",
                  f"| lfu (the default) | {policy['lfu_hit_rate']:.1%} | {fmt_rate(policy['lfu_rows_per_s'])} |",
                  f"| lru | {policy['lru_hit_rate']:.1%} | {fmt_rate(policy['lru_rows_per_s'])} |",
                  f"| oracle: the {policy['cache_rows']:,} hottest ids | {policy['oracle_hit_rate']:.1%} | - |",
                  f"| bound: ids seen in an earlier batch | {policy['seen_before_rate']:.1%} | - |",
                  "", f"lfu / lru hit rate: {policy['lfu_over_lru']:.2f}x"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bags", type=int, default=4096, help="bags per batch")
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=150,
                    help="untimed batches per configuration: the cache starts empty and fills over about 100")
    ap.add_argument("--batches", type=int, default=30, help="timed batches per configuration")
    ap.add_argument("--policy-warmup", type=int, default=150,
                    help="untimed batches of the cache-policy comparison (long enough to fill the cache)")
    ap.add_argument("--policy-batches", type=int, default=40, help="timed batches of the cache-policy comparison")
    ap.add_argument("--budgets", default="1.0,0.25,0.1", help="memory budgets, as fractions of the table's bytes")
    ap.add_argument("--lookahead", default="off,on", help="lookahead variants of every budget")
    ap.add_argument("--configs", default="torch,fbgemm,disk,policy", help="which configurations to run")
    ap.add_argument("--import-chunk", type=int, default=1_000_000, help="rows per import_rows call")
    ap.add_argument("--dir", default=os.path.join(REPO, "bench-out", "tmp"),
                    help="a fresh directory for the store is made under this one and removed at the end")
    ap.add_argument("--keep-store", action="store_true", help="leave the store directories in place")
    ap.add_argument("--reopen-same-store", action="store_true",
                    help="reopen the populated directory itself for each configuration instead of a fresh copy "
                         "(faster; later configurations then start with the hot rows earlier ones wrote back)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="default bench-out/bench_embedding.json (-smoke.json with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script works")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to this long for other processes to leave the CPUs idle (< 0.3 cores busy)")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.bags, args.warmup, args.batches, args.import_chunk = 200_000, 256, 3, 5, 64_000
        args.policy_warmup, args.policy_batches = 10, 10
    if args.json is None:
        name = "bench_embedding-smoke.json" if args.smoke else "bench_embedding.json"
        args.json = os.path.join(REPO, "bench-out", name)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = set(c for c in args.configs.split(",") if c)
    fractions = sorted((float(x) for x in args.budgets.split(",") if x), reverse=True)
    lookaheads = [{"off": False, "on": True}[x] for x in args.lookahead.split(",") if x]
    table_bytes = args.rows * args.dim * 4

    log = ReportLog()
    lines = log.lines

    if args.wait_quiet > 0:
        wait_for_quiet_machine(args.wait_quiet)

    t_start = time.perf_counter()
    machine = machine_facts()
    log(f"# bench_embedding  {time.strftime('%Y-%m-%d %H:%M:%S')}  cpus={machine['cpus']} torch={machine['torch']} "
        f"threads={machine['torch_threads']} fbgemm_gpu={machine['fbgemm_gpu']} kernel={machine['kernel']}")
    log(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")

    t = time.perf_counter()
    stream = max(args.warmup + args.batches, args.policy_warmup + args.policy_batches if "policy" in configs else 0)
    wl = Workload(args.rows, args.dim, args.bags, stream + 1, args.zipf, args.seed)
    timed = wl.batches[args.warmup:args.warmup + args.batches]
    wl_facts = {"ids_per_batch": wl.ids_in(args.warmup, args.batches) / args.batches,
                "unique_per_batch": sum(b.unique_ranks.size for b in timed) / args.batches,
                "top1pct_share": wl.top1pct_share, "seconds_to_generate": time.perf_counter() - t}
    log(f"# workload: {args.rows:,} rows x {args.dim}, {args.bags} bags/batch, {wl_facts['ids_per_batch']:,.0f} ids "
        f"({wl_facts['unique_per_batch']:,.0f} distinct) per batch, Zipf({args.zipf}); "
        f"generated in {wl_facts['seconds_to_generate']:.1f} s")

    results: List[Dict[str, Any]] = []

    def record(name: str, label: str, make: Callable[[], Any], warmup: Optional[int] = None,
               batches: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
        log(f"# run {label} ...")
        warmup = args.warmup if warmup is None else warmup
        batches = args.batches if batches is None else batches
        try:
            r = run_config(name, make, wl, warmup, batches, dict(extra, label=label, warmup=warmup, batches=batches))
        except Exception as e:  # noqa: BLE001  (one failing configuration must not hide the others)
            import traceback
            first_line = (str(e).splitlines() or [""])[0]
            r = {"name": name, "label": label, **extra, "error": f"{type(e).__name__}: {first_line}",
                 "traceback": traceback.format_exc()}
            log(f"#   ERROR: {type(e).__name__}: {first_line}")
        else:
            msg = (f"#   {fmt_rate(r['rows_per_s'])} rows/s, {r['ms_per_batch']:.1f} ms/batch, "
                   f"peak RSS {r['peak_rss_mib']:,.0f} MiB (built in {r['build_seconds']:.1f} s); other processes "
                   f"kept {r['other_cores_busy']:.2f} cores busy")
            if "hit_rate" in r:
                msg += (f", hit rate {r['hit_rate']:.1%} (oracle {r['oracle_hit_rate']:.1%}, seen before "
                        f"{r['seen_before_rate']:.1%}), "
                        f"{r['disk_rows_per_batch']:,.0f} disk rows/batch")
                if r["counters"].get("fresh_rows"):
                    msg += f"; WARNING: {r['counters']['fresh_rows']} never-written rows were generated, not read"
            log(msg)
        results.append(r)
        return r

    def ref(name: str) -> Optional[float]:
        return next((r["rows_per_s"] for r in results if r["name"] == name and "error" not in r), None)

    if "torch" in configs:
        record("torch", "torch.nn.EmbeddingBag + SGD",
               lambda: TorchReference(args.rows, args.dim, args.lr, wl.target))
    if "fbgemm" in configs:
        record("fbgemm", "fbgemm TBE (CPU, EXACT_SGD)",
               lambda: FbgemmReference(args.rows, args.dim, args.lr, wl.target))

    populate, unique_ms, policy = None, None, None
    if configs & {"disk", "policy"}:
        os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="bench-embedding-", dir=args.dir)
        populated = os.path.join(root, "populated")
        work = populated if args.reopen_same_store else os.path.join(root, "table")
        smallest = int(table_bytes * fractions[-1])

        def disk_run(fraction: float, lookahead: bool, policy_name: str = "lfu",
                     long_run: bool = False) -> Dict[str, Any]:
            """One DiskEmbeddingBag configuration on a copy of the populated store: every configuration
            starts from the same files (closing a table writes its hot rows into the log's in-memory tail,
            which would warm the store for the next one)."""
            copy_s = 0.0
            if work != populated:
                t = time.perf_counter()
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(populated, work)
                os.sync()  # the copy's dirty pages must not be written back during the timed window
                copy_s = time.perf_counter() - t
            budget = int(table_bytes * fraction)
            name = f"disk-{fraction:g}-" + ("lookahead" if lookahead else "plain") + \
                (f"-policy-{policy_name}" if long_run else "")
            label = f"DiskEmbeddingBag {fraction:.0%}" + (" + lookahead" if lookahead else "") + \
                (f", {policy_name}, {args.policy_warmup}+{args.policy_batches} batches" if long_run else "")
            return record(name, label, lambda: DiskBagRun(args.rows, args.dim, args.lr, wl.target, work, budget,
                                                         lookahead, policy_name),
                          warmup=args.policy_warmup if long_run else None,
                          batches=args.policy_batches if long_run else None,
                          budget=budget, budget_fraction=fraction, lookahead=lookahead, cache_policy=policy_name,
                          copy_seconds=copy_s, policy_comparison=long_run)

        try:
            log(f"# populating {populated}: {args.rows:,} rows at budget {smallest / MiB:,.1f} MiB ...")
            populate = populate_store(populated, args.rows, args.dim, args.lr, smallest, args.import_chunk, args.seed,
                                      log)
            log(f"#   {fmt_rate(populate['rows_per_s'])} rows/s with flush and close; "
                f"{populate['disk_mib']:,.0f} MiB on disk")
            unique_ms = time_unique(wl, args.rows, args.warmup, args.batches)
            if "disk" in configs:
                for fraction in fractions:
                    for lookahead in lookaheads:
                        disk_run(fraction, lookahead)
            if "policy" in configs:
                fraction = fractions[-1]
                lfu = disk_run(fraction, False, "lfu", long_run=True)
                lru = disk_run(fraction, False, "lru", long_run=True)
                if "error" not in lfu and "error" not in lru:
                    policy = {"budget_fraction": fraction, "budget": lfu["budget"], "cache_rows": lfu["cache_rows"],
                              "warmup": args.policy_warmup, "batches": args.policy_batches,
                              "lfu_hit_rate": lfu["hit_rate"], "lru_hit_rate": lru["hit_rate"],
                              "lfu_over_lru": lfu["hit_rate"] / max(lru["hit_rate"], 1e-12),
                              "lfu_rows_per_s": lfu["rows_per_s"], "lru_rows_per_s": lru["rows_per_s"],
                              "oracle_hit_rate": lfu["oracle_hit_rate"], "seen_before_rate": lfu["seen_before_rate"]}
        except Exception as e:  # noqa: BLE001  (the tables below show what ran)
            log(f"#   ERROR in the disk configurations: {type(e).__name__}: {e}")
            results.append({"name": "disk", "label": "DiskEmbeddingBag", "error": f"{type(e).__name__}: {e}"})
        finally:
            if args.keep_store:
                log(f"# store kept at {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)

    refs = [x for x in (ref("torch"), ref("fbgemm")) if x]
    best_ref = max(refs) if refs else None
    for r in results:
        if best_ref and "rows_per_s" in r:
            r["vs_best_in_memory"] = r["rows_per_s"] / best_ref
    report = markdown_report(results, best_ref, args, wl_facts, populate, unique_ms, policy, machine)
    log("")
    log(report)
    log("")
    log(f"# total {time.perf_counter() - t_start:.0f} s")

    write_json_report(args.json, {"args": vars(args), "machine": machine, "workload": wl_facts, "populate": populate,
                                  "unique_ms_per_batch": unique_ms, "best_in_memory_rows_per_s": best_ref,
                                  "results": results, "cache_policy": policy, "markdown": report, "stdout": lines})
    print(f"# wrote {args.json}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
