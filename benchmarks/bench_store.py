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
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import disk_limits  # benchmarks/ is on the path of a script run from it
from common import (MiB, ReportLog, children_cpu_seconds, fmt_rate, machine_facts, system_busy_seconds,
                    wait_for_quiet_machine, write_json_report)
from store_systems import DIM, VALUE_BYTES, ZIPF_S


# --------------------------------------------------------------------------------------------
# the driver: every (system, case) in its own process, then the report
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
        from store_worker import run_worker

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
    machine = machine_facts()
    log(f"# bench_store  {time.strftime('%Y-%m-%d %H:%M:%S')}  host={machine['host']} cpus={machine['cpus']} "
        f"kernel={machine['kernel']} python={machine['python']} torch={machine['torch']}")
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
        write_json_report(args.json, {"args": vars(args), "machine": machine, "fio": fio, "fio_text": fio_text,
                                      "budget_10x": budget_big, "results": results, "ratios": ratios,
                                      "sustained_ratios": sustained_ratios, "targets": targets, "stdout": lines})
    return 0 if not wrong and not errors else 1


if __name__ == "__main__":
    sys.exit(main())

