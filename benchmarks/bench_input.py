#!/usr/bin/env python3
"""Benchmarks the input side: Criteo conversion, the loader alone, and how long training waits.

1. Conversion: a generated Criteo-format file of --rows rows (`python -m mlkv_torch.data.criteo
   generate`) converted by `python -m mlkv_torch.data.criteo convert` (rows/s, peak RSS of the
   process), beside torchrec's converter (`BinaryCriteoUtils.tsv_to_npys`) on its first
   --reference-rows rows.
2. The loader alone: samples/s of each shipped config's BatchLoader with its own tuning
   (workers and prefetch "auto"), nothing consuming the batches; beside the trainer's samples/s;
   and the time to a first batch at batch 0 and at batch 10**9 (where a resumed run starts).
3. Stalls (DS-Analyzer's differential): every shipped config trained with every batch made
   before training (in memory: the trainer's own rate, the loader's target); the quickstart and
   a Criteo run (criteo_kaggle.yaml on the generated file split into 7 days) also with the
   tuning off (one thread, one batch buffered) and on ("auto"). input_wait_share is the share of
   the training steps' time spent waiting for a batch; samples/s count the training steps alone
   (not the evaluation). The Criteo configs read the generated file.
4. Parquet (parquet_example.yaml, `data.kind: parquet`): --rows rows of 40 columns, 20 of them
   declared (`python -m mlkv_torch.data.parquet_generate`), trained and read by the loader alone
   like the others; the bytes the loader read from the files (/proc/self/io) against the declared
   columns' and every column's (projection), and its samples/s beside criteo_terabyte's (the npy path).

Each training run is a fresh process (this script with --child); ratios are against the same run's
reference.

    python benchmarks/bench_input.py [--rows 10000000] [--steps 200] [--configs quickstart,...] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from common import REPO, write_json_report

SHIPPED = ("quickstart", "synthetic_large", "billion_rows", "criteo_kaggle", "criteo_terabyte", "parquet_example")
STALL_RUNS = ("quickstart", "criteo_kaggle", "parquet_example")  # trained with the tuning off and on, besides in memory
SMOKE_STALL_RUNS = ("criteo_kaggle",)  # the smoke run's: the same code path, once
RESUMED_AT = 10 ** 9  # the batch number where a run resumed late starts
# TSV (tuned), npy (in memory), Parquet (in memory, and the loader alone)
SMOKE_CONFIGS = ("criteo_kaggle", "criteo_terabyte", "parquet_example")
_SMALL_MODEL = ["model.embedding_dim=16", "model.dense_arch=[64,16]", "model.over_arch=[64,1]"]
SMOKE = {"quickstart": ["data.synthetic.scale=1000", "train.batch_size=256"],
         "synthetic_large": ["data.synthetic.scale=1000", "train.batch_size=256"],
         "billion_rows": ["data.synthetic.scale=1000", "train.batch_size=256"],
         "criteo_kaggle": ["train.batch_size=256", "data.criteo.scale=1000", *_SMALL_MODEL],
         "criteo_terabyte": ["train.batch_size=256", "data.criteo.scale=1000", *_SMALL_MODEL],
         "parquet_example": ["train.batch_size=256"]}


def _timed_child(cmd: List[str], env: Optional[Dict[str, str]] = None) -> Tuple[float, int, str]:
    """Runs `cmd`; returns (seconds, its peak RSS in bytes as it reported it (see `_module`), its
    stdout); raises on failure."""
    began = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    out, err = process.communicate()
    seconds = time.perf_counter() - began
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({process.returncode}):\n{err[-3000:]}")
    peak = 0
    for line in err.splitlines():
        if line.startswith("peak_rss_bytes="):
            peak = int(line.split("=", 1)[1])
    return seconds, peak, out


_PEAK_WRAPPER = ("import runpy, sys, atexit\n"
                 "def peak():\n"
                 "    for line in open('/proc/self/status'):\n"
                 "        if line.startswith('VmHWM:'): print(f'peak_rss_bytes={int(line.split()[1]) << 10}',"
                 " file=sys.stderr)\n"
                 "atexit.register(peak)\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_module(sys.argv[0], run_name='__main__')\n")


def _module(module: str, *args: str) -> List[str]:
    """A command running `python -m module args`, reporting its peak RSS on stderr at exit."""
    return [sys.executable, "-c", _PEAK_WRAPPER, module, *args]


def bench_conversion(work: str, rows: int, reference_rows: int, on_ray: bool = True) -> Dict[str, Any]:
    tsv = os.path.join(work, "train.txt")
    seconds, _, _ = _timed_child(_module("mlkv_torch.data.criteo", "generate", tsv, "--rows", str(rows)))
    result: Dict[str, Any] = {"rows": rows, "generate_rows_per_s": rows / seconds, "bytes": os.path.getsize(tsv)}
    seconds, peak, _ = _timed_child(_module("mlkv_torch.data.criteo", "convert", tsv, "--out",
                                            os.path.join(work, "cache")))
    result.update(convert_rows_per_s=rows / seconds, convert_s=seconds, convert_peak_rss_bytes=peak)
    seconds, _, _ = _timed_child(_module("mlkv_torch.data.criteo", "convert", tsv, "--out",
                                         os.path.join(work, "cache")))
    result["converted_again_s"] = seconds  # found in the cache: no conversion
    # To Parquet, in this process and as Ray tasks (a local Ray of this machine's cores), the file in two parts.
    parts = _split_lines(tsv, 2)
    for engine, extra in (("here", []), ("ray", ["--ray"]))[:2 if on_ray else 1]:
        seconds, _, _ = _timed_child(_module("mlkv_torch.data.criteo", "convert", *parts, "--out",
                                             os.path.join(work, f"parquet-{engine}"), "--format", "parquet", *extra))
        result[f"parquet_{engine}_rows_per_s"] = rows / seconds
        shutil.rmtree(os.path.join(work, f"parquet-{engine}"))
    for part in parts:
        os.remove(part)
    head = os.path.join(work, "head.tsv")
    with open(tsv, "rb") as src, open(head, "wb") as dst:
        for _, line in zip(range(reference_rows), src):
            dst.write(line)
    reference = ("import sys\nfrom torchrec.datasets.criteo import BinaryCriteoUtils\n"
                 "BinaryCriteoUtils.tsv_to_npys(sys.argv[1], *(sys.argv[2] + s for s in ('_d.npy', '_s.npy', "
                 "'_l.npy')))\n")
    script = os.path.join(work, "reference.py")
    with open(script, "w") as f:
        f.write(reference)
    seconds, peak, _ = _timed_child([sys.executable, "-c", _PEAK_WRAPPER.replace(
        "runpy.run_module(sys.argv[0], run_name='__main__')", "runpy.run_path(sys.argv[0], run_name='__main__')"),
        script, head, os.path.join(work, "reference")])
    result.update(reference_rows=reference_rows, torchrec_rows_per_s=reference_rows / seconds,
                  torchrec_peak_rss_bytes=peak)
    os.remove(head)
    return result


def _split_lines(path: str, parts: int) -> List[str]:
    """`path` cut into `parts` files of whole lines (as ``split -n l/N`` does)."""
    size, out = os.path.getsize(path), []
    with open(path, "rb") as src:
        for k in range(parts):
            out.append(f"{path}.part{k}")
            with open(out[-1], "wb") as dst:
                end = size * (k + 1) // parts
                while src.tell() < end or k == parts - 1:
                    chunk = src.readline()
                    if not chunk:
                        break
                    dst.write(chunk)
    return out


def _criteo_overrides(tsv: str, cache: str) -> List[str]:
    return [f"data.criteo.train=[{tsv}]", "data.criteo.days=7", f"data.criteo.cache_dir={cache}"]


def _config_overrides(name: str, tsv: str, cache: str, rows: int = 0) -> List[str]:
    if name == "parquet_example":  # a dataset of its layout, beside the TSV file
        sys.path.insert(0, REPO)
        from mlkv_torch.data.parquet_generate import generate

        root = os.path.join(os.path.dirname(tsv), "parquet")
        if not os.path.isdir(root):
            began = time.perf_counter()
            generate(os.path.join(root, "train"), rows, files=max(1, rows // 1_000_000))
            generate(os.path.join(root, "eval"), max(20_000, rows // 50), held_out=True)
            print(f"generated {rows:,} Parquet rows in {time.perf_counter() - began:.1f} s", flush=True)
        return [f"data.parquet.train=[{root}/train]", f"data.parquet.eval=[{root}/eval]"]
    if name == "criteo_kaggle":
        return _criteo_overrides(tsv, cache)
    if name == "criteo_terabyte":  # its format is npy: the generated file's converted days
        sys.path.insert(0, REPO)
        from mlkv_torch.data.criteo_convert import convert

        days = convert([tsv], cache, days=7)[0]
        return [f"data.criteo.train=[{','.join(days[:-1])}]", f"data.criteo.eval=[{days[-1]}]"]
    return []


def child_loader(name: str, overrides: List[str], batches: int) -> Dict[str, Any]:
    """The loader alone: samples/s of `batches` batches through the config's BatchLoader."""
    from mlkv_torch.config import load_config
    from mlkv_torch.data.loader import BatchLoader
    from mlkv_torch.train.sources import batch_source, input_cpu_budget, loader_tuner
    from mlkv_torch.train import torch_threads

    config = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), ["output_dir=/unused", *overrides])
    source = batch_source(config, input_cpu_budget(config, torch_threads(config)))
    tuner = loader_tuner(config, torch_threads(config), getattr(source, "remote_workers", None))
    source.make_batch(0)  # imports and first touches out of the timings
    first_batch_s = {}
    for first in (0, RESUMED_AT):  # a run's start, and a run resumed that many batches in
        began = time.perf_counter()
        late = BatchLoader(source.make_batch, first=first, count=1, tuner=tuner)
        next(late)
        first_batch_s[str(first)] = time.perf_counter() - began
        late.close()
    loader = BatchLoader(source.make_batch, count=batches, tuner=tuner)
    next(loader)  # threads started, first batch made
    files = getattr(source, "train_batches", None)
    read_before, groups_before = _bytes_read(), getattr(files, "row_groups_read", 0)
    began = time.perf_counter()
    delivered = sum(1 for _ in loader)
    seconds = time.perf_counter() - began
    result = {"samples_per_s": delivered * config.train.batch_size / seconds, "first_batch_s": first_batch_s,
              **loader.stats()}
    if hasattr(files, "bytes_read_per_epoch") and files.row_groups_read > groups_before:
        # Parquet: bytes read a row of the row groups decoded meanwhile, against its declared and every column
        rows = (files.row_groups_read - groups_before) * files.rows / files.row_groups
        result.update(file_bytes_per_row=(_bytes_read() - read_before) / rows,
                      declared_bytes_per_row=files.bytes_read_per_epoch / files.rows,
                      every_column_bytes_per_row=files.bytes_per_epoch / files.rows)
    return result


