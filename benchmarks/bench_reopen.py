#!/usr/bin/env python3
"""Reopening a store and reading a whole table, against the table's size.

For each size (--rows), a KVStore of rows of 17 float32 (an embedding row of dim 16 and its
row-wise Adagrad state) behind a 64 MiB budget, direct I/O, cut checkpoints as tables use: every
row written, then a tenth overwritten, and checkpointed; closed. Then, each with the page cache
dropped first (root only; the output says if not):

- reopen with the index checkpoint (the image written with the checkpoint, what a reopen loads);
- reopen without it (the image deleted: the index is rebuilt from a scan of the whole log, what
  every reopen did before);
- whole-table reads (what a DCP save or `snapshot` does): `scan()` (the log read in address
  order) against batched `get` in key order and in random order, each timed for at most
  --read-seconds, as rows/s and the whole table's time at that rate.

    python benchmarks/bench_reopen.py [--rows 1000000 4000000 16000000] [--smoke]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

from common import REPO, drop_caches, markdown_table, write_json_report  # drop_caches: root only

DIM = 17
BUDGET = 64 << 20


def timed_reads(store: Any, keys_in_order: Any, seconds: float, batch: int = 1 << 16) -> float:
    """Rows/s of batched gets over `keys_in_order`, for at most `seconds`."""
    began, done = time.perf_counter(), 0
    for start in range(0, keys_in_order.numel(), batch):
        store.get(keys_in_order[start:start + batch])
        done += min(batch, keys_in_order.numel() - start)
        if time.perf_counter() - began > seconds:
            break
    return done / (time.perf_counter() - began)


def measure(rows: int, work: str, read_seconds: float) -> Dict[str, Any]:
    import torch

    from mlkv_torch import KVStore

    path = os.path.join(work, f"store-{rows}")
    began = time.perf_counter()
    with KVStore(path, dim=DIM, memory_budget_bytes=BUDGET, expected_rows=rows, cut_checkpoints=True) as store:
        g = torch.Generator().manual_seed(rows)
        for start in range(0, rows, 1 << 20):
            keys = torch.arange(start, min(rows, start + (1 << 20)))
            store.put(keys, torch.rand(keys.numel(), DIM, generator=g))
        store.checkpoint()
        overwritten = torch.randperm(rows, generator=g)[: rows // 10]
        for start in range(0, overwritten.numel(), 1 << 20):
            keys = overwritten[start:start + (1 << 20)]
            store.put(keys, torch.rand(keys.numel(), DIM, generator=g))
        store.checkpoint()
    write_s = time.perf_counter() - began
    disk_bytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*")))
    result: Dict[str, Any] = dict(rows=rows, write_s=write_s, disk_bytes=disk_bytes)
    for label in ("with_index_image", "log_scan"):
        if label == "log_scan":
            for image in glob.glob(os.path.join(path, "index-*.dat")):
                os.unlink(image)
        result["page_cache_dropped"] = drop_caches() is None
        began = time.perf_counter()
        store = KVStore(path, dim=DIM, memory_budget_bytes=BUDGET, cut_checkpoints=True)
        result[f"reopen_{label}_s"] = time.perf_counter() - began
        # A store whose log is mostly in memory writes no image (loading it would not pay).
        result[f"reopen_{label}_loaded_image"] = bool(store.stats()["recovered_from_index_image"])
        assert len(store) == rows
        if label == "log_scan":  # whole-table reads, from the disk
            drop_caches()
            began, scanned = time.perf_counter(), 0
            for keys, _ in store.scan():
                scanned += keys.numel()
            scan_s = time.perf_counter() - began
            assert scanned == rows, (scanned, rows)
            drop_caches()
            in_order = timed_reads(store, torch.arange(rows), read_seconds)
            drop_caches()
            shuffled = timed_reads(store, torch.randperm(rows, generator=torch.Generator().manual_seed(1)),
                                   read_seconds)
            result.update(scan_s=scan_s, scan_rows_per_s=rows / scan_s, get_in_key_order_rows_per_s=in_order,
                          get_random_rows_per_s=shuffled, get_in_key_order_table_s=rows / in_order,
                          get_random_table_s=rows / shuffled)
        store.close()
    shutil.rmtree(path)
    return result


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000, 16_000_000])
    ap.add_argument("--read-seconds", type=float, default=10.0)
    ap.add_argument("--dir", default=None, help="where the stores go (default: bench-out/)")
    ap.add_argument("--out", default="bench-out/bench_reopen.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.read_seconds = [20_000], 0.5
    sys.path.insert(0, REPO)
    os.makedirs(os.path.join(REPO, "bench-out"), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-reopen-", dir=args.dir or os.path.join(REPO, "bench-out")) as work:
        results = [measure(rows, work, args.read_seconds) for rows in args.rows]
    print(f"rows of {DIM} float32, {BUDGET >> 20} MiB budget, direct I/O; page cache dropped before each: "
          f"{results[0]['page_cache_dropped']}")
    print("\n".join(markdown_table(
        ["rows", "disk MB", "reopen, index image s (loaded)", "reopen, log scan s", "scan s", "get in key order s",
         "get in random order s"],
        [[f"{r['rows']:,}", f"{r['disk_bytes'] / 1e6:.0f}",
          f"{r['reopen_with_index_image_s']:.2f} ({r['reopen_with_index_image_loaded_image']})",
          f"{r['reopen_log_scan_s']:.2f}", f"{r['scan_s']:.2f}", f"{r['get_in_key_order_table_s']:.1f}",
          f"{r['get_random_table_s']:.1f}"] for r in results], align="r r r r r r r")))
    print("(get times: the whole table at the rate measured over at most --read-seconds)")
    write_json_report(os.path.join(REPO, args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
