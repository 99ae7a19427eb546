"""Trains and evaluates DLRM from a YAML experiment.

    python -m mlkv_torch.train CONFIG [dotted.key=value ...] [--resume]

Writes to ``output_dir``: ``metrics.jsonl`` (a line every ``train.log_every`` steps and at
each evaluation), ``summary.json`` at the end (samples_per_s, auc, logloss, steps,
peak_rss_bytes, disk_bytes, ...), and checkpoints every ``train.checkpoint_every`` steps
(``--resume`` continues from the latest). A progress bar shows samples/s, loss and the disk
tables' hit rate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import optim as optim_lib
from .config import ConfigError, ExperimentConfig, cardinalities_of, load_config

__all__ = ["main", "run"]

_OPTIMIZERS = {"sgd": optim_lib.SGD, "adagrad": optim_lib.Adagrad, "rowwise_adagrad": optim_lib.RowWiseAdagrad,
               "adam": optim_lib.Adam}
_EVAL_FIRST_BATCH = 1 << 40  # evaluation batches come from a range training never reaches


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


class _Experiment:
    """The model, data and optimizers of one run."""

    def __init__(self, config: ExperimentConfig) -> None:
        from torchrec.models.dlrm import DLRM, DLRMTrain
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        from .data import SyntheticCTR
        from .torchrec import DiskEmbeddingBagCollection

        self.config = config
        data = config.data.synthetic
        self.generator = SyntheticCTR(cardinalities=cardinalities_of(data), num_dense=data.num_dense, zipf=data.zipf,
                                      seed=data.seed)
        tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=config.model.embedding_dim, num_embeddings=n,
                                     feature_names=[name])
                  for name, n in zip(self.generator.feature_names, self.generator.cardinalities)]
        torch.manual_seed(config.train.seed)
        rule = _OPTIMIZERS[config.train.optimizer](lr=config.train.lr)
        storage = config.storage
        self.tables_path = storage.path or os.path.join(config.output_dir, "tables")
        if storage.kind == "disk":
            self.collection = DiskEmbeddingBagCollection(
                tables, path=self.tables_path, optimizer=rule, memory_budget_bytes=storage.memory_budget_bytes,
                cache_rows=storage.cache_rows, staleness=storage.staleness, seed=config.train.seed,
                cache_policy=storage.cache_policy)
        else:
            from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

            self.collection = EmbeddingBagCollection(tables)
            from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

            torch_rule = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam,
                          "rowwise_adagrad": RowWiseAdagrad}[config.train.optimizer]
            apply_optimizer_in_backward(torch_rule, self.collection.parameters(), {"lr": config.train.lr})
        self.model = DLRMTrain(DLRM(embedding_bag_collection=self.collection, dense_in_features=data.num_dense,
                                    dense_arch_layer_sizes=config.model.dense_arch,
                                    over_arch_layer_sizes=config.model.over_arch))
        dense = [p for name, p in self.model.named_parameters()
                 if "embedding_bag" not in name and not hasattr(p, "_in_backward_optimizers")]
        self.optimizer = torch.optim.Adagrad(dense, lr=config.train.dense_lr or config.train.lr)

    def loader(self, first_batch: int, num_batches: int):
        from torch.utils.data import DataLoader

        from .data import SyntheticCTRDataset

        dataset = SyntheticCTRDataset(self.generator, self.config.train.batch_size, num_batches=num_batches,
                                      rank=0, world_size=1, first_batch=first_batch)
        workers = self.config.data.num_workers
        return iter(DataLoader(dataset, batch_size=None, num_workers=workers) if workers else dataset)

    def hit_rate(self) -> Optional[float]:
        if not hasattr(self.collection, "stats"):
            return None
        stats = self.collection.stats().values()
        hits = sum(s["cache_hits"] for s in stats)
        looked_up = hits + sum(s["cache_misses"] for s in stats)
        return hits / looked_up if looked_up else None

    def evaluate(self) -> Dict[str, float]:
        from torchmetrics.classification import BinaryAUROC

        auroc = BinaryAUROC()
        loss_sum, count = 0.0, 0
        self.model.eval()
        with torch.no_grad():
            for batch in self.loader(_EVAL_FIRST_BATCH, self.config.eval.batches):
                loss, (_, logits, labels) = self.model(batch)
                auroc.update(torch.sigmoid(logits), labels.int())
                loss_sum += float(loss) * labels.numel()
                count += labels.numel()
        self.model.train()
        return {"auc": float(auroc.compute()), "logloss": loss_sum / count}

    def checkpoint_path(self) -> str:
        return os.path.join(self.config.output_dir, "checkpoint.pt")

    def save(self, step: int) -> None:
        state = {"step": step, "model": self.model.state_dict(), "dense_optimizer": self.optimizer.state_dict()}
        if hasattr(self.collection, "embedding_bags"):
            state["table_optimizer_state"] = {
                name: bag.snapshot(include_state=True)[1] for name, bag in self.collection.embedding_bags.items()
                if hasattr(bag, "snapshot")}
            state["table_steps"] = {name: bag.steps for name, bag in self.collection.embedding_bags.items()
                                    if hasattr(bag, "steps")}
        partial = self.checkpoint_path() + ".partial"
        torch.save(state, partial)
        os.replace(partial, self.checkpoint_path())  # the previous checkpoint stays whole until this one is

    def load(self) -> int:
        state = torch.load(self.checkpoint_path(), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["dense_optimizer"])
        for name, table_state in state.get("table_optimizer_state", {}).items():
            bag = self.collection.embedding_bags[name]
            bag.restore(state=table_state)
            bag.steps = state["table_steps"][name]
        return int(state["step"])


def run(config: ExperimentConfig, resume: bool = False, progress: bool = True) -> Dict[str, Any]:
    """Runs one experiment; returns the summary (also written to output_dir/summary.json)."""
    from tqdm import tqdm

    from .pipeline import LookaheadPipeline

    os.makedirs(config.output_dir, exist_ok=True)
    experiment = _Experiment(config)
    start_step = 0
    if resume:
        if not os.path.exists(experiment.checkpoint_path()):
            raise ConfigError(f"--resume: no checkpoint at {experiment.checkpoint_path()}")
        start_step = experiment.load()
    train = config.train
    pipeline = LookaheadPipeline(experiment.model, experiment.optimizer, depth=config.pipeline.depth)
    data = experiment.loader(first_batch=start_step, num_batches=train.steps - start_step)
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    evaluation: Dict[str, float] = {}
    started = time.perf_counter()
    samples = 0
    bar = tqdm(total=train.steps, initial=start_step, disable=not progress, unit="step", dynamic_ncols=True)
    with open(metrics_path, "a") as metrics:
        step = start_step
        window_start, window_samples = time.perf_counter(), 0
        while step < train.steps:
            try:
                loss, _, labels = pipeline.progress(data)
            except StopIteration:
                break
            step += 1
            samples += labels.numel()
            window_samples += labels.numel()
            record: Dict[str, Any] = {}
            if step % train.log_every == 0 or step == train.steps:
                now = time.perf_counter()
                rate = window_samples / max(now - window_start, 1e-9)
                window_start, window_samples = now, 0
                hit_rate = experiment.hit_rate()
                record.update(step=step, loss=float(loss), samples_per_s=rate, depth=pipeline.depth)
                if hit_rate is not None:
                    record["hit_rate"] = hit_rate
                bar.set_postfix(samples_s=f"{rate:,.0f}", loss=f"{float(loss):.4f}",
                                hit=f"{hit_rate:.1%}" if hit_rate is not None else "-")
            if step % config.eval.every == 0 or step == train.steps:
                evaluation = experiment.evaluate()
                record.update(step=step, **{f"eval_{k}": v for k, v in evaluation.items()})
            if record:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if train.checkpoint_every and step % train.checkpoint_every == 0:
                experiment.save(step)
            bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - started
    if hasattr(experiment.collection, "flush"):
        experiment.collection.flush()
    summary = {"steps": step, "samples": samples, "seconds": elapsed, "samples_per_s": samples / max(elapsed, 1e-9),
               "auc": evaluation.get("auc"), "logloss": evaluation.get("logloss"),
               "oracle_auc": experiment.generator.oracle_auc(samples=16384),
               "hit_rate": experiment.hit_rate(), "lookahead_depth": pipeline.depth,
               "peak_rss_bytes": _peak_rss_bytes(),
               "disk_bytes": _disk_bytes(experiment.tables_path) if config.storage.kind == "disk" else 0,
               "storage": config.storage.kind}
    with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if hasattr(experiment.collection, "close"):
        experiment.collection.close()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the experiment's YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=200")
    parser.add_argument("--resume", action="store_true", help="continue from output_dir's latest checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        summary = run(config, resume=args.resume, progress=not args.no_progress)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
