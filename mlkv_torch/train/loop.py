"""The training loop of the runner: `run` trains and evaluates one experiment and writes its
metrics, checkpoints and summary."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError, ExperimentConfig
from ..ranks import all_gather_objects
from ..wire import EmbeddingTraffic
from . import checkpoints, elastic, outputs
from .experiment import Experiment, torch_threads
from .placement import runner_group, runner_group_held



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


def run(config: ExperimentConfig, resume: bool = False, progress: bool = True, overwrite: bool = False,
        imported: Optional[str] = None) -> Dict[str, Any]:
    """Runs one experiment; returns the summary (also written to output_dir/summary.json).
    `resume` continues the run output_dir holds from its last checkpoint; `overwrite` removes what
    an earlier run left there first (`outputs.remove_earlier_run`); without either, such a run is
    refused (ConfigError). `imported`, an export's path (`python -m mlkv_torch.export`), starts
    the run from its tables and dense model, at its step.

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
        with runner_group_held():
            return _run(config, resume, progress, overwrite, imported)
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()


def _run(config: ExperimentConfig, resume: bool, progress: bool, overwrite: bool, imported: Optional[str]
         ) -> Dict[str, Any]:
    from ..pipeline import LookaheadPipeline

    if overwrite:
        _start_over(config)
    if resume:  # before the tables open
        checkpoints.check_resumable(config.output_dir, config.train.checkpoint_every)
    experiment = _open_experiment(config, resume, imported)
    populate_s = _populate(experiment, config, resume or imported is not None)
    start_step = 0
    if resume or imported:
        start_step = experiment.load()
        if config.train.steps < start_step:  # the tables stay as filled: a run with more steps goes on from them
            raise ConfigError(f"train.steps={config.train.steps} is below step {start_step}, where the "
                              f"{'export' if imported else 'checkpoint'} is: set train.steps to {start_step} or more "
                              f"({start_step} only evaluates)")
    pipeline = LookaheadPipeline(experiment.model, experiment.optimizer, depth=config.pipeline.depth,
                                 device=experiment.device if experiment.device.type != "cpu" else None)
    data = experiment.loader(start_step, config.train.steps - start_step)
    training = _Training(experiment, config, pipeline, data, start_step, resume, progress)
    try:
        training.run()
    finally:
        data.close()  # its threads stop, also when a step fails
        experiment.source.close()  # Ray's actors end with training; evaluation reads here
    training.close()
    experiment.finish_save()
    return _summary(experiment, config, training, populate_s)


def _open_experiment(config: ExperimentConfig, resume: bool, imported: Optional[str]) -> Experiment:
    """The run's experiment, its output directory made; an earlier run's tables named as such."""
    places = [("output_dir", config.output_dir)]
    if config.storage.kind != "memory":
        places.append(("storage.path" if config.storage.path else "output_dir's tables", config.tables_path))
    for key, path in places:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{key} {path!r} cannot be created: {e.strerror or e}") from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {path!r} is not writable")
    try:
        experiment = Experiment(config, resume, imported)
    except FileExistsError as e:  # an earlier run's tables: the runner's two ways on, in one line
        raise ConfigError(f"output_dir {config.output_dir!r} holds an earlier run's tables: continue it with "
                          f"--resume, or start over with --overwrite") from e
    if experiment.distributed and experiment.is_main:
        elastic.record_job(config)  # a restart of this job by torchrun may continue or drop these tables
    if experiment.world_size > 1 and experiment.source.row_order is not None:
        print(f"[data] {experiment.source.row_order.describe_share(experiment.rank)}", file=sys.stderr, flush=True)
    return experiment


