"""bench_store.py's worker: one system, one case, in its own process (`bench_store.py --worker
SPEC`): load, batched gets and puts with uniform and Zipf keys, the disk-bound sweep and sustained
overwrites, each phase's figures and the checks of the rows read back."""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, Dict, List

from common import (MiB, cpu_seconds, dir_bytes, drop_caches, meminfo_kib, proc_status_kib, latency_summary,
                    reset_peak_rss)
from store_systems import SYSTEMS, VALUE_BYTES, Workload, check_rows


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
        latency = latency_summary(batch_times, 1e3)
        out = {"rows": n, "batches": i, "seconds": timed, "rows_per_s": n / timed,
               # CPU time of the whole process (all its threads) inside the timed calls
               "cpu_seconds_timed": timed_cpu, "rows_per_cpu_s": n / max(timed_cpu, 1e-9),
               "first_batch_rows_per_s": keys.numel() / first, "cpu_seconds": cpu_seconds() - c0,
               "batch_ms_median": latency["median"], "batch_ms_max": latency["max"], "batch_ms_summary": latency,
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
        latency = latency_summary(times, 1e3)
        out = {"seconds": timed, "wall_seconds": wall, "capped_by_wall": capped, "rows": n, "batches": i,
               "rows_per_s": n / timed,
               "quarter_rows_per_s": [r / t if t > 0 else None for r, t in zip(q_rows, q_secs)],
               "batch_ms_median": latency["median"], "batch_ms_max": latency["max"], "batch_ms_summary": latency,
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

