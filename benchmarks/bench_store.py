#!/usr/bin/env python3
"""Benchmarks mlkv_torch.KVStore side by side with RocksDB (rocksdict) and LMDB.

One run, same keys (int64) and values (dim 64, float32) for every system, each
used batched from Python as well as it can be. Every system takes a [B] int64
tensor of keys and returns (or takes) a [B, 64] float32 tensor; the conversion
to and from bytes is part of each system's time.

Measured, in rows/s:
  (a) in memory: data smaller than the memory budget;
  (b) 10x: data 10x the memory budget;
  for each: load (sequential keys), batched get and batched put (overwrite)
  with uniform and Zipf(1.1) keys.
  Disk-bound: uniform random gets on a fresh mlkv store with direct I/O, as
  4 KiB blocks/s against fio's randread-4k-qd64 IOPS (benchmarks/disk_limits.py),
  for io_engine uring/threads and several io_depths.
  Memory: peak RSS of the mlkv 10x run (its own process) over the RSS right
  after the imports, against budget + index + 200 MiB.
  Sustained overwrites (--sustained-seconds S): after its other phases (and after
  its memory figures are taken), mlkv-10x, rocksdb-10x and rocksdb-10x-direct
  overwrite uniform keys for S timed seconds: rows/s overall and per quarter, the
  largest batch latency (a write stall), and the size of the files under the
  store's directory over the live data (rows x 256 B), at the end and the peak of
  per-second samples. The 2 s put phases can catch one store in a stall and not
  another; this shows throughput with disk use bounded.

Each (system, case) runs in its own subprocess, so RSS figures are not mixed
and every system starts with the same process state. The page cache is dropped
before every phase of the 10x case (root only; the output says if it failed);
RocksDB and LMDB still read through the page cache, which may grow far past
the budget during a phase: the growth is reported per phase ("pcache MiB").
mlkv is shown with direct_io on (its default, no page cache) and off, and
RocksDB with buffered reads (its default) and with direct reads.

Usage:
  python benchmarks/bench_store.py --run-fio --json bench-out/bench_store.json
  python benchmarks/bench_store.py --smoke          # small sizes, checks answers
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import disk_limits  # benchmarks/ is on the path of a script run from it

DIM = 64
VALUE_BYTES = DIM * 4
ZIPF_S = 1.1
BASE_ROWS = 4093  # the value table row i draws from; see values_for()
MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --------------------------------------------------------------------------------------------
# process and OS helpers
# --------------------------------------------------------------------------------------------

def _proc_field_kib(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def proc_status_kib(field: str) -> int:
    return _proc_field_kib("/proc/self/status", field)


def meminfo_kib(field: str) -> int:
    return _proc_field_kib("/proc/meminfo", field)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_caches() -> Optional[str]:
    """Writes back dirty pages and drops the page cache; returns an error text or None."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"drop_caches failed: {e}"


def system_busy_seconds() -> float:
    """CPU seconds all processes spent busy (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    v = [int(x) for x in parts]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def write_json_report(path: str, report: Dict[str, Any]) -> None:
    """Writes a benchmark's report as JSON to `path`, making its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


class ReportLog:
    """Prints report lines as they come and keeps them for the report file."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)


def wait_for_quiet_machine(seconds: float) -> None:
    """Waits up to `seconds` for other processes to leave the cores (below 0.3 busy over 5 s)."""
    deadline, busy = time.time() + seconds, 0.0
    while time.time() < deadline:
        b0 = system_busy_seconds()
        time.sleep(5)
        busy = (system_busy_seconds() - b0) / 5
        if busy < 0.3:
            break
    print(f"# waited for a quiet machine: {busy:.2f} cores busy at the start", flush=True)


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dir_bytes(path: str, apparent: bool = False) -> int:
    """Bytes of every file under path: allocated blocks, or with apparent=True the file sizes."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:  # a file may vanish meanwhile (compaction)
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if apparent else st.st_blocks * 512
    return total


# --------------------------------------------------------------------------------------------
# the worker: one system, one case, in its own process
# --------------------------------------------------------------------------------------------