def _start_over(config: ExperimentConfig) -> None:
    """`--overwrite`: what an earlier run left goes before this one makes its tables (under
    torchrun rank 0 removes it while the others wait)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed or dist.get_rank() == 0:
        removed = outputs.remove_earlier_run(config)
        if removed:
            print(f"[train] --overwrite: removed the earlier run's {removed} tables, checkpoints and files",
                  file=sys.stderr, flush=True)
    if distributed:
        dist.barrier(group=runner_group())


def _populate(experiment: Experiment, config: ExperimentConfig, loads: bool) -> float:
    """Writes every row to the stores before training when the config asks (seconds it took). A
    run that `loads` a checkpoint or an export gets its rows there; populating a resumed run would
    also take a cut past the one its checkpoint names."""
    if not config.storage.populate or loads:
        return 0.0
    began = time.perf_counter()
    rows = experiment.populate()
    populate_s = time.perf_counter() - began
    if experiment.is_main:
        print(f"[train] wrote {rows:,} rows{' (rank 0)' if experiment.distributed else ''} to the stores "
              f"before training in {populate_s:.1f} s", file=sys.stderr, flush=True)
    return populate_s


class _LogWindow:
    """The steps since the last log line, all ranks together: what the next line reports."""

    def __init__(self, traffic: EmbeddingTraffic, replica_lookups: "_ReplicaLookups") -> None:
        self._traffic, self._replica_lookups = traffic, replica_lookups
        self._start, self._samples, self._steps = time.perf_counter(), 0, 0
        self._wait_s = self._train_s = 0.0  # the input's wait and the training time at the last line
        self._sent = 0  # bytes the embeddings sent
        self._served = (0, 0)  # replica hits and lookups

    def add_step(self, samples: int) -> None:
        self._samples += samples
        self._steps += 1

    def record(self, step: int, loss: torch.Tensor, train_s: float, depth: int, input_stats: Dict[str, Any],
               replicated: bool) -> Dict[str, Any]:
        """The log line's fields for the window ending at `step`, which starts a new window. A
        collective under torchrun: every rank logs at the same steps."""
        now = time.perf_counter()
        rate = self._samples / max(now - self._start, 1e-9)
        sent = sum(self._traffic.all_ranks(_runner_group_if_any()).values())
        record: Dict[str, Any] = dict(
            step=step, loss=float(loss), samples_per_s=rate, step_ms=(train_s - self._train_s) * 1e3 / self._steps,
            depth=depth, embedding_bytes_per_step=(sent - self._sent) / self._steps,
            input_wait_ms=(input_stats["wait_s"] - self._wait_s) * 1e3 / self._steps,
            input_workers=input_stats["workers"], input_prefetch=input_stats["prefetch"])
        if replicated:
            served = self._replica_lookups.all_ranks()
            record["replica_hit_rate"] = _share(served, self._served)
            self._served = served
        self._start, self._samples, self._steps, self._wait_s = now, 0, 0, input_stats["wait_s"]
        self._train_s, self._sent = train_s, sent
        return record


class _Training:
    """The training loop of a run: its steps through the pipeline, their log lines, evaluations and
    checkpoints, and what the summary reports of them."""

    def __init__(self, experiment: Experiment, config: ExperimentConfig, pipeline: Any, data: Any, start_step: int,
                 resume: bool, progress: bool) -> None:
        from tqdm import tqdm

        self.experiment, self.config, self.pipeline, self.data = experiment, config, pipeline, data
        self.start_step = self.step = start_step
        self.main = experiment.is_main  # under torchrun, rank 0 reports for all
        self.metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
        if resume and self.main and os.path.exists(self.metrics_path):
            # A killed run's steps past its checkpoint are trained again.
            checkpoints.drop_records_after(self.metrics_path, start_step)
        self.reads_at_start = experiment.store_reads()
        self.misses_at_start = experiment.cache_misses()
        self.evaluation: Dict[str, float] = {}
        self.samples = 0
        self.train_s = 0.0  # in pipeline.progress: the training steps, their waits for input included
        self.traffic = EmbeddingTraffic()  # what the embeddings send between ranks in training steps
        self.replica_lookups = _ReplicaLookups(experiment.replicas)
        self._bar = tqdm(total=config.train.steps, initial=start_step, disable=not (progress and self.main),
                         unit="step", dynamic_ncols=True)
        self._board = _tensorboard(config) if self.main else None
        self.started = time.perf_counter()

    def run(self) -> None:
        """Trains to the config's last step (or the data's end)."""
        train, experiment = self.config.train, self.experiment
        window = _LogWindow(self.traffic, self.replica_lookups)
        # Unbuffered: a write a full disk refuses leaves nothing behind for the close to raise again.
        with open(self.metrics_path if self.main else os.devnull, "ab", buffering=0) as metrics:
            while self.step < train.steps:
                if experiment.replicas is not None and train.checkpoint_every \
                        and (self.step + 1) % train.checkpoint_every == 0:
                    experiment.replicas.push_all_in_next_step()  # the checkpoint's cut holds every gradient
                began = time.perf_counter()
                self.traffic.start()
                try:
                    loss, _, labels = self.pipeline.progress(self.data)
                except StopIteration:
                    break
                finally:
                    self.traffic.stop()
                self.train_s += time.perf_counter() - began
                self.step += 1
                experiment.boundaries.passed()
                self.samples += labels.numel() * experiment.world_size
                window.add_step(labels.numel() * experiment.world_size)
                record: Dict[str, Any] = {}
                if self.step % train.log_every == 0 or self.step == train.steps:
                    record = window.record(self.step, loss, self.train_s, self.pipeline.depth, self.data.stats(),
                                           experiment.replicas is not None)
                    hit_rate = experiment.hit_rate()
                    if hit_rate is not None:
                        record["hit_rate"] = hit_rate
                    self._bar.set_postfix(samples_s=f"{record['samples_per_s']:,.0f}", loss=f"{float(loss):.4f}",
                                          hit=f"{hit_rate:.1%}" if hit_rate is not None else "-")
                if self.step % self.config.eval.every == 0 or self.step == train.steps:
                    self.evaluation = experiment.evaluate(self.step)
                    record.update(step=self.step, **{f"eval_{k}": v for k, v in self.evaluation.items()})
                if record:
                    self._log(metrics, record)
                if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                    experiment.save(self.step)
                self._bar.update(1)

    def _log(self, metrics: Any, record: Dict[str, Any]) -> None:
        _append_line(metrics, self.metrics_path, json.dumps(record))
        if self._board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._board.add_scalar(key, value, self.step)

    def close(self) -> None:
        self._bar.close()
        if self._board is not None:
            self._board.close()


def _summary(experiment: Experiment, config: ExperimentConfig, training: _Training, populate_s: float
             ) -> Dict[str, Any]:
    """The run's summary (written to summary.json by rank 0), once training has ended; closes the tables."""
    step, start_step, evaluation = training.step, training.start_step, training.evaluation
    elapsed = time.perf_counter() - training.started
    sent = training.traffic.all_ranks(_runner_group_if_any())
    served = training.replica_lookups.all_ranks()
    experiment.collection.flush()
    # Each rank's rows read from its stores a step (evaluations' reads included): where row-wise
    # tables spread what one rank would read.
    reads = experiment.store_reads() - training.reads_at_start
    reads_per_step = [r / max(1, step - start_step)
                      for r in (all_gather_objects(reads) if experiment.distributed else [reads])]
    # The distinct rows a step's batches missed in the caches (what the planner predicts); a miss
    # the store serves from its in-memory log reads nothing from disk.
    misses = experiment.cache_misses() - training.misses_at_start
    misses_per_step = [m / max(1, step - start_step)
                       for m in (all_gather_objects(misses) if experiment.distributed else [misses])]
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
    samples, steps = training.samples, max(1, step - start_step)
    batches = experiment.batches_at(step)
    # This run's figures from `start_step` (0, or the checkpoint it resumed: a TorchElastic restart's
    # attempt too); `job` counts what trained the model over every run and world that led to it.
    summary = {"steps": step, "start_step": start_step, "samples": samples, "world_size": experiment.world_size,
               "job": {"batches": batches, "samples": batches * config.train.batch_size}, "device": config.device,
               "seconds": elapsed, "samples_per_s": samples / max(elapsed, 1e-9),
               "auc": evaluation.get("auc"), "logloss": evaluation.get("logloss"),
               "oracle_auc": evaluation.get("oracle_auc"),
               "hit_rate": experiment.hit_rate(), "lookahead_depth": training.pipeline.depth,
               "replica_hit_rate": _share(served, (0, 0)) if experiment.replicas is not None else None,
               # All ranks together, a training step's mean: what DMP's all-to-alls sent between ranks.
               "embedding_bytes_per_step": sum(sent.values()) / steps,
               "embedding_bytes_per_step_by_kind": {k: v / steps for k, v in sent.items()},
               "peak_rss_bytes": _peak_rss_bytes(),
               "disk_bytes": _disk_bytes(experiment.tables_path),
               "store_reads_per_step_by_rank": reads_per_step,
               "cache_misses_per_step_by_rank": misses_per_step, "live_ids": live_ids, "evicted_ids": evicted_ids,
               "peak_live_ids": peak_live_ids,
               "storage": config.storage.kind, "populate_s": populate_s,
               "torch_threads": torch.get_num_threads(),
               **_input_summary(training.data.stats(), training.train_s, step - start_step)}
    if experiment.is_main:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        short = summary["input"]
        if short["workers_needed"] > short["cpu_budget"] and summary["input_wait_share"] > 0.01:
            print(_too_few_input_workers(config, short["workers_needed"], short["cpu_budget"],
                                         summary["input_wait_share"]), file=sys.stderr, flush=True)
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
        dist.all_reduce(counts, group=runner_group())
        return int(counts[0]), int(counts[1])


def _runner_group_if_any() -> Optional[dist.ProcessGroup]:
    """The runner's group where a process group is up (`run` holds one), else None."""
    return runner_group() if dist.is_available() and dist.is_initialized() else None


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
