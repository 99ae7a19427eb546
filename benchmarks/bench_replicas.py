#!/usr/bin/env python3
"""The runner across nodes on a slow network made on one machine: each node a Linux network
namespace (`shaped_network.py`), joined by a bridge, each link rate-shaped with `tc`; each node one
rank of a multi-node torchrun job (`--nnodes N`), with its own local `storage.path` for its tables
and only `output_dir` shared.

    sudo python benchmarks/bench_replicas.py [--config configs/quickstart.yaml] [--ranks 2,4]
        [--rates 1gbit,100mbit] [--steps 60] [--smoke]

Reported per (ranks, link rate): the training step's time (the runner's train seconds over its
steps), and after the replicas' warm-up (the log lines' `step_ms` from the first choice on: the
warm-up steps, without replicas, are a cost of the run's start only); the bytes the embeddings'
all-to-alls sent between ranks a step, all ranks together and by kind (ids, pooled outputs,
gradients: the runner's `embedding_bytes_per_step`, counted where they are sent); the bytes all
nodes sent on their links a step (the links' tx counters over the run: headers, rendezvous, the
dense model's all-reduce and evaluation included); the cache hit rate and the held-out AUC.
Then a run is checkpointed and stopped, and resumed with `--resume` on every node (each from
its own storage.path): it must go on from its checkpoint and finish at the steps asked for.

Each configuration runs without replicas of hot rows and with each variant of `--replicas`
(fraction, pull and push bound), whose memory budget is raised by the replicas' bytes so that the
tables get the same plan; the table gives each against the run without them. Needs root (CI and
the development machines have it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Sequence

from common import REPO, ReportLog, markdown_table, write_json_report
from shaped_network import ShapedNetwork, available, run_job


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "quickstart.yaml"))
    ap.add_argument("--ranks", default="2,4", help="node counts, one rank each")
    ap.add_argument("--rates", default="1gbit,100mbit", help="link rates (tc units), 'none' for unshaped")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--replicas", default="none,0.01:0:0,0.01:3:3",
                    help="variants: none, or fraction:pull_bound:push_bound (storage.replicas.*)")
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--override", action="append", default=[], help="more dotted.key=value for the runner")
    ap.add_argument("--dir", default=None, help="where runs go (default: a temporary directory)")
    ap.add_argument("--out", default="bench-out/bench_replicas.json")
    ap.add_argument("--smoke", action="store_true", help="2 nodes at 1 Gbit, a tiny model, a few steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.rates, args.steps, args.batch = "2", "1gbit", 6, 256
        args.replicas = "none,0.05:1:1"
        args.override += ["storage.replicas.warmup_steps=2",
                          "data.synthetic.scale=2000", "eval.batches=1", "eval.every=6",
                          "pipeline.depth=1"]
    return args


def load_config(config: str, overrides: List[str]) -> Any:
    """The runner's reading of `config` with `overrides` (an ExperimentConfig)."""
    sys.path.insert(0, REPO)
    from mlkv_torch.config import load_config as load

    return load(config, overrides)


def replica_overrides(variant: str, config: str, overrides: List[str]) -> List[str]:
    """The runner's keys for a variant; a variant with replicas gets the memory budget raised by
    their bytes, so its tables get the plan of the run without them."""
    if variant == "none":
        return []
    from mlkv_torch.config import cardinalities_of
    from mlkv_torch.torchrec.replicas import replica_memory_bytes

    fraction, pull, push = variant.split(":")
    base = load_config(config, [o for o in overrides if not o.startswith("storage.replicas.")])
    dim = base.model.embedding_dim
    rows = cardinalities_of(base.data.synthetic.cardinalities, base.data.synthetic.scale)
    extra = sum(replica_memory_bytes(n, dim, float(fraction)) for n in rows)
    return [f"storage.replicas.fraction={fraction}", f"storage.replicas.pull_bound={pull}",
            f"storage.replicas.push_bound={push}",
            f"storage.memory_budget_bytes={base.storage.memory_budget_bytes + extra}"]


