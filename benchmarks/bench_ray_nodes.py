#!/usr/bin/env python3
"""Two Ray nodes in network namespaces on this machine convert a Criteo-format day to Parquet and
feed a 2-rank torchrun run; the same run with the in-process loader gives the reference losses.

1. A Criteo-format file of --rows rows (`criteo generate`), cut into two parts of whole lines.
2. Conversion to Parquet: in this process (`criteo convert --format parquet`), then as Ray tasks on
   the two nodes (`--ray 10.77.0.1:6379`, the driver in node 0's namespace): rows/s of each.
3. Training (configs/parquet_example.yaml with the converted day's Criteo schema), one torchrun rank
   per node (shaped_network.run_job): the in-process loader, then `data.engine: ray` with one
   actor a rank on the cluster, a Ray worker killed with SIGKILL mid-run. Both runs' losses (rank
   0's metrics.jsonl) must be equal: the killed worker's batches were made again, none lost, none
   twice.

Needs root (namespaces) and ray (`pip install .[ray]`). Traffic goes only among the namespaces
this makes; they are removed when it ends, the Ray nodes stopped first.

    python benchmarks/bench_ray_nodes.py [--rows 400000] [--steps 60] [--rate 1gbit]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

from common import REPO, write_json_report
from shaped_network import ShapedNetwork, available, run_job

RAY_PORT = 6379


def _in_namespace(net: ShapedNetwork, node: int, argv: List[str], timeout: float = 600) -> str:
    done = subprocess.run(["ip", "netns", "exec", net.namespace(node), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{argv} in node {node} failed: {done.stdout[-2000:]} {done.stderr[-3000:]}")
    return done.stdout


def _ray(*args: str) -> List[str]:
    return [os.path.join(os.path.dirname(sys.executable), "ray"), *args]


def _losses(output_dir: str) -> List[float]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _print_errors(output_dir: str) -> None:
    """The lines of the nodes' logs in `output_dir` that say what failed (run_job's own tail is the last words)."""
    for name in sorted(os.listdir(output_dir)):
        if name.startswith("node") and name.endswith(".log"):
            with open(os.path.join(output_dir, name), errors="replace") as f:
                lines = [line.rstrip() for line in f if any(w in line for w in ("[data]", "Error", "error:"))]
            print(f"{name}:", *lines[-20:], sep="\n  ", file=sys.stderr, flush=True)


def _asked_again(output_dir: str) -> int:
    """Batches the ranks asked Ray for again after data.ray.batch_timeout_s (their logs' lines)."""
    count = 0
    for name in os.listdir(output_dir):
        if name.startswith("node") and name.endswith(".log"):
            with open(os.path.join(output_dir, name), errors="replace") as f:
                count += sum("did not come from its Ray batch maker" in line for line in f)
    return count


def _kill_a_worker_mid_run(output_dir: str, killed: List[int]) -> threading.Thread:
    """Kills one batch maker's process (SIGKILL) once the run has logged its first losses (mid-run
    however fast the machine trains)."""
    def kill() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                started = bool(_losses(output_dir))
            except OSError:
                started = False
            found = subprocess.run(["pgrep", "-f", "_BatchMaker"], capture_output=True, text=True).stdout.split()
            for pid in found if started else []:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:  # gone since pgrep saw it: another, or look again
                    continue
                killed.append(int(pid))
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rate", default=None, help="each link's rate (tc's units, e.g. 1gbit); default unshaped")
    ap.add_argument("--out", default="bench-out/bench_ray_nodes.json")
    args = ap.parse_args(argv)
    why = available()
    if why:
        raise SystemExit(f"bench_ray_nodes {why}")
    # The nodes, the drivers and the ranks all run here, on addresses this run made: no tokens.
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    sys.path.insert(0, REPO)
    from mlkv_torch.data.criteo_generate import generate
    from mlkv_torch.data.criteo_parquet import parquet_schema
    from mlkv_torch.data.synthetic import CRITEO_KAGGLE_CARDINALITIES

    from bench_input import _split_lines

    report: Dict[str, Any] = {"rows": args.rows}
    with tempfile.TemporaryDirectory(prefix="bench-ray-nodes-") as work, ShapedNetwork(2, args.rate) as net:
        os.chmod(work, 0o755)
        tsv = os.path.join(work, "day.tsv")
        generate(tsv, args.rows, cardinalities=tuple(max(2, n // 100) for n in CRITEO_KAGGLE_CARDINALITIES))
        parts = _split_lines(tsv, 2)
        head = f"{net.address(0)}:{RAY_PORT}"
        def start_nodes() -> None:
            _in_namespace(net, 0, _ray("start", "--head", f"--node-ip-address={net.address(0)}", f"--port={RAY_PORT}",
                                       "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"))
            _in_namespace(net, 1, _ray("start", f"--address={head}", f"--node-ip-address={net.address(1)}",
                                       "--num-cpus=1", "--disable-usage-stats"))

        def stop_nodes() -> None:
            for node in (1, 0):
                subprocess.run(["ip", "netns", "exec", net.namespace(node), *_ray("stop", "--force")],
                               capture_output=True)

        try:
            start_nodes()
            convert = [sys.executable, "-m", "mlkv_torch.data.criteo", "convert", *parts, "--format", "parquet"]
            began = time.perf_counter()
            subprocess.run([*convert, "--out", os.path.join(work, "here")], check=True, capture_output=True,
                           cwd=REPO)
            report["convert_here_rows_per_s"] = args.rows / (time.perf_counter() - began)
            began = time.perf_counter()
            printed = _in_namespace(net, 0, [*convert, "--out", os.path.join(work, "ray"), "--ray", head])
            report["convert_ray_rows_per_s"] = args.rows / (time.perf_counter() - began)
            report["convert_ray_output"] = printed.strip().splitlines()[-1]
            print(f"to Parquet: {report['convert_here_rows_per_s']:,.0f} rows/s in one process, "
                  f"{report['convert_ray_rows_per_s']:,.0f} on the two Ray nodes "
                  f"({report['convert_ray_rows_per_s'] / report['convert_here_rows_per_s']:.2f}x): "
                  f"{report['convert_ray_output']}", flush=True)
            files = [f for f in printed.split() if f.endswith(".parquet")]
            # Fresh nodes for training: after the conversion's driver ended, Ray 2.60's raylets kept
            # retrying it and a later run's batches never reached one rank (docs/data.md).
            stop_nodes()
            start_nodes()
            schema = parquet_schema([max(2, n // 100) for n in CRITEO_KAGGLE_CARDINALITIES])
            overrides = [f"data.parquet.train=[{','.join(files)}]", f"data.parquet.eval=[{files[-1]}]",
                         f"data.parquet.dense={json.dumps(schema['dense'])}",
                         f"data.parquet.sparse={json.dumps(schema['sparse'])}", "data.parquet.shuffle_window=8",
                         f"train.steps={args.steps}", "train.log_every=5", f"eval.every={args.steps}",
                         "eval.batches=1", "train.batch_size=1024", "storage.memory_budget_bytes=33554432"]
            config = os.path.join(REPO, "configs", "parquet_example.yaml")
            runs = {}
            for engine in ("local", "ray"):
                out = os.path.join(work, f"run-{engine}")
                os.makedirs(out)
                extra = [f"data.engine={engine}", f"data.ray.address={head}", "data.ray.actors=1",
                         "data.ray.batch_timeout_s=15"]
                killed: List[int] = []
                killer = _kill_a_worker_mid_run(out, killed) if engine == "ray" else None
                try:
                    summary = run_job(net, config, out, os.path.join(work, f"tables-{engine}"), [*overrides, *extra])
                except RuntimeError:
                    _print_errors(out)
                    raise
                if killer is not None:
                    killer.join()
                runs[engine] = {"samples_per_s": summary["samples_per_s"],
                                "input_wait_share": summary["input_wait_share"], "losses": _losses(out),
                                "link_bytes": summary["link_bytes"], "killed_worker": killed,
                                "batches_asked_again": _asked_again(out)}
                print(f"2 ranks, {engine} loader: {summary['samples_per_s']:,.0f} samples/s, input_wait_share "
                      f"{summary['input_wait_share']:.2%}, {summary['link_bytes'] / 2**20:.1f} MiB over the links"
                      + (f", Ray worker {killed} killed mid-run" if killed else "")
                      + (f", {runs[engine]['batches_asked_again']} batches asked for again" if killed else ""),
                      flush=True)
            report["runs"] = runs
            if not runs["ray"]["killed_worker"]:
                print("ERROR: no batch maker was killed mid-run (the run ended first)", flush=True)
            same = runs["ray"]["losses"] == runs["local"]["losses"]
            report["same_losses"] = same
            print(f"losses equal: {same} ({len(runs['ray']['losses'])} logged steps)", flush=True)
        finally:
            stop_nodes()
    write_json_report(args.out, report)
    print(f"wrote {args.out}")
    return 0 if report.get("same_losses") and report["runs"]["ray"]["killed_worker"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
