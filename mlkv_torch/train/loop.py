"""The training loop of the runner: `run` trains and evaluates one experiment and writes its
metrics, checkpoints and summary."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError, ExperimentConfig
from ..ranks import all_gather_objects
from ..wire import EmbeddingTraffic
from . import checkpoints, elastic
from .experiment import Experiment, torch_threads



def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


def _disk_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def run(config: ExperimentConfig, resume: bool = False, progress: bool = True) -> Dict[str, Any]:
    """Runs one experiment; returns the summary (also written to output_dir/summary.json).

    Storage kind `memory` uses TorchRec's fused in-memory kernels, which come through
    DistributedModelParallel: in one process, a one-process gloo group is made for it.
    """
    own_group = config.storage.kind == "memory" and not (dist.is_available() and dist.is_initialized())
    if own_group:
        os.makedirs(config.output_dir, exist_ok=True)
        rendezvous = os.path.join(config.output_dir, ".process_group")
        if os.path.exists(rendezvous):
            os.remove(rendezvous)  # a FileStore left by an earlier run would be read as this one's
        dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 1), rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads(config))
    try:
        return _run(config, resume, progress)
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()


def _run(config: ExperimentConfig, resume: bool, progress: bool) -> Dict[str, Any]:
    from tqdm import tqdm

    from ..pipeline import LookaheadPipeline

    try:
        os.makedirs(config.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir {config.output_dir!r} cannot be created: {e.strerror or e}") from e
    try:
        experiment = Experiment(config, resume)
    except FileExistsError as e:  # an earlier run's tables: say first how the runner continues from them
        raise ConfigError(f"output_dir {config.output_dir!r} already holds an earlier run's tables: continue it with "
                          f"--resume, or choose another output_dir (or storage.path). In detail: {e}") from e
    if experiment.distributed and experiment.is_main:
        elastic.record_job(config)  # a restart of this job by torchrun may continue or drop these tables
    if experiment.world_size > 1 and experiment.source.row_order is not None:
        print(f"[data] {experiment.source.row_order.describe_share(experiment.rank)}", flush=True)
    populate_s = 0.0
    # A resumed run's tables hold their rows already; populating again would also take a cut past
    # the one its checkpoint names.
    if config.storage.populate and not resume:
        began = time.perf_counter()
        rows = experiment.populate()
        populate_s = time.perf_counter() - began
        if experiment.is_main:
            print(f"[train] wrote {rows:,} rows{' (rank 0)' if experiment.distributed else ''} to the stores "
                  f"before training in {populate_s:.1f} s", flush=True)
    start_step = 0
    if resume:
        if not os.path.exists(experiment.checkpoint_path()):
            raise ConfigError(f"--resume: no checkpoint at {experiment.checkpoint_path()}")
        start_step = experiment.load()
    train = config.train
    pipeline = LookaheadPipeline(experiment.model, experiment.optimizer, depth=config.pipeline.depth,
                                 device=experiment.device if experiment.device.type != "cpu" else None)
    data = experiment.loader(start_step, train.steps - start_step)
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    evaluation: Dict[str, float] = {}
    started = time.perf_counter()
    samples = 0
    main = experiment.is_main  # under torchrun, rank 0 reports for all
    world = experiment.world_size
    if resume and main and os.path.exists(metrics_path):
        # A killed run's steps past its checkpoint are trained again.
        checkpoints.drop_records_after(metrics_path, start_step)
    reads_at_start = experiment.store_reads()
    bar = tqdm(total=train.steps, initial=start_step, disable=not (progress and main), unit="step", dynamic_ncols=True)
    board = _tensorboard(config) if main else None
    train_s = 0.0  # in pipeline.progress: the training steps, their waits for input included
    traffic = EmbeddingTraffic()  # what the embeddings send between ranks in training steps (not evaluations)
    window_sent = 0  # all ranks' bytes at the last log line
    replica_lookups = _ReplicaLookups(experiment.replicas)
    window_served = (0, 0)  # all ranks' replica hits and lookups at the last log line
    try:
        # Unbuffered: a write a full disk refuses leaves nothing behind for the close to raise again.
        with open(metrics_path if main else os.devnull, "ab", buffering=0) as metrics:
            step = start_step
            window_start, window_samples, window_steps, window_wait_s = time.perf_counter(), 0, 0, 0.0
            window_train_s = 0.0  # train_s at the last log line
            while step < train.steps:
                if experiment.replicas is not None and train.checkpoint_every \
                        and (step + 1) % train.checkpoint_every == 0:
                    experiment.replicas.push_all_in_next_step()  # the checkpoint's cut holds every gradient
                began = time.perf_counter()
                traffic.start()
                try:
                    loss, _, labels = pipeline.progress(data)
                except StopIteration:
                    break
                finally:
                    traffic.stop()
                train_s += time.perf_counter() - began
                step += 1
                experiment.boundaries.passed()
                samples += labels.numel() * world
                window_samples += labels.numel() * world
                window_steps += 1
                record: Dict[str, Any] = {}
                if step % train.log_every == 0 or step == train.steps:
                    now = time.perf_counter()
                    rate = window_samples / max(now - window_start, 1e-9)
                    input_stats = data.stats()
                    sent = sum(traffic.all_ranks().values())  # a collective: every rank logs at this step
                    record.update(step=step, loss=float(loss), samples_per_s=rate,
                                  step_ms=(train_s - window_train_s) * 1e3 / window_steps, depth=pipeline.depth,
                                  embedding_bytes_per_step=(sent - window_sent) / window_steps,
                                  input_wait_ms=(input_stats["wait_s"] - window_wait_s) * 1e3 / window_steps,
                                  input_workers=input_stats["workers"], input_prefetch=input_stats["prefetch"])
                    window_start, window_samples, window_steps, window_wait_s = now, 0, 0, input_stats["wait_s"]
                    window_train_s = train_s
                    window_sent = sent
                    hit_rate = experiment.hit_rate()
                    if hit_rate is not None:
                        record["hit_rate"] = hit_rate
                    if experiment.replicas is not None:
                        served = replica_lookups.all_ranks()  # a collective, as above
                        record["replica_hit_rate"] = _share(served, window_served)
                        window_served = served
                    bar.set_postfix(samples_s=f"{rate:,.0f}", loss=f"{float(loss):.4f}",
                                    hit=f"{hit_rate:.1%}" if hit_rate is not None else "-")
                if step % config.eval.every == 0 or step == train.steps:
                    evaluation = experiment.evaluate(step)
                    record.update(step=step, **{f"eval_{k}": v for k, v in evaluation.items()})
                if record:
                    _append_line(metrics, metrics_path, json.dumps(record))
                    if board is not None:
                        for key, value in record.items():
                            if key != "step" and isinstance(value, (int, float)):
                                board.add_scalar(key, value, step)
                if train.checkpoint_every and step % train.checkpoint_every == 0:
                    experiment.save(step)
                bar.update(1)
    finally:
        data.close()  # its threads stop, also when a step fails
        experiment.source.close()  # Ray's actors end with training; evaluation reads here
    bar.close()
    if board is not None:
        board.close()
    experiment.finish_save()
    elapsed = time.perf_counter() - started
    sent = traffic.all_ranks()
    served = replica_lookups.all_ranks()
    experiment.collection.flush()
    # Each rank's rows read from its stores a step (evaluations' reads included): where row-wise
    # tables spread what one rank would read.
    reads = experiment.store_reads() - reads_at_start
    reads_per_step = [r / max(1, step - start_step)
                      for r in (all_gather_objects(reads) if experiment.distributed else [reads])]
    live = all_gather_objects(experiment.live_ids()) if experiment.distributed else [experiment.live_ids()]
    live_ids = None if None in live else sum(live)
    eviction = all_gather_objects(experiment.eviction()) if experiment.distributed else [experiment.eviction()]
    evicted_ids = None if None in eviction else sum(e[0] for e in eviction)
    peak_live_ids = None if None in eviction else max(e[1] for e in eviction)
    summary_path = os.path.join(config.output_dir, "summary.json")
    if step == start_step and start_step > 0:
        # Resumed from a checkpoint at the run's last step (killed after it): nothing was left to
        # train. A finished run's summary stays; otherwise the checkpointed model is evaluated.
        if os.path.exists(summary_path):
            experiment.collection.close()
            with open(summary_path) as f:
                return json.load(f)
        if not evaluation:
            evaluation = experiment.evaluate(step)
    summary = {"steps": step, "samples": samples, "world_size": world, "device": config.device, "seconds": elapsed,
               "samples_per_s": samples / max(elapsed, 1e-9),
               "auc": evaluation.get("auc"), "logloss": evaluation.get("logloss"),
               "oracle_auc": evaluation.get("oracle_auc"),
               "hit_rate": experiment.hit_rate(), "lookahead_depth": pipeline.depth,
               "replica_hit_rate": _share(served, (0, 0)) if experiment.replicas is not None else None,
               # All ranks together, a training step's mean: what DMP's all-to-alls sent between ranks.
               "embedding_bytes_per_step": sum(sent.values()) / max(1, step - start_step),
               "embedding_bytes_per_step_by_kind": {k: v / max(1, step - start_step) for k, v in sent.items()},
               "peak_rss_bytes": _peak_rss_bytes(),
               "disk_bytes": _disk_bytes(experiment.tables_path) if config.storage.kind != "memory" else 0,
               "store_reads_per_step_by_rank": reads_per_step, "live_ids": live_ids, "evicted_ids": evicted_ids,
               "peak_live_ids": peak_live_ids,
               "storage": config.storage.kind, "populate_s": populate_s,
               "torch_threads": torch.get_num_threads(), **_input_summary(data.stats(), train_s, step - start_step)}
    if main:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        short = summary["input"]
        if short["workers_needed"] > short["cpu_budget"] and summary["input_wait_share"] > 0.01:
            print(_too_few_input_workers(config, short["workers_needed"], short["cpu_budget"],
                                         summary["input_wait_share"]), flush=True)
    experiment.collection.close()
    return summary


class _ReplicaLookups:
    """The lookups into replicated tables and those the replicas served, all ranks together."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas

    def all_ranks(self) -> Tuple[int, int]:
        """(served, looked up): a collective under torchrun."""
        if self.replicas is None:
            return 0, 0
        counts = torch.tensor([self.replicas.stats["replica_hits"], self.replicas.stats["lookups"]],
                              dtype=torch.int64)
        dist.all_reduce(counts)
        return int(counts[0]), int(counts[1])