def step_ms_after(metrics_path: str, after: int) -> float:
    """The mean training step after step `after`, from the runner's log lines (`step_ms`, each its window's)."""
    total_ms, steps, last = 0.0, 0, 0
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "step_ms" in record:  # not an evaluation's line
                if last >= after:
                    total_ms += (record["step"] - last) * record["step_ms"]
                    steps += record["step"] - last
                last = record["step"]
    return total_ms / steps if steps else float("nan")


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    why_not = available()
    if why_not:
        print(f"bench_replicas {why_not}", file=sys.stderr)
        return 2
    log = ReportLog()
    log(f"# bench_replicas {datetime.date.today()}: {os.path.basename(args.config)}, {args.steps} steps of "
        f"{args.batch} samples a rank, one rank a node, each node's tables in its own directory")
    root = tempfile.mkdtemp(prefix="bench-replicas-", dir=args.dir)
    warmup = load_config(args.config, args.override).storage.replicas.warmup_steps
    # A log line a warm-up's steps: the steps after the warm-up are whole windows.
    overrides = [f"train.steps={args.steps}", f"train.batch_size={args.batch}", f"train.log_every={warmup}",
                 *args.override]
    results: List[Dict[str, Any]] = []
    try:
        for nodes in [int(n) for n in args.ranks.split(",")]:
            for rate in args.rates.split(","):
                for variant in args.replicas.split(","):
                    name = f"{nodes} ranks, {rate}, " + ("no replicas" if variant == "none" else
                                                         "replicas {}, bounds {}/{}".format(*variant.split(":")))
                    out = os.path.join(root, f"n{nodes}-{rate}-{variant}")
                    os.makedirs(out)
                    with ShapedNetwork(nodes, None if rate == "none" else rate) as net:
                        summary = run_job(net, args.config, out, os.path.join(out, "tables"),
                                          [*overrides, *replica_overrides(variant, args.config, overrides)])
                    steps = summary["steps"]
                    results.append(dict(config=name, nodes=nodes, rate=rate, replicas=variant, steps=steps,
                                        step_ms=summary["train_seconds"] / steps * 1e3,
                                        steady_step_ms=step_ms_after(os.path.join(out, "metrics.jsonl"), warmup),
                                        link_bytes_per_step=summary["link_bytes"] / steps,
                                        embedding_bytes_per_step=summary["embedding_bytes_per_step"],
                                        by_kind=summary["embedding_bytes_per_step_by_kind"],
                                        hit_rate=summary["hit_rate"], replica_hit_rate=summary.get("replica_hit_rate"),
                                        auc=summary["auc"], samples_per_s=summary["samples_per_s"]))
                    shutil.rmtree(out, ignore_errors=True)
        # Checkpoint, stop, resume on every node from its own tables: the multi-node restart.
        nodes = int(args.ranks.split(",")[0])
        out = os.path.join(root, "resume")
        os.makedirs(out)
        every = max(1, args.steps // 3)
        first = [*overrides, f"train.steps={2 * every}", f"train.checkpoint_every={every}"]
        with ShapedNetwork(nodes, None) as net:
            run_job(net, args.config, out, os.path.join(out, "tables"), first)
            resumed = run_job(net, args.config, out, os.path.join(out, "tables"),
                              [*overrides, f"train.checkpoint_every={every}"], resume=True)
        # It went on from its checkpoint: it trained only the steps after it.
        trained_steps = resumed["samples"] // (args.batch * nodes)
        resume_ok = resumed["steps"] == args.steps and trained_steps == args.steps - 2 * every
        log(f"resume: {nodes} nodes checkpointed every {every} steps, stopped at {2 * every}, resumed and trained "
            f"{trained_steps} more steps to {resumed['steps']} of {args.steps}: {'ok' if resume_ok else 'FAILED'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log("")
    reference = {(r["nodes"], r["rate"]): r for r in results if r["replicas"] == "none"}

    def versus(r: Dict[str, Any]) -> str:
        ref = reference.get((r["nodes"], r["rate"]))
        if ref is None or r is ref:
            return "-"
        bytes_ratio = r["embedding_bytes_per_step"] / ref["embedding_bytes_per_step"]
        speedup, steady = ref["step_ms"] / r["step_ms"], ref["steady_step_ms"] / r["steady_step_ms"]
        return (f"{speedup:.2f}x faster ({steady:.2f}x after warm-up), {bytes_ratio:.2f}x bytes, "
                f"AUC {r['auc'] - ref['auc']:+.4f}")
    kinds = ("ids", "outputs", "gradients", "replica_pushes", "replica_refreshes", "replica_choice")
    for line in markdown_table(["configuration", "step (ms)", "after warm-up", "embedding bytes/step",
                                " / ".join(kinds), "link bytes/step", "replica hit rate", "hit rate", "AUC",
                                "against no replicas"],
                               [[r["config"], f"{r['step_ms']:.1f}", f"{r['steady_step_ms']:.1f}",
                                 f"{r['embedding_bytes_per_step']:,.0f}",
                                 " / ".join(f"{r['by_kind'].get(k, 0):,.0f}" for k in kinds),
                                 f"{r['link_bytes_per_step']:,.0f}",
                                 f"{r['replica_hit_rate']:.3f}" if r["replica_hit_rate"] is not None else "-",
                                 f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-",
                                 f"{r['auc']:.4f}" if r["auc"] is not None else "-", versus(r)] for r in results]):
        log(line)
    write_json_report(args.out, dict(args=vars(args), date=str(datetime.date.today()), results=results,
                                     resume_ok=resume_ok, lines=log.lines))
    return 0 if resume_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