def _bytes_read() -> int:
    """Bytes this process has read through system calls (page cache or disk)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


class PremadeBatches:
    """Every batch of the run made before training starts (the trainer's rate with its input in memory)."""

    def __init__(self, make_batch, first: int = 0, count: Optional[int] = None, stride: int = 1, tuner=None) -> None:
        self._batches = [make_batch(first + i * stride) for i in range(count)]
        self._next = 0

    def __iter__(self) -> "PremadeBatches":
        return self

    def __next__(self) -> Any:
        if self._next >= len(self._batches):
            raise StopIteration
        self._next += 1
        return self._batches[self._next - 1]

    def stats(self) -> Dict[str, Any]:
        return {"wait_s": 0.0, "workers": 0, "prefetch": len(self._batches), "buffer_bytes": 0, "batch_bytes": 0,
                "decisions": 0, "workers_needed": 0, "cpu_budget": 0, "input_cores": 0.0}

    def close(self) -> None:
        self._batches = []


def child_train(name: str, overrides: List[str], in_memory: bool) -> Dict[str, Any]:
    import mlkv_torch.data.loader as loader_module
    from mlkv_torch.config import load_config
    from mlkv_torch.train import run

    if in_memory:
        loader_module.BatchLoader = PremadeBatches  # the runner takes its loader from this module
    return run(load_config(os.path.join(REPO, "configs", f"{name}.yaml"), overrides), progress=False)


def _child(kind: str, *args: Any) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([kind, *args])]
    _, _, out = _timed_child(cmd)
    return json.loads(out.strip().splitlines()[-1])


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000, help="rows of the generated Criteo-format file")
    ap.add_argument("--reference-rows", type=int, default=1_000_000, help="rows given to torchrec's converter")
    ap.add_argument("--steps", type=int, default=200, help="training steps of each stall run")
    ap.add_argument("--short-steps", type=int, default=40,
                    help="training steps of the in-memory runs of the configs without stall runs")
    ap.add_argument("--batches", type=int, default=100, help="batches the loader alone delivers")
    ap.add_argument("--configs", default=",".join(SHIPPED), help="the shipped configs to run, comma-separated")
    ap.add_argument("--out", default="bench-out/bench_input.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    if args.child:
        kind, *rest = json.loads(args.child)
        result = child_loader(*rest) if kind == "loader" else child_train(*rest)
        print(json.dumps(result))
        return 0
    if args.smoke:
        args.rows, args.reference_rows, args.steps, args.short_steps, args.batches = 10_000, 500, 10, 4, 6
    report: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-input-") as work:
        # The smoke run leaves Ray out (its start is most of a smoke run): tests/data/test_ray_data.py covers it.
        conversion = report["conversion"] = bench_conversion(work, args.rows, args.reference_rows, not args.smoke)
        print(f"conversion of {conversion['rows']:,} rows ({conversion['bytes'] / 2**30:.2f} GiB): "
              f"{conversion['convert_rows_per_s']:,.0f} rows/s, peak RSS "
              f"{conversion['convert_peak_rss_bytes'] / 2**20:,.0f} MiB "
              f"(torchrec's converter on {conversion['reference_rows']:,} rows: "
              f"{conversion['torchrec_rows_per_s']:,.0f} rows/s, "
              f"peak RSS {conversion['torchrec_peak_rss_bytes'] / 2**20:,.0f} MiB: "
              f"{conversion['convert_rows_per_s'] / conversion['torchrec_rows_per_s']:.1f}x); converted again: "
              f"{conversion['converted_again_s']:.2f} s; generated at {conversion['generate_rows_per_s']:,.0f} rows/s",
              flush=True)
        if "parquet_ray_rows_per_s" in conversion:
            print(f"to Parquet, the file in two parts: {conversion['parquet_here_rows_per_s']:,.0f} rows/s in this "
                  f"process, {conversion['parquet_ray_rows_per_s']:,.0f} as Ray tasks (a local Ray: "
                  f"{conversion['parquet_ray_rows_per_s'] / conversion['parquet_here_rows_per_s']:.2f}x)", flush=True)
        tsv, cache = os.path.join(work, "train.txt"), os.path.join(work, "cache")
        runs: Dict[str, Dict[str, Any]] = {}
        loaders: Dict[str, Any] = {}
        variants = (("tuning off (1 thread, 1 buffered)", ["data.workers=1", "data.prefetch=1"], False),
                    ("auto", [], False), ("in memory", [], True))
        on_ray = ("on Ray (a local Ray, 2 actors)", ["data.engine=ray", "data.ray.actors=2"], False)
        stall_runs = SMOKE_STALL_RUNS if args.smoke else STALL_RUNS
        for name in (SMOKE_CONFIGS if args.smoke else [c for c in SHIPPED if c in args.configs.split(",")]):
            steps = args.steps if name in stall_runs else args.short_steps
            overrides = [f"train.steps={steps}", f"eval.every={steps}", "eval.batches=2",
                         *_config_overrides(name, tsv, cache, args.rows), *(SMOKE[name] if args.smoke else [])]
            chosen = variants if name in stall_runs else variants[2:]
            if args.smoke and name in stall_runs:  # the tuner's run; the others are the same code path
                chosen = variants[1:2]
            if name == "parquet_example" and not args.smoke:  # the Parquet files are what Ray prepares
                chosen = (*chosen, on_ray)
            for label, extra, in_memory in chosen:
                out = os.path.join(work, f"{name}-{len(runs)}")
                summary = _child("train", name, [f"output_dir={out}", *overrides, *extra], in_memory)
                summary["train_samples_per_s"] = summary["samples"] / summary["train_seconds"]
                runs[f"{name}, {label}"] = summary
                print(f"{name}, {label}: {summary['train_samples_per_s']:,.0f} samples/s in the training steps, "
                      f"input_wait_share {summary['input_wait_share']:.2%} ({summary['input_wait_ms']:.2f} ms a "
                      f"step), loader {summary['input']['workers']} thread(s), {summary['input']['prefetch']} "
                      f"buffered", flush=True)
            if args.smoke and name != SMOKE_CONFIGS[-1]:  # the loader alone once: the same code path
                continue
            alone = loaders[name] = _child("loader", name, overrides, args.batches)
            trainer = runs[f"{name}, in memory"]["train_samples_per_s"]
            alone["trainer_samples_per_s"] = trainer
            print(f"loader alone, {name}: {alone['samples_per_s']:,.0f} samples/s with {alone['workers']} thread(s): "
                  f"{alone['samples_per_s'] / trainer:.1f}x the trainer with its input in memory; first batch "
                  f"{alone['first_batch_s']['0'] * 1e3:.1f} ms at batch 0, "
                  f"{alone['first_batch_s'][str(RESUMED_AT)] * 1e3:.1f} "
                  f"ms at batch {RESUMED_AT:,} (a late resume)", flush=True)
            if name == "parquet_example" and not args.smoke:
                ray_alone = loaders[f"{name}, {on_ray[0]}"] = _child("loader", name, [*overrides, *on_ray[1]],
                                                                     args.batches)
                print(f"loader alone, {name} {on_ray[0]}: {ray_alone['samples_per_s']:,.0f} samples/s with "
                      f"{ray_alone['workers']} thread(s) waiting on the actors: "
                      f"{ray_alone['samples_per_s'] / alone['samples_per_s']:.2f}x the in-process loader's",
                      flush=True)
            npy = loaders.get("criteo_terabyte", {}).get("samples_per_s")
            if name == "parquet_example" and npy:
                print(f"  Parquet: {alone['samples_per_s'] / npy:.2f}x the npy path's (criteo_terabyte) samples/s",
                      flush=True)
            if "file_bytes_per_row" in alone:
                print(f"  Parquet read {alone['file_bytes_per_row']:.1f} bytes a row from its files: the declared "
                      f"columns hold {alone['declared_bytes_per_row']:.1f}, every column "
                      f"{alone['every_column_bytes_per_row']:.1f} "
                      f"({alone['file_bytes_per_row'] / alone['every_column_bytes_per_row']:.2f}x the full width)",
                      flush=True)
            if name == "criteo_terabyte":
                shutil.rmtree(cache, ignore_errors=True)
        report["stalls"], report["loader_alone"] = runs, loaders
    write_json_report(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