def _share(now: Tuple[int, int], before: Tuple[int, int]) -> Optional[float]:
    looked_up = now[1] - before[1]
    return (now[0] - before[0]) / looked_up if looked_up else None


def _append_line(file: Any, path: str, line: str) -> None:
    """Writes `line` to the unbuffered `file` (at `path`) whole; a full disk's error names the file."""
    data = memoryview((line + "\n").encode())
    try:
        while data:
            data = data[file.write(data):]  # a short write: the rest goes again, and fails if the disk is full
    except OSError as e:
        raise OSError(e.errno, f"writing {path}: {e.strerror}") from e


def _input_summary(stats: Dict[str, Any], train_s: float, steps: int) -> Dict[str, Any]:
    """The summary's input figures: the training steps' time (`train_s`, evaluations and the rest
    left out), the share of it spent waiting for a batch (DS-Analyzer's data stall), the wait per
    step, and what the loader chose."""
    return {"train_seconds": train_s, "input_wait_share": stats["wait_s"] / train_s if train_s > 0 else 0.0,
            "input_wait_ms": stats["wait_s"] * 1e3 / steps if steps else 0.0,
            "input": {k: stats[k] for k in ("workers", "prefetch", "buffer_bytes", "batch_bytes", "decisions",
                                            "workers_needed", "cpu_budget", "input_cores")}}


def _too_few_input_workers(config: ExperimentConfig, needed: int, given: int, wait_share: float) -> str:
    """What the runner says when training waited for batches that `needed` workers would have made
    in time and it had `given`: Ray's actors, or this host's threads."""
    if config.data.engine == "ray":
        return (f"[train] the input needs {needed} Ray batch makers to keep ahead of training; this rank has "
                f"{given}, and training waited {wait_share:.0%} of its steps' time: ask for more actors "
                f"(data.ray.actors), or make batches cheaper (fewer columns)")
    return (f"[train] the input needs {needed} threads to keep ahead of training; this host gives the loader "
            f"{given}, and training waited {wait_share:.0%} of its steps' time: give it more cores, or make "
            f"batches cheaper (fewer columns, converted once)")


def _tensorboard(config: ExperimentConfig) -> Any:
    """A SummaryWriter under output_dir/tensorboard when train.tensorboard is set, else None."""
    if not config.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise ConfigError(f"train.tensorboard needs the tensorboard package (pip install tensorboard): {e}") from e
    return SummaryWriter(os.path.join(config.output_dir, "tensorboard"))