class Workload:
    """Keys and values shared by every system (same seed, same batches)."""

    def __init__(self, rows: int, batch: int, pool_batches: int, seed: int):
        import numpy as np
        import torch

        self.rows, self.batch = rows, batch
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        self.base = torch.randn(BASE_ROWS, DIM, generator=gen, dtype=torch.float32)
        n = batch * pool_batches
        self.uniform = torch.from_numpy(rng.integers(0, rows, size=n, dtype=np.int64)).view(pool_batches, batch)
        # Zipf(s) over ranks 1..rows, bounded: inverse CDF by searchsorted; the ranks go
        # through a fixed random permutation so that the hot keys are scattered over the
        # key space (and over the load order).
        weights = np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_S
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        del weights
        ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), rows - 1)
        del cdf
        perm = rng.permutation(rows).astype(np.int64)
        self.zipf = torch.from_numpy(perm[ranks]).view(pool_batches, batch)
        self.hot_share = float(np.mean(ranks < max(1, rows // 100)))  # share of draws on the top 1% keys
        del perm, ranks
        self.sample = torch.from_numpy(rng.choice(rows, size=min(rows, 4096), replace=False).astype(np.int64))
        self.buf = torch.empty(batch, DIM, dtype=torch.float32)  # reused value buffer for puts
        self.buf.fill_(0)

    def values_for(self, keys, version: int, out=None):
        """Row for key k: base[k % BASE_ROWS] with column 0 = k and column 1 = version."""
        import torch

        if out is None:
            out = torch.empty(keys.numel(), DIM, dtype=torch.float32)
        out = out[: keys.numel()]
        torch.index_select(self.base, 0, torch.remainder(keys, BASE_ROWS), out=out)
        out[:, 0] = keys.to(torch.float32)
        out[:, 1] = float(version)
        return out


class MlkvSystem:
    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import inspect

        from mlkv_torch.store import KVStore

        self.kw = dict(dim=DIM, memory_budget_bytes=budget, expected_rows=max(rows, 1),
                       direct_io=spec.get("direct_io", True), io_engine=spec.get("io_engine", "auto"),
                       io_depth=spec.get("io_depth", 64))
        self.accepts = set(inspect.signature(KVStore.__init__).parameters)
        for opt in ("promote_hot_reads",):  # options only some versions of the store have
            if opt in spec and opt in self.accepts:
                self.kw[opt] = spec[opt]
        self.path = path
        self.store = KVStore(path, **self.kw)

    def put(self, keys, values) -> None:
        self.store.put(keys, values)

    def get(self, keys):
        return self.store.get(keys)

    def finish_load(self) -> None:
        pass

    def reopen(self, **overrides) -> None:
        from mlkv_torch.store import KVStore

        self.store.close()
        kw = dict(self.kw)
        kw.update(overrides)
        self.store = KVStore(self.path, **kw)

    def stats(self) -> Dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()


class RocksSystem:
    """rocksdict in raw mode: 8-byte big-endian keys, 256-byte values, WriteBatch puts, multi-get."""

    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import rocksdict as rd

        self.rd = rd
        opt = rd.Options(raw_mode=True)
        opt.create_if_missing(True)
        opt.set_compression_type(rd.DBCompressionType.none())  # random floats do not compress
        opt.increase_parallelism(os.cpu_count() or 2)
        opt.set_max_background_jobs(os.cpu_count() or 2)
        opt.set_write_buffer_size(64 * MiB)
        opt.set_max_write_buffer_number(2)
        opt.set_target_file_size_base(64 * MiB)
        opt.set_level_compaction_dynamic_level_bytes(True)
        opt.set_advise_random_on_open(True)
        if spec.get("direct_reads"):
            opt.set_use_direct_reads(True)
            opt.set_use_direct_io_for_flush_and_compaction(True)
        bbo = rd.BlockBasedOptions()
        bbo.set_block_cache(rd.Cache(budget))
        bbo.set_block_size(4096)
        bbo.set_bloom_filter(10, False)
        bbo.set_data_block_index_type(rd.DataBlockIndexType.binary_and_hash())
        bbo.set_data_block_hash_ratio(0.75)
        bbo.set_format_version(5)
        opt.set_block_based_table_factory(bbo)
        self.db = rd.Rdict(path, opt)
        wo = rd.WriteOptions()
        wo.disable_wal = True  # mlkv has no write-ahead log either (durable at checkpoint)
        wo.sync = False
        self.db.set_write_options(wo)
        self.path = path
        self.sort = spec.get("sort_keys", True)

    def put(self, keys, values) -> None:
        order, kl = _prep_keys(keys, self.sort)
        vl = _value_list(values, order)
        wb = self.rd.WriteBatch(raw_mode=True)
        put = wb.put
        for k, v in zip(kl, vl):
            put(k, v)
        self.db.write(wb)

    def get(self, keys):
        order, kl = _prep_keys(keys, self.sort)
        vals = self.db[kl]  # one MultiGet
        return _rows_from_bytes(b"".join(vals), order)  # join raises TypeError on a missing key (None)

    def finish_load(self) -> None:
        # What a careful user does after a bulk load: flush the memtable and compact once.
        self.db.flush()
        self.db.compact_range(None, None)

    def stats(self) -> Dict[str, Any]:
        out = {}
        for prop in ("rocksdb.block-cache-usage", "rocksdb.estimate-table-readers-mem",
                     "rocksdb.cur-size-all-mem-tables", "rocksdb.num-running-compactions"):
            try:
                out[prop] = self.db.property_int_value(prop)
            except Exception:  # noqa: BLE001
                pass
        return out

    def close(self) -> None:
        self.db.close()


class LmdbSystem:
    """LMDB: 8-byte big-endian keys, writemap, one write txn per batch (putmulti), one read txn per batch."""

    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import lmdb

        os.makedirs(path, exist_ok=True)
        map_size = max(1 << 30, rows * (VALUE_BYTES + 64) * 4)
        self._open = lambda: lmdb.open(path, map_size=map_size, writemap=True, sync=False, metasync=False,
                                       map_async=True, readahead=False, max_dbs=0, lock=True)
        self.env = self._open()
        self.get_mode = spec.get("lmdb_get", "get")
        self.sort = spec.get("sort_keys", True)

    def _put(self, keys, values, append: bool) -> None:
        order, kl = _prep_keys(keys, self.sort)
        vl = _value_list(values, order)
        with self.env.begin(write=True) as txn:
            consumed, added = txn.cursor().putmulti(zip(kl, vl), dupdata=False, overwrite=True, append=append)
        if consumed != len(kl):
            raise RuntimeError(f"lmdb putmulti consumed {consumed} of {len(kl)}")

    def put(self, keys, values) -> None:
        self._put(keys, values, append=False)

    def load(self, keys, values) -> None:
        # Keys arrive in increasing order during the load: MDB_APPEND is the fast path.
        self._put(keys, values, append=True)

    def get(self, keys):
        order, kl = _prep_keys(keys, self.sort)
        # buffers=False measured faster than memoryviews into the map (fewer Python objects' overhead)
        with self.env.begin(buffers=False) as txn:
            if self.get_mode == "getmulti":
                pairs = txn.cursor().getmulti(kl)
                if len(pairs) != len(kl):
                    raise KeyError(f"lmdb getmulti found {len(pairs)} of {len(kl)} keys")
                buf = b"".join([v for _, v in pairs])
            else:
                get = txn.get
                buf = b"".join([get(k) for k in kl])  # join raises TypeError on a missing key (None)
        return _rows_from_bytes(buf, order)

    def finish_load(self) -> None:
        self.env.sync(True)

    def suspend(self) -> None:
        # drop_caches cannot evict pages mapped into a process: unmap the file first.
        self.env.sync(True)
        self.env.close()

    def resume(self) -> None:
        self.env = self._open()

    def stats(self) -> Dict[str, Any]:
        s = self.env.stat()
        return {"depth": s["depth"], "leaf_pages": s["leaf_pages"], "overflow_pages": s["overflow_pages"]}

    def close(self) -> None:
        self.env.close()


def _prep_keys(keys, sort: bool):
    """int64 tensor -> (order or None, list of 8-byte big-endian keys in the order to issue them)."""
    import numpy as np

    kn = keys.numpy()
    order = np.argsort(kn, kind="stable") if sort else None  # stable: with duplicates the last put still wins
    if order is not None:
        kn = kn[order]
    return order, kn.astype(">i8").view("V8").tolist()


def _rows_from_bytes(buf: bytes, order):
    """Concatenated values (in issue order) -> [n, DIM] float32 tensor in the caller's order."""
    import numpy as np
    import torch

    arr = np.frombuffer(buf, dtype=np.float32).reshape(-1, DIM)
    if order is None:
        return torch.from_numpy(arr.copy())  # frombuffer is read-only; a tensor must own writable memory
    out = np.empty_like(arr)
    out[order] = arr
    return torch.from_numpy(out)


def _value_list(values, order):
    import numpy as np

    v = values.numpy()
    if order is not None:
        v = v[order]
    return v.view(np.dtype((np.void, VALUE_BYTES))).ravel().tolist()


SYSTEMS = {"mlkv": MlkvSystem, "rocksdb": RocksSystem, "lmdb": LmdbSystem}


def check_rows(got, keys, wl: Workload, versions: List[int], what: str) -> Dict[str, Any]:
    """Compares rows read back with what was written; versions: the allowed column-1 values."""
    import torch

    want = wl.values_for(keys, versions[0])
    if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.float32:
        return {"ok": False, "what": what, "error": f"shape/dtype {tuple(got.shape)} {got.dtype}"}
    ver_ok = torch.zeros(keys.numel(), dtype=torch.bool)
    for v in versions:
        ver_ok |= got[:, 1] == float(v)
    body_ok = torch.equal(got[:, 0], want[:, 0]) and torch.equal(got[:, 2:], want[:, 2:])
    ok = bool(body_ok and bool(ver_ok.all()))
    res = {"ok": ok, "what": what, "rows": int(keys.numel())}
    if not ok:
        bad = (~ver_ok) | (got[:, 0] != want[:, 0]) | (got[:, 2:] != want[:, 2:]).any(dim=1)
        idx = bad.nonzero().flatten()[:5]
        res["error"] = (f"{int(bad.sum())} of {keys.numel()} rows differ; e.g. keys {keys[idx].tolist()}: "
                        f"got col0/col1 {got[idx, :2].tolist()}, want col0 {want[idx, 0].tolist()} "
                        f"col1 in {versions}")
    return res


def run_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1) if hasattr(torch, "set_num_interop_threads") else None
    if spec["system"] == "mlkv":
        import mlkv_torch  # noqa: F401  (fails early while the extension is being rebuilt)
    elif spec["system"] == "rocksdb":
        import rocksdict  # noqa: F401
    else:
        import lmdb  # noqa: F401
    import numpy  # noqa: F401

    rows, batch, budget = spec["rows"], spec["batch"], spec["budget"]
    seconds, cold = spec["seconds"], spec["cold"]
    wl = Workload(rows, batch, spec["pool_batches"], spec["seed"])
    path = spec["path"]
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)

    rss_base_kib = proc_status_kib("VmRSS")
    peak_reset = reset_peak_rss()
    res: Dict[str, Any] = {"spec": spec, "rss_base_mib": rss_base_kib / 1024, "peak_reset": peak_reset,
                           "zipf_top1pct_share": wl.hot_share, "phases": {}, "checks": [], "notes": []}
    try:
        sysobj = SYSTEMS[spec["system"]](path, rows, budget, spec)
    except TypeError as e:  # the Python wrapper and the built extension disagree: mid-rebuild
        if "incompatible constructor arguments" in str(e):
            print(f"import failed (extension out of date?): {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(3)
        raise
    is_mlkv = spec["system"] == "mlkv"
    if is_mlkv:
        res["store_kwargs"] = dict(sysobj.kw)

    def stat_delta(before, after):
        if not is_mlkv:
            return {}
        return {k: after[k] - before[k] for k in after
                if k in before and isinstance(after[k], int) and not isinstance(after[k], bool)
                and not k.endswith("_address") and k not in ("page_bytes", "record_bytes")}

    # ---- load: sequential keys, batched
    t_put = 0.0
    c0, w0 = cpu_seconds(), time.perf_counter()
    loader = getattr(sysobj, "load", sysobj.put)
    for start in range(0, rows, batch):
        keys = torch.arange(start, min(rows, start + batch), dtype=torch.int64)
        vals = wl.values_for(keys, 0, wl.buf)
        t0 = time.perf_counter()
        loader(keys, vals)
        t_put += time.perf_counter() - t0
    t1 = time.perf_counter()
    sysobj.finish_load()
    t_finish = time.perf_counter() - t1
    res["phases"]["load"] = {"rows": rows, "seconds": t_put, "rows_per_s": rows / t_put,
                             "finish_seconds": t_finish, "cpu_seconds": cpu_seconds() - c0,
                             "wall_seconds": time.perf_counter() - w0}
    res["checks"].append(check_rows(sysobj.get(wl.sample), wl.sample, wl, [0], "after load"))
    res["after_load"] = {"rss_mib": proc_status_kib("VmRSS") / 1024, "disk_mib": dir_bytes(path) / MiB,
                         "stats": sysobj.stats()}

    def cold_start() -> None:
        """Before a phase of a cold case: drop the page cache."""
        if not cold:
            return
        if hasattr(sysobj, "suspend"):
            sysobj.suspend()
        note = drop_caches()
        if hasattr(sysobj, "resume"):
            sysobj.resume()
        if note and note not in res["notes"]:
            res["notes"].append(note)

    def measure(kind: str, pattern: str, version: int = 0) -> Dict[str, Any]:
        pool = wl.uniform if pattern == "uniform" else wl.zipf
        cold_start()
        cache0 = meminfo_kib("Cached")
        st0 = sysobj.stats() if is_mlkv else None
        if not cold:  # warm-up batch, untimed
            k = pool[-1]
            if kind == "get":
                sysobj.get(k)
            else:
                sysobj.put(k, wl.values_for(k, version, wl.buf))
        timed, timed_cpu, n, i, first = 0.0, 0.0, 0, 0, None
        batch_times: List[float] = []
        c0, w0 = cpu_seconds(), time.perf_counter()
        while True:
            keys = pool[i % pool.shape[0]]
            if kind == "get":
                u0, t0 = cpu_seconds(), time.perf_counter()
                out = sysobj.get(keys)
                dt, du = time.perf_counter() - t0, cpu_seconds() - u0
                del out
            else:
                vals = wl.values_for(keys, version, wl.buf)
                u0, t0 = cpu_seconds(), time.perf_counter()
                sysobj.put(keys, vals)
                dt, du = time.perf_counter() - t0, cpu_seconds() - u0
            if first is None:
                first = dt
            timed += dt
            timed_cpu += du
            batch_times.append(dt)
            n += keys.numel()
            i += 1
            wall = time.perf_counter() - w0
            if timed >= seconds or wall >= 3 * seconds + 5:
                break
        wall = time.perf_counter() - w0
        out = {"rows": n, "batches": i, "seconds": timed, "rows_per_s": n / timed,
               # CPU time of the whole process (all its threads) inside the timed calls
               "cpu_seconds_timed": timed_cpu, "rows_per_cpu_s": n / max(timed_cpu, 1e-9),
               "first_batch_rows_per_s": keys.numel() / first, "cpu_seconds": cpu_seconds() - c0,
               "batch_ms_median": 1e3 * sorted(batch_times)[len(batch_times) // 2],
               "batch_ms_max": 1e3 * max(batch_times),
               "wall_seconds": wall, "page_cache_growth_mib": (meminfo_kib("Cached") - cache0) / 1024}
        if is_mlkv:
            st1 = sysobj.stats()
            d = stat_delta(st0, st1)
            out["store"] = d
            out["disk_reads_per_s"] = d["disk_reads"] / timed
        return out

    def sustained(seconds: float, version: int = 3) -> Dict[str, Any]:
        """Uniform-key batched puts (overwrites) for `seconds` of timed put calls, as in measure(); the
        apparent size of the files under the store's directory is sampled once per second meanwhile."""
        import threading

        # Values made beforehand (pool_batches x batch x 256 B; after the memory figures): between the put
        # calls the stores' background work would otherwise get time that the rate does not count.
        pool_vals = [wl.values_for(k, version) for k in wl.uniform]
        cold_start()
        live = rows * VALUE_BYTES  # every key was loaded: live data = rows x 256 B of values
        samples: List[List[float]] = []  # [seconds into the window, bytes]
        stop = threading.Event()
        cache0, st0 = meminfo_kib("Cached"), (sysobj.stats() if is_mlkv else None)
        c0, w0 = cpu_seconds(), time.perf_counter()

        def sampler() -> None:
            while True:
                samples.append([time.perf_counter() - w0, dir_bytes(path, apparent=True)])
                if stop.wait(1.0):
                    return

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        starts: List[float] = []  # timed seconds before each batch
        times: List[float] = []
        timed, n, i, capped = 0.0, 0, 0, False
        while timed < seconds:
            if time.perf_counter() - w0 >= 1.25 * seconds + 2:  # bounds the bench's time
                capped = True
                break
            j = i % wl.uniform.shape[0]
            keys = wl.uniform[j]
            t0 = time.perf_counter()
            sysobj.put(keys, pool_vals[j])
            dt = time.perf_counter() - t0
            starts.append(timed)
            times.append(dt)
            timed += dt
            n += keys.numel()
            i += 1
        wall = time.perf_counter() - w0
        stop.set()
        th.join()
        disk_end = dir_bytes(path, apparent=True)
        # quarters of the timed window; a batch counts in the quarter where it started
        q_rows, q_secs = [0] * 4, [0.0] * 4
        for s0, dt in zip(starts, times):
            q = min(3, int(4 * s0 / timed))
            q_rows[q] += batch
            q_secs[q] += dt
        peak = max([b for _, b in samples] + [disk_end])
        out = {"seconds": timed, "wall_seconds": wall, "capped_by_wall": capped, "rows": n, "batches": i,
               "rows_per_s": n / timed,
               "quarter_rows_per_s": [r / t if t > 0 else None for r, t in zip(q_rows, q_secs)],
               "batch_ms_median": 1e3 * sorted(times)[len(times) // 2], "batch_ms_max": 1e3 * max(times),
               "cpu_seconds": cpu_seconds() - c0, "page_cache_growth_mib": (meminfo_kib("Cached") - cache0) / 1024,
               "live_bytes": live, "disk_bytes_end": disk_end, "disk_over_live_end": disk_end / live,
               "disk_over_live_peak": peak / live, "disk_samples": samples,
               "disk_allocated_bytes_end": dir_bytes(path)}
        if is_mlkv:
            st1 = sysobj.stats()
            out["store"] = stat_delta(st0, st1)  # write_stalls, compactions, ... during the window
            out["store_disk_bytes_end"] = st1["disk_bytes"]
        if capped:
            res["notes"].append(f"sustained overwrites stopped after {wall:.1f} s of wall time with "
                                f"{timed:.1f} of {seconds:g} s timed")
        return out

    def disk_sweep() -> List[Dict[str, Any]]:
        out = []
        for engine, depth in spec["sweep"]:
            sysobj.reopen(io_engine=engine, io_depth=depth)
            st = sysobj.stats()
            m = measure("get", "uniform")
            m.update({"io_engine_requested": engine, "io_engine": st["io_engine"], "io_depth": depth,
                      "direct_io": st["direct_io"],
                      "memory_share": m["store"]["memory_hits"] / max(1, m["rows"])})
            out.append(m)
        return out

    if spec.get("sweep"):
        sysobj.reopen()  # a fresh process state: recovered from the checkpoint
        res["disk_sweep"] = disk_sweep()
    for kind in spec["phases_kinds"]:
        for pattern in ("uniform", "zipf"):
            version = 1 if pattern == "uniform" else 2
            res["phases"][f"{kind}_{pattern}"] = measure(kind, pattern, version)
    if "put" in spec["phases_kinds"]:
        res["checks"].append(check_rows(sysobj.get(wl.sample), wl.sample, wl, [0, 1, 2], "after overwrites"))
        k = wl.sample[:1024]
        sysobj.put(k, wl.values_for(k, 7))
        res["checks"].append(check_rows(sysobj.get(k), k, wl, [7], "read-your-write"))
        res["checks"].append(check_rows(sysobj.get(wl.uniform[0]), wl.uniform[0], wl, [0, 1, 2, 7],
                                        "full uniform batch"))
    res["end"] = {"rss_mib": proc_status_kib("VmRSS") / 1024, "peak_rss_mib": proc_status_kib("VmHWM") / 1024,
                  "disk_mib": dir_bytes(path) / MiB, "stats": sysobj.stats()}
    res["peak_over_base_mib"] = res["end"]["peak_rss_mib"] - res["rss_base_mib"]
    if spec.get("sustained"):  # after "end": the figures above do not include it
        res["sustained"] = sustained(spec["sustained"])
        res["checks"].append(check_rows(sysobj.get(wl.sample), wl.sample, wl, [0, 1, 2, 3, 7],
                                        "after sustained overwrites"))
    sysobj.close()
    if not spec.get("keep"):
        shutil.rmtree(path, ignore_errors=True)
    return res


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------

def run_in_subprocess(spec: Dict[str, Any], log) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    for attempt in range(3):
        t0, busy0, own0 = time.perf_counter(), system_busy_seconds(), children_cpu_seconds()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode == 0:
            for line in reversed(p.stdout.splitlines()):
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    r["process_seconds"] = wall
                    # cores other processes kept busy meanwhile: the benchmark shares the machine
                    r["other_cores_busy"] = max(0.0, (system_busy_seconds() - busy0)
                                                - (children_cpu_seconds() - own0)) / wall
                    return r
        err = (p.stderr or "")[-3000:]
        if p.returncode == 3 and attempt < 2:  # import failed: the extension may be mid-rebuild
            log(f"  [{spec['name']}] import failed, retrying in 60 s: {err.strip().splitlines()[-1:]}")
            time.sleep(60)
            continue
        return {"spec": spec, "error": f"worker exited {p.returncode}: {err}"}
    return {"spec": spec, "error": "worker import failed 3 times"}


def parse_fio(text: str) -> Dict[str, Dict[str, float]]:
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("\t")
        if len(parts) >= 2 and parts[1].startswith("IOPS="):
            d = {}
            for p in parts[1:]:
                k, _, v = p.partition("=")
                d[k] = float(v)
            out[parts[0]] = d
    return out


def fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows of the 10x case (budget = data/10)")
    ap.add_argument("--rows-mem", type=int, default=200_000, help="rows of the in-memory case")
    ap.add_argument("--budget-mem", type=int, default=256 * MiB, help="memory budget of the in-memory case, bytes")
    ap.add_argument("--ratio", type=float, default=10.0, help="data bytes / budget in the larger-than-memory case")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per measurement")
    ap.add_argument("--pool-batches", type=int, default=16, help="distinct key batches per pattern")
    ap.add_argument("--dir", default="/tmp/mlkv-bench")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--fio", help="a saved output of benchmarks/disk_limits.py")
    ap.add_argument("--run-fio", action="store_true", help="run benchmarks/disk_limits.py on --dir first")
    ap.add_argument("--fio-seconds", type=int, default=5)
    ap.add_argument("--systems", default="mlkv,rocksdb,lmdb")
    ap.add_argument("--depths", default="1,64,128", help="io_depths of the disk-bound sweep (uring)")
    ap.add_argument("--lmdb-get", choices=("getmulti", "get"), default="get",
                    help="LMDB batched read: per-key txn.get or cursor.getmulti, in one read txn")
    ap.add_argument("--no-sort", action="store_true",
                    help="do not sort each batch's keys for RocksDB/LMDB (sorted is faster for both)")
    ap.add_argument("--no-disk", action="store_true", help="skip the disk-bound sweep")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to this long for other processes to leave the CPUs idle (< 0.3 cores busy)")
    ap.add_argument("--sustained-seconds", type=float, default=None, metavar="S",
                    help="after its other phases, overwrite uniform keys for S timed seconds in mlkv-10x, "
                         "rocksdb-10x and rocksdb-10x-direct (default 20, 2 with --smoke; 0: off)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks answers, prints the table")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        spec = json.loads(args.worker)
        try:
            import torch  # noqa: F401
            if spec["system"] == "mlkv":
                import mlkv_torch  # noqa: F401
        except ImportError as e:
            print(f"import failed: {e}", file=sys.stderr)
            return 3
        res = run_worker(spec)
        print("RESULT " + json.dumps(res))
        return 0

    if args.smoke:
        args.rows, args.rows_mem, args.budget_mem = 60_000, 20_000, 16 * MiB
        args.batch, args.seconds, args.pool_batches = 4096, 0.3, 4
    if args.sustained_seconds is None:
        args.sustained_seconds = 2.0 if args.smoke else 20.0
    systems = [s for s in args.systems.split(",") if s]
    log = ReportLog()
    lines = log.lines

    if args.wait_quiet > 0:
        wait_for_quiet_machine(args.wait_quiet)

    t_start = time.perf_counter()
    os.makedirs(args.dir, exist_ok=True)
    import torch  # for the versions only

    log(f"# bench_store  {time.strftime('%Y-%m-%d %H:%M:%S')}  host={platform.node()} cpus={os.cpu_count()} "
        f"kernel={platform.release()} python={platform.python_version()} torch={torch.__version__}")
    log(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")

    # ---- fio
    fio_text, fio_src = None, None
    if args.fio:
        with open(args.fio) as f:
            fio_text, fio_src = f.read(), args.fio
    elif args.run_fio:
        fio_dir = os.path.join(args.dir, "fio")
        log(f"# running benchmarks/disk_limits.py {fio_dir} --seconds {args.fio_seconds} ...")
        fio_src = f"benchmarks/disk_limits.py {fio_dir} --seconds {args.fio_seconds}"
        try:
            fio_text = disk_limits.measure(fio_dir, args.fio_seconds)
        except RuntimeError as e:
            fio_text = ""
            log(f"# disk_limits.py failed: {e}")
    fio = parse_fio(fio_text or "")
    if fio_text:
        log("# fio-limits (" + fio_src + "):")
        for line in fio_text.strip().splitlines():
            log("#   " + line)
    fio_iops = fio.get("randread-4k-qd64", {}).get("IOPS")

    # ---- the runs
    rec_bytes = VALUE_BYTES  # data bytes = rows x dim x 4
    budget_big = int(args.rows * rec_bytes / args.ratio)
    common = dict(batch=args.batch, seconds=args.seconds, pool_batches=args.pool_batches, seed=args.seed,
                  lmdb_get=args.lmdb_get, sort_keys=not args.no_sort)
    depths = [int(d) for d in args.depths.split(",") if d]
    runs: List[Dict[str, Any]] = []

    def add(name, system, case, rows, budget, cold, **extra):
        runs.append(dict(common, name=name, system=system, case=case, rows=rows, budget=budget, cold=cold,
                         path=os.path.join(args.dir, name), phases_kinds=["get", "put"], **extra))

    if "mlkv" in systems:
        add("mlkv-mem", "mlkv", "mem", args.rows_mem, args.budget_mem, False)
    if "rocksdb" in systems:
        add("rocksdb-mem", "rocksdb", "mem", args.rows_mem, args.budget_mem, False)
    if "lmdb" in systems:
        add("lmdb-mem", "lmdb", "mem", args.rows_mem, args.budget_mem, False)
    sus = args.sustained_seconds
    if "mlkv" in systems:
        add("mlkv-10x", "mlkv", "10x", args.rows, budget_big, True, direct_io=True, sustained=sus)
        add("mlkv-10x-buffered", "mlkv", "10x", args.rows, budget_big, True, direct_io=False)
    if "rocksdb" in systems:
        add("rocksdb-10x", "rocksdb", "10x", args.rows, budget_big, True, sustained=sus)
        add("rocksdb-10x-direct", "rocksdb", "10x", args.rows, budget_big, True, direct_reads=True, sustained=sus)
    if "lmdb" in systems:
        add("lmdb-10x", "lmdb", "10x", args.rows, budget_big, True)
    if "mlkv" in systems and not args.no_disk:
        sweep = [["uring", d] for d in depths] + [["threads", d] for d in depths if d != 1] + [["auto", 64]]
        runs.append(dict(common, name="mlkv-disk", system="mlkv", case="disk", rows=args.rows, budget=budget_big,
                         cold=True, path=os.path.join(args.dir, "mlkv-disk"), phases_kinds=[], direct_io=True,
                         promote_hot_reads=False, sweep=sweep))

    log(f"# data: dim={DIM} float32 ({VALUE_BYTES} B/row); in-memory case {args.rows_mem} rows "
        f"({args.rows_mem * rec_bytes / MiB:.0f} MiB) with budget {args.budget_mem / MiB:.0f} MiB; "
        f"10x case {args.rows} rows ({args.rows * rec_bytes / MiB:.0f} MiB) with budget {budget_big / MiB:.1f} MiB")
    log(f"# batch={args.batch} rows, {args.seconds:g} s timed per measurement, Zipf s={ZIPF_S}; "
        f"torch threads=1; every system returns/takes a [batch, {DIM}] float32 tensor (conversion timed)")
    results: Dict[str, Dict[str, Any]] = {}
    for spec in runs:
        log(f"# run {spec['name']} ... (loadavg {open('/proc/loadavg').read().split()[0]})")
        r = run_in_subprocess(spec, log)
        results[spec["name"]] = r
        if "error" in r:
            log(f"#   ERROR: {r['error']}")
            continue
        bad = [c for c in r["checks"] if not c["ok"]]
        log(f"#   {r['process_seconds']:.1f} s; other processes kept {r['other_cores_busy']:.2f} of "
            f"{os.cpu_count()} cores busy; checks: " +
            ", ".join(f"{c['what']}={'ok' if c['ok'] else 'FAIL'}" for c in r["checks"]))
        for c in bad:
            log(f"#   WRONG ANSWER ({c['what']}): {c['error']}")
        for n in r.get("notes", []):
            log(f"#   note: {n}")

    # ---- tables
    def rate(name, phase):
        r = results.get(name)
        if not r or "error" in r or phase not in r["phases"]:
            return None
        return r["phases"][phase]["rows_per_s"]

    phases = ["load", "get_uniform", "get_zipf", "put_uniform", "put_zipf"]
    log("")
    log("## rows/s (batched; higher is better).  first-batch rows/s in [] for cold 10x gets")
    hdr = f"{'case':5} {'system':22}" + "".join(f"{p:>20}" for p in phases) + f"{'peak RSS-base MiB':>19}"
    log(hdr)
    log("-" * len(hdr))
    for spec in runs:
        if spec["case"] == "disk":
            continue
        r = results[spec["name"]]
        row = f"{spec['case']:5} {spec['name']:22}"
        for p in phases:
            x = rate(spec["name"], p)
            cell = fmt_rate(x)
            if x is not None and spec["cold"] and p.startswith("get"):
                cell += f" [{fmt_rate(r['phases'][p]['first_batch_rows_per_s'])}]"
            row += f"{cell:>20}"
        peak = r.get("peak_over_base_mib")
        row += f"{(f'{peak:.0f}' if peak is not None else '-'):>19}"
        log(row)

    def table(title, cols, rows, width=14):
        """rows: (system name, one text per column of `cols`)."""
        log("")
        log(title)
        log(f"{'system':22}" + "".join(f"{c:>{width}}" for c in cols))
        for name, cells in rows:
            log(f"{name:22}" + "".join(f"{c:>{width}}" for c in cells))

    def phase_table(title, cases, cols, cell, width=14):
        """One row per system of `cases`, one column per phase in `cols`."""
        rows = []
        for spec in runs:
            if spec["case"] not in cases or "error" in results[spec["name"]]:
                continue
            ph = results[spec["name"]]["phases"]
            rows.append((spec["name"], [cell(ph[p]) if p in ph else "-" for p in cols]))
        table(title, cols, rows, width)

    phase_table(f"## page cache growth during each 10x phase, MiB (after drop_caches; the budget is "
                f"{budget_big / MiB:.1f} MiB)", ("10x",), phases[1:], lambda q: f"{q['page_cache_growth_mib']:.0f}")
    phase_table("## CPU use during each phase, cores (process CPU time / wall time; >1 = background threads)",
                ("mem", "10x"), phases, lambda q: f"{q['cpu_seconds'] / max(q['wall_seconds'], 1e-9):.2f}")
    phase_table("## batch latency, ms: median / max over the timed batches (a max far above the median is a stall, "
                "e.g. a write waiting for compaction)", ("mem", "10x"), phases[1:],
                lambda q: f"{q['batch_ms_median']:.1f}/{q['batch_ms_max']:<7.0f}", width=16)
    phase_table("## in-memory case, rows per CPU-second of the whole process inside the timed calls "
                "(less sensitive to other load on the machine; background threads count)", ("mem",), phases[1:],
                lambda q: fmt_rate(q["rows_per_cpu_s"]))

    # ratios
    pairs = [("mem", "mlkv-mem", "rocksdb-mem", "lmdb-mem"),
             ("10x", "mlkv-10x", "rocksdb-10x", "lmdb-10x"),
             ("10x", "mlkv-10x", "rocksdb-10x-direct", None),
             ("10x", "mlkv-10x-buffered", "rocksdb-10x", "lmdb-10x")]
    ratios: Dict[str, Dict[str, Optional[float]]] = {}
    log("")
    log("## ratios, same run (mlkv / other)")
    log(f"{'mlkv vs':42}" + "".join(f"{p:>13}" for p in phases))
    for case, m, rk, lm in pairs:
        for other in (rk, lm):
            if other is None or m not in results or other not in results:
                continue
            key = f"{m}/{other}"
            ratios[key] = {}
            row = f"{key:42}"
            for p in phases:
                a, b = rate(m, p), rate(other, p)
                v = a / b if a and b else None
                ratios[key][p] = v
                row += f"{(f'{v:.2f}x' if v is not None else '-'):>13}"
            log(row)

    # sustained overwrites
    sustained_ratios: Dict[str, Optional[float]] = {}
    sus_runs = [s["name"] for s in runs if "sustained" in results[s["name"]]]
    if sus_runs:
        rows = []
        for name in sus_runs:
            q = results[name]["sustained"]
            st = q.get("store", {})
            rows.append((name, [fmt_rate(q["rows_per_s"])] + [fmt_rate(x) for x in q["quarter_rows_per_s"]] +
                        [f"{q['batch_ms_max']:.0f}", f"{q['disk_over_live_end']:.2f}",
                         f"{q['disk_over_live_peak']:.2f}", str(st.get("write_stalls", "-")),
                         str(st.get("compactions", "-"))]))
        table(f"## sustained uniform overwrites, 10x case ({args.sustained_seconds:g} s): rows/s over the timed "
              f"window and in each quarter of it (a batch counts where it starts), max batch latency; disk/live = "
              f"sum of file sizes under the system's directory / (rows x {VALUE_BYTES} B of values = "
              f"{args.rows * VALUE_BYTES / MiB:.0f} MiB), after the window and peak (samples once per second during "
              f"it, and after it); mlkv write stalls and compactions during the window",
              ["rows/s", "Q1", "Q2", "Q3", "Q4", "max ms", "disk/live", "peak d/l", "stalls", "compactions"],
              rows, width=12)
        for other in ("rocksdb-10x", "rocksdb-10x-direct"):
            if "mlkv-10x" in sus_runs and other in sus_runs:
                v = results["mlkv-10x"]["sustained"]["rows_per_s"] / results[other]["sustained"]["rows_per_s"]
                sustained_ratios[f"mlkv-10x/{other}"] = v
                log(f"   mlkv-10x/{other} overall rows/s: {v:.2f}x")

    # disk-bound sweep
    disk = results.get("mlkv-disk")
    if disk and "error" not in disk:
        log("")
        log(f"## disk-bound uniform get, mlkv direct_io, fresh store (reopened), {args.rows} rows, budget "
            f"{budget_big / MiB:.1f} MiB, batch {args.batch}, lookahead off")
        log("   fio randread-4k-qd64 IOPS = "
            f"{fio_iops if fio_iops else 'n/a (no fio figures: pass --fio or --run-fio)'}"
            + (f", qd1 IOPS = {fio['randread-4k-qd1']['IOPS']:.0f}" if 'randread-4k-qd1' in fio else ""))
        log(f"{'engine':>8} {'depth':>6} {'rows/s':>10} {'4KiB reads/s':>13} {'of fio qd64':>12} "
            f"{'in memory':>10} {'cpu cores':>10}")
        for m in disk["disk_sweep"]:
            frac = m["disk_reads_per_s"] / fio_iops if fio_iops else None
            m["fraction_of_fio_qd64"] = frac
            if frac is not None and frac > 1.05 and "fio_note" not in disk:
                disk["fio_note"] = True
            log(f"{m['io_engine']:>8} {m['io_depth']:>6} {fmt_rate(m['rows_per_s']):>10} "
                f"{m['disk_reads_per_s']:>13.0f} {(f'{frac:.0%}' if frac is not None else '-'):>12} "
                f"{m['memory_share']:>10.1%} {m['cpu_seconds'] / max(m['wall_seconds'], 1e-9):>10.2f}")

    if disk and disk.get("fio_note"):
        log("   note: the store beat fio's qd64 IOPS: fio ran at another moment (other load, host-side caching of "
            "the virtual disk); compare the figures loosely")

    # ---- targets
    log("")
    log("## targets")
    targets: Dict[str, Any] = {}

    def verdict(name: str, ok: Optional[bool], text: str) -> None:
        targets[name] = {"met": ok, "detail": text}
        log(f"[{'MET ' if ok else ('MISS' if ok is not None else 'N/A ')}] {name}: {text}")

    g = [rate("mlkv-mem", "get_uniform"), rate("mlkv-mem", "get_zipf")]
    if all(g):
        ph = results["mlkv-mem"]["phases"]
        verdict("in-memory batched get >= 5M rows/s on one core", min(g) >= 5e6,
                f"uniform {fmt_rate(g[0])}, zipf {fmt_rate(g[1])} rows/s wall (torch threads=1); per CPU-second "
                f"uniform {fmt_rate(ph['get_uniform']['rows_per_cpu_s'])}, zipf "
                f"{fmt_rate(ph['get_zipf']['rows_per_cpu_s'])}")
    else:
        verdict("in-memory batched get >= 5M rows/s on one core", None, "not measured")
    for key in ("mlkv-mem/rocksdb-mem", "mlkv-10x/rocksdb-10x", "mlkv-10x/rocksdb-10x-direct",
                "mlkv-10x-buffered/rocksdb-10x"):
        if key in ratios:
            vals = {p: v for p, v in ratios[key].items() if p != "load"}
            ok = all(v is not None and v >= 3 for v in vals.values()) if vals else None
            verdict(f">= 3x RocksDB on every pattern ({key})", ok,
                    ", ".join(f"{p} {v:.2f}x" if v is not None else f"{p} -" for p, v in vals.items()))
    if disk and "error" not in disk:
        default = [m for m in disk["disk_sweep"] if m["io_engine_requested"] == "auto"]
        best = max(disk["disk_sweep"], key=lambda m: m["disk_reads_per_s"])
        if fio_iops and default:
            d = default[0]
            verdict("disk-bound get >= 60% of fio randread-4k-qd64 IOPS", d["fraction_of_fio_qd64"] >= 0.6,
                    f"default config ({d['io_engine']}, depth {d['io_depth']}): {d['disk_reads_per_s']:.0f} "
                    f"4KiB reads/s = {d['fraction_of_fio_qd64']:.0%} of {fio_iops:.0f}; best "
                    f"({best['io_engine']}, depth {best['io_depth']}): {best['fraction_of_fio_qd64']:.0%}")
        else:
            verdict("disk-bound get >= 60% of fio randread-4k-qd64 IOPS", None, "no fio figures")
    m10 = results.get("mlkv-10x")
    if m10 and "error" not in m10:
        idx = m10["end"]["stats"]["index_bytes"]
        allowed = (budget_big + idx) / MiB + 200
        peak = m10["peak_over_base_mib"]
        verdict("resident memory within budget + index + 200 MiB", peak <= allowed,
                f"peak RSS over the post-import baseline {peak:.0f} MiB (VmHWM {m10['end']['peak_rss_mib']:.0f}"
                f" - base {m10['rss_base_mib']:.0f}; the bench's key pools are in the base) vs "
                f"budget {budget_big / MiB:.1f} + index {idx / MiB:.1f} + 200 = {allowed:.0f} MiB")
    wrong = [(n, c) for n, r in results.items() if "checks" in r for c in r["checks"] if not c["ok"]]
    errors = [n for n, r in results.items() if "error" in r]
    verdict("every system returns the rows written", not wrong and not errors,
            "all sample checks passed" if not wrong and not errors else
            "; ".join([f"{n}: {c['what']}: {c['error']}" for n, c in wrong] + [f"{n}: crashed" for n in errors]))
    busy = [r.get("other_cores_busy", 0.0) for r in results.values()]
    if busy and max(busy) > 0.25:
        log(f"# WARNING: other processes kept up to {max(busy):.2f} of {os.cpu_count()} cores busy during the runs "
            f"(mean {sum(busy) / len(busy):.2f}); wall-clock rates understate what a quiet machine gives")
    log(f"# total {time.perf_counter() - t_start:.0f} s")

    if args.json:
        write_json_report(args.json, {"args": vars(args), "fio": fio, "fio_text": fio_text, "budget_10x": budget_big,
                                      "results": results, "ratios": ratios, "sustained_ratios": sustained_ratios,
                                      "targets": targets, "stdout": lines})
    return 0 if not wrong and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
