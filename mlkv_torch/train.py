"""Trains and evaluates DLRM from a YAML experiment.

    python -m mlkv_torch.train CONFIG [dotted.key=value ...] [--resume]
    torchrun --nproc_per_node N -m mlkv_torch.train CONFIG ...   # DistributedModelParallel, gloo on CPU

Writes to ``output_dir``: ``metrics.jsonl`` (a line every ``train.log_every`` steps and at
each evaluation), ``summary.json`` at the end (samples_per_s, auc, logloss, steps,
peak_rss_bytes, disk_bytes, ...), and checkpoints every ``train.checkpoint_every`` steps
(``--resume`` continues from the latest). A progress bar shows samples/s, loss and the disk
tables' hit rate.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import pickle
import re
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import optim as optim_lib
from .config import ConfigError, ExperimentConfig, load_config
from .cut import PendingCut, read_json_record, sync_directory, write_json_record
from .data.sources import batch_source, loader_tuner
from .memory_budget import MemoryBudgetError
from .ranks import all_gather_objects

__all__ = ["main", "run"]

_OPTIMIZERS = {"sgd": optim_lib.SGD, "adagrad": optim_lib.Adagrad, "rowwise_adagrad": optim_lib.RowWiseAdagrad,
               "adam": optim_lib.Adam}
_BACKENDS = {"disk": "mlkv", "rocksdb": "rocksdb"}  # storage kind -> DiskEmbeddingBag backend
_PLANNER_RESERVED = 0.15  # DiskAwarePlanner's default storage reservation
_PLANNER_HEADROOM = 8 << 20  # what it reserves per rank for the dense model and input buffers
_CHECKPOINT_DIRECTORY = re.compile(r"checkpoint-[0-9]+")  # under torchrun, what checkpoint.latest may name
RUNNER_BACKEND = "gloo"  # the runner trains on the CPU, on a CUDA host too: its collectives carry CPU tensors


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
    """The model, data and optimizers of one run; `resume` reopens the tables an earlier run left."""

    def __init__(self, config: ExperimentConfig, resume: bool = False) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.config = config
        self.source = batch_source(config)
        tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=config.model.embedding_dim, num_embeddings=n,
                                     feature_names=[name])
                  for name, n in zip(self.source.feature_names, self.source.cardinalities)]
        torch.manual_seed(config.train.seed)
        self.rule = _OPTIMIZERS[config.train.optimizer](lr=config.train.lr)
        self.tables_path = config.storage.path or os.path.join(config.output_dir, "tables")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.resume = resume
        self._saving: Optional[threading.Thread] = None  # the checkpoint being written
        self.boundaries = _StepBoundaries()  # the training loop marks each; the checkpoint's work follows them
        self._save_error: Optional[BaseException] = None
        # One process resumes from a cut: the checkpoint names the one its tables reopen at.
        self._resumed: Optional[Dict[str, Any]] = None
        if resume and not self.distributed and os.path.exists(self.checkpoint_path()):
            self._resumed = _load_checkpoint(self.checkpoint_path())
            if "cut" not in self._resumed:
                raise ConfigError(f"{self.checkpoint_path()} was written by an earlier mlkv_torch (it holds every "
                                  f"row, not a cut of the tables); resume it with that version")
        try:
            if self.distributed:
                self._build_sharded(tables)
            else:
                self._build_local(tables)
        except MemoryBudgetError as e:
            raise ConfigError(f"storage.memory_budget_bytes: {e}") from e

    def _dlrm(self, collection: torch.nn.Module) -> torch.nn.Module:
        from torchrec.models.dlrm import DLRM, DLRMTrain

        model = self.config.model
        return DLRMTrain(DLRM(embedding_bag_collection=collection, dense_in_features=self.source.num_dense,
                              dense_arch_layer_sizes=model.dense_arch, over_arch_layer_sizes=model.over_arch,
                              dense_device=torch.device("cpu")))

    def _build_local(self, tables) -> None:
        """One process, disk storage: DiskEmbeddingBagCollection (so the pipeline can look ahead)."""
        from .torchrec import DiskEmbeddingBagCollection

        config, storage = self.config, self.config.storage
        self.collection = DiskEmbeddingBagCollection(
            tables, path=self.tables_path, optimizer=self.rule, memory_budget_bytes=storage.memory_budget_bytes,
            cache_rows=storage.cache_rows, staleness=storage.staleness, seed=config.train.seed,
            cache_policy=storage.cache_policy, backend=_BACKENDS[storage.kind], reopen=self.resume,
            cut=self._resumed["cut"] if self._resumed else None)
        self.model = self._dlrm(self.collection)
        dense = [p for name, p in self.model.named_parameters() if "embedding_bag" not in name]
        self.optimizer = torch.optim.Adagrad(dense, lr=config.train.dense_lr or config.train.lr)

    def _build_sharded(self, tables) -> None:
        """Under torchrun: DistributedModelParallel; DiskAwarePlanner puts on disk the tables that do not
        fit `memory_budget_bytes` per rank (storage kind memory: none)."""
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner.types import Topology
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from .torchrec import DiskAwarePlanner, DiskEmbeddingBagCollectionSharder

        config, storage = self.config, self.config.storage
        model = self._dlrm(EmbeddingBagCollection(tables, device=torch.device("meta")))
        sharder = DiskEmbeddingBagCollectionSharder(
            self.tables_path, optimizer=self.rule, memory_fraction=storage.memory_fraction,
            staleness=storage.staleness, cache_policy=storage.cache_policy, seed=config.train.seed,
            backend=_BACKENDS.get(storage.kind, "mlkv"), reopen=self.resume,  # memory: nothing on disk
            cuts=self._latest_sharded()[1] if self.resume and os.path.exists(self.checkpoint_path()) else None)
        # The planner's cap also covers what it reserves for the dense model and inputs.
        ddr_cap = (storage.memory_budget_bytes + _PLANNER_HEADROOM) / (1 - _PLANNER_RESERVED) \
            if storage.kind != "memory" else 1 << 40
        topology = Topology(world_size=dist.get_world_size(), compute_device="cpu", ddr_cap=int(ddr_cap),
                            ssd_cap=1 << 42)
        planner = DiskAwarePlanner(topology=topology, batch_size=config.train.batch_size, debug=False)
        plan = planner.collective_plan(model, [sharder])
        self.model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
        self.collection = self.model.module.model.sparse_arch.embedding_bag_collection
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(self.model.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params,
                                                                         lr=config.train.dense_lr or config.train.lr))
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense])

    def populate(self) -> int:
        """Writes every row of this rank's disk tables to their stores (storage.populate); returns the rows."""
        return self.collection.populate()  # both collections the runner builds have it

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return not self.distributed or dist.get_rank() == 0

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    def loader(self, first_step: int, steps: int) -> Any:
        """A BatchLoader of this rank's batches of steps [first_step, first_step + steps): step s
        trains batch number s * world_size + rank on each rank."""
        from .data.loader import BatchLoader

        world = self.world_size
        return BatchLoader(self.source.make_batch, first=first_step * world + self.rank, count=steps, stride=world,
                           tuner=loader_tuner(self.config, torch_threads(self.config)))

    def hit_rate(self) -> Optional[float]:
        stats = self.collection.stats().values()
        hits = sum(s["cache_hits"] for s in stats)
        looked_up = hits + sum(s["cache_misses"] for s in stats)
        return hits / looked_up if looked_up else None

    def evaluate(self) -> Dict[str, float]:
        """AUC and log loss on held-out batches and, for synthetic data, the AUC of the planted
        model's true probabilities on the same batches (what a perfect model would reach there)."""
        from torchmetrics.classification import BinaryAUROC

        auroc, oracle = BinaryAUROC(), BinaryAUROC()
        loss_sum, count = 0.0, 0
        self.model.eval()
        planted = False
        with torch.no_grad():
            for batch, probabilities in self.source.eval(self.config.eval.batches, self.rank, self.world_size):
                loss, (_, logits, labels) = self.model(batch)
                auroc.update(torch.sigmoid(logits), labels.int())
                if probabilities is not None:
                    oracle.update(probabilities, labels.int())
                    planted = True
                loss_sum += float(loss) * labels.numel()
                count += labels.numel()
        self.model.train()
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
        if self.distributed:  # AUROC gathers its inputs across ranks itself; this runs just before exit
            totals = torch.tensor(all_gather_objects([loss_sum, float(count)]), dtype=torch.float64).sum(dim=0)
        if totals[1] == 0:
            return {}
        result = {"auc": float(auroc.compute()), "logloss": float(totals[0] / totals[1])}
        if planted:
            result["oracle_auc"] = float(oracle.compute())
        return result

    def checkpoint_path(self) -> str:
        """A file in one process; under torchrun, the pointer to the latest checkpoint directory."""
        return os.path.join(self.config.output_dir, "checkpoint.pt" if not self.distributed else "checkpoint.latest")

    def save(self, step: int) -> None:
        """Checkpoints at this step boundary: one cut of the tables (their stores keep the previous
        one until the checkpoint names the new), the dense model's and its optimizer's, and the
        data position (the step), committed at once by one rename. The tables' cut is written in
        the background while training goes on (`finish_save` waits for it); a checkpoint begun
        while one is being written waits for it first. Under torchrun, every rank cuts its own
        tables and writes the rest of its state (`_save_sharded`)."""
        self.finish_save()
        commit = self._save_sharded(step) if self.distributed else self._save_local(step)

        def commit_or_keep_error() -> None:
            try:
                commit()
            except BaseException as e:  # raised on the training thread by finish_save
                self._save_error = e
        self._saving = threading.Thread(target=commit_or_keep_error, name="mlkv-checkpoint", daemon=True)
        self._saving.start()

    def _save_local(self, step: int) -> Callable[[], None]:
        """One process: begins the cut, takes the dense state; returns what commits both."""
        # Its stores are told it is committed once checkpoint.pt names it (`commit` below).
        pending = self.collection.begin_checkpoint(label=step).defer_commit()
        state = {"step": step, "dense": self._dense_state(),
                 "dense_optimizer": _local_copy(self.optimizer.state_dict())}  # later steps change it in place

        def commit() -> None:
            # The previous checkpoint stays whole until this one is.
            self._write_over_steps(pending, state, "cut", self.checkpoint_path())
            # Only now may the stores let the previous cut go (a close after a failed step, before
            # this file was written, keeps the cut the previous file names).
            pending.commit()
        return commit

    def _write_over_steps(self, pending: Optional[PendingCut], state: Dict[str, Any], cut_key: Optional[str],
                          path: str) -> Optional[Dict[str, Any]]:
        """A checkpoint's background work, one piece a step: the cut's rows go to the stores in the
        step after the boundary, their syncs (`pending.wait`) follow the next boundary, and `state`
        (with the cut's record under `cut_key`, when given) goes to `path` after the one after that;
        no step pays for two of them. Returns the cut's record (None without disk tables)."""
        self.boundaries.wait_next()
        cut = pending.wait() if pending is not None else None
        if cut_key is not None:
            state[cut_key] = cut
        self.boundaries.wait_next()
        _save_whole(state, path)
        return cut

    def finish_save(self) -> None:
        """Waits for the checkpoint being written (`save`); raises what failed writing it."""
        saving, self._saving = self._saving, None
        if saving is None:
            return
        with self.boundaries.released():  # it need not wait for steps any more
            saving.join()
        error, self._save_error = self._save_error, None
        if error is not None:
            raise error

    def _dense_state(self) -> Dict[str, torch.Tensor]:
        """The model's parameters and buffers outside the disk tables (theirs are in the cut)."""
        tables, state = self._tables_prefix(), {}
        for module_name, module in self.model.named_modules():
            prefix = module_name + "." if module_name else ""
            if prefix.startswith(tables):
                continue
            for name, tensor in itertools.chain(module.named_parameters(recurse=False), (
                    (n, b) for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set)):
                state[prefix + name] = tensor.detach().clone()
        return state

    def _tables_prefix(self) -> str:
        return next(name for name, module in self.model.named_modules() if module is self.collection) + "."

    def _save_sharded(self, step: int) -> Callable[[], None]:
        """Under torchrun: every rank begins a cut of its disk tables (no row copied) and copies the
        rest of its state (dense model, its shards of in-memory tables, optimizers). Returns what
        commits them, in the background: each rank writes its state to checkpoint-<step>/rank<r>.pt
        and, once its cut is written, records it there (cut-rank<r>.json); rank 0, once every rank
        has, renames the pointer, which names the directory and every rank's cut. Like the cuts of
        the disk tables, a rank's file belongs to its place in the plan: resume with the same
        number of processes and plan."""
        from .torchrec import disk_tables_left_out

        directory = os.path.join(self.config.output_dir, f"checkpoint-{step}")
        # Storage kind memory has no disk tables: every row goes to the directory.
        pending = self.collection.begin_checkpoint(label=step) if hasattr(self.collection, "disk_kernels") else None
        if pending is not None:
            pending.defer_commit()  # committed once the rank's own record names it (`commit` below)
        with disk_tables_left_out():  # copied now, written in the background
            state = _local_copy({"model": self.model.state_dict(), "optim": self._optimizer_state_without_disk_tables(),
                                 "step": step, "world_size": self.world_size})
        rank, world, main = self.rank, self.world_size, self.is_main

        def commit() -> None:
            import shutil

            # Files, not collectives: this runs beside training, which uses the process group.
            os.makedirs(directory, exist_ok=True)
            record = os.path.join(directory, f"cut-rank{rank}.json")
            try:  # a failure of the cut or of the file is recorded for rank 0
                cut = self._write_over_steps(pending, state, None, os.path.join(directory, f"rank{rank}.pt"))
            except BaseException as e:  # rank 0 must not wait for it
                write_json_record(record, {"error": f"{type(e).__name__}: {e}"})
                raise
            write_json_record(record, {"cut": cut})
            if pending is not None:
                pending.commit()  # after the rank's own record (see _save_local)
            if not main:
                return
            records = [os.path.join(directory, f"cut-rank{r}.json") for r in range(world)]
            while not all(os.path.exists(r) for r in records):
                time.sleep(0.01)
            written = [read_json_record(path, f"rank {r}'s cut") for r, path in enumerate(records)]
            failed = [f"rank {r}: {w['error']}" for r, w in enumerate(written) if "error" in w]
            if failed:
                raise OSError(f"checkpoint {directory} is not committed: {'; '.join(failed)}")
            cuts = {str(r): w["cut"] for r, w in enumerate(written)}
            previous = self._latest_sharded()[0] if os.path.exists(self.checkpoint_path()) else None
            write_json_record(self.checkpoint_path(), {"directory": os.path.basename(directory), "cuts": cuts})
            if previous and previous != directory:
                shutil.rmtree(previous, ignore_errors=True)
        return commit

    def _optimizer_state_without_disk_tables(self) -> Dict[str, Any]:
        """The optimizers' state_dict without the disk tables' entries (their state is in the cuts;
        what would stand for them differs from rank to rank, which torch.distributed.checkpoint
        cannot match up on load)."""
        state = self.optimizer.state_dict()
        on_disk = tuple(f"embedding_bags.{t}.weight" for t in getattr(self.collection, "_disk_table_names", []))
        state["state"] = {k: v for k, v in state["state"].items() if not (on_disk and k.endswith(on_disk))}
        return state

    def _latest_sharded(self) -> Tuple[str, Dict[int, Any]]:
        """The directory the latest checkpoint under torchrun wrote, and each rank's cut of its tables."""
        try:
            with open(self.checkpoint_path()) as f:
                pointer = json.load(f)
            directory, cuts = pointer["directory"], pointer["cuts"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{self.checkpoint_path()} was written by an earlier mlkv_torch (it points at a copy "
                              f"of every row, not at cuts of the tables); resume it with that version") from e
        # The pointer names the directory that a later checkpoint removes: only one of ours.
        if not isinstance(directory, str) or not _CHECKPOINT_DIRECTORY.fullmatch(directory):
            raise ConfigError(f"{self.checkpoint_path()} names directory {directory!r}, not a checkpoint-<step> "
                              f"directory of this run: refusing to use it")
        return (os.path.join(self.config.output_dir, directory),
                {int(rank): cut for rank, cut in cuts.items() if cut is not None})

    def load(self) -> int:
        if self.distributed:
            from .torchrec import disk_tables_left_out

            saved = _load_checkpoint(os.path.join(self._latest_sharded()[0], f"rank{self.rank}.pt"))
            if saved["world_size"] != self.world_size:
                raise ConfigError(f"{self.checkpoint_path()} was written by {saved['world_size']} processes: resume "
                                  f"it with as many (each one's tables and state belong to its place in the plan)")
            with disk_tables_left_out():  # the disk tables reopened at the checkpoint's cuts
                try:
                    state = _restored({"model": self.model.state_dict(),
                                       "optim": self._optimizer_state_without_disk_tables(), "step": 0,
                                       "world_size": self.world_size}, saved)
                except ConfigError as e:
                    raise ConfigError(f"{e} (a rank's state belongs to its place in the sharding plan, which the "
                                      f"storage settings decide: resume with the ones the run was started with)") from e
                self.model.load_state_dict(state["model"])
                optimizer = self.optimizer.state_dict()  # the disk tables' entries: their steps, as reopened
                optimizer["state"].update(state["optim"]["state"])
                if "param_groups" in state["optim"]:
                    optimizer["param_groups"] = state["optim"]["param_groups"]
                self.optimizer.load_state_dict(optimizer)
            return int(state["step"])
        state = self._resumed  # the tables were opened at its cut
        missing, unexpected = self.model.load_state_dict(state["dense"], strict=False)
        missing = [k for k in missing if not k.startswith(self._tables_prefix())]
        if missing or unexpected:
            raise ConfigError(f"{self.checkpoint_path()} does not fit this model: missing {missing}, "
                              f"unexpected {unexpected}")
        self.optimizer.load_state_dict(state["dense_optimizer"])
        return int(state["step"])


class _StepBoundaries:
    """The step boundaries the training loop passes (`passed`), for work beside training to spread
    over steps: `wait_next` returns at the next boundary, or at once while `released` (the run
    ends, or training waits for that work)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._passed = 0
        self._released = 0

    def passed(self) -> None:
        with self._changed:
            self._passed += 1
            self._changed.notify_all()

    def wait_next(self) -> None:
        with self._changed:
            seen = self._passed
            self._changed.wait_for(lambda: self._passed > seen or self._released > 0)

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        with self._changed:
            self._released += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._released -= 1


def _load_checkpoint(path: str) -> Any:
    """A checkpoint file's state, loaded with torch's weights-only unpickler (tensors and plain values:
    a file that holds anything else could run code as it loads, so it is refused)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0]
        raise ConfigError(f"{path} holds objects other than tensors and plain values, which could run code as "
                          f"they load: refusing to load it ({reason})") from e


def _drop_records_after(metrics_path: str, step: int) -> None:
    """Keeps the records of metrics.jsonl up to `step` (and lines that name no step), replacing the file whole."""
    with open(metrics_path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if not isinstance(record, dict) or record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        partial = metrics_path + ".partial"
        with open(partial, "w") as f:
            f.writelines(kept)
        os.replace(partial, metrics_path)


def _save_whole(state: Any, path: str) -> None:
    """torch.save of `state` to `path`, whole or not at all (a crash leaves what was there), durably."""
    partial = path + ".partial"
    torch.save(state, partial)
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)
    sync_directory(os.path.dirname(path) or ".")


def _local_copy(state: Any) -> Any:
    """This rank's part of a state_dict, copied (later steps cannot change it), as plain objects: a
    ShardedTensor becomes {"local_shards": [(offsets, tensor)]}."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(state, ShardedTensor):
        return {"local_shards": [(list(shard.metadata.shard_offsets), shard.tensor.detach().clone())
                                 for shard in state.local_shards()]}
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _local_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local_copy(v) for v in state)
    return copy.deepcopy(state)


def _restored(target: Any, saved: Any, where: str = "") -> Any:
    """`target` (a state_dict of this rank) with the values of `saved` (`_local_copy` of one): each
    ShardedTensor's local shards are filled in place, tensors and other values replaced.
    ConfigError names a part of the state that does not match."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def mismatch(what: str) -> ConfigError:
        return ConfigError(f"the checkpoint does not fit this model at {where or 'the top'}: {what}")

    if isinstance(target, ShardedTensor):
        shards = {tuple(s.metadata.shard_offsets): s.tensor for s in target.local_shards()}
        saved_shards = {tuple(offsets): tensor for offsets, tensor in saved.get("local_shards", [])} \
            if isinstance(saved, dict) else {}
        if set(shards) != set(saved_shards):
            raise mismatch(f"local shards at {sorted(shards)}, saved at {sorted(saved_shards)}")
        for offsets, tensor in shards.items():
            tensor.copy_(saved_shards[offsets])
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict):
            raise mismatch(f"keys {sorted(map(str, target))}, saved {saved!r}")
        if set(target) != set(saved):
            lacking, extra = sorted(map(str, set(target) - set(saved))), sorted(map(str, set(saved) - set(target)))
            raise mismatch(f"the checkpoint lacks {lacking}" * bool(lacking) + "; " * bool(lacking and extra) +
                           f"the checkpoint has {extra}, which this model does not" * bool(extra))
        return {k: _restored(v, saved[k], f"{where}.{k}" if where else str(k)) for k, v in target.items()}
    if isinstance(target, (list, tuple)) and isinstance(saved, (list, tuple)) and len(target) == len(saved):
        return type(target)(_restored(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(target, saved)))
    return saved


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


def torch_threads(config: ExperimentConfig) -> int:
    """torch's intra-op threads for a run: `train.torch_threads`, or with "auto" torch's default less
    one when disk tables look ahead, so the prefetch thread has a core (measured on 2 cores:
    DLRM over populated disk tables at depth 1 trains 1.4x faster with 1 torch thread than with 2)."""
    if config.train.torch_threads != "auto":
        return config.train.torch_threads
    threads = torch.get_num_threads()
    return max(1, threads - 1) if config.looks_ahead else threads


def _run(config: ExperimentConfig, resume: bool, progress: bool) -> Dict[str, Any]:
    from tqdm import tqdm

    from .pipeline import LookaheadPipeline

    try:
        os.makedirs(config.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir {config.output_dir!r} cannot be created: {e.strerror or e}") from e
    try:
        experiment = _Experiment(config, resume)
    except FileExistsError as e:  # an earlier run's tables: say first how the runner continues from them
        raise ConfigError(f"output_dir {config.output_dir!r} already holds an earlier run's tables: continue it with "
                          f"--resume, or choose another output_dir (or storage.path). In detail: {e}") from e
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
    pipeline = LookaheadPipeline(experiment.model, experiment.optimizer, depth=config.pipeline.depth)
    data = experiment.loader(start_step, train.steps - start_step)
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    evaluation: Dict[str, float] = {}
    started = time.perf_counter()
    samples = 0
    main = experiment.is_main  # under torchrun, rank 0 reports for all
    world = experiment.world_size
    if resume and main and os.path.exists(metrics_path):
        _drop_records_after(metrics_path, start_step)  # a killed run's steps past its checkpoint are trained again
    bar = tqdm(total=train.steps, initial=start_step, disable=not (progress and main), unit="step", dynamic_ncols=True)
    board = _tensorboard(config) if main else None
    train_s = 0.0  # in pipeline.progress: the training steps, their waits for input included
    try:
        with open(metrics_path if main else os.devnull, "a") as metrics:
            step = start_step
            window_start, window_samples, window_steps, window_wait_s = time.perf_counter(), 0, 0, 0.0
            while step < train.steps:
                began = time.perf_counter()
                try:
                    loss, _, labels = pipeline.progress(data)
                except StopIteration:
                    break
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
                    record.update(step=step, loss=float(loss), samples_per_s=rate, depth=pipeline.depth,
                                  input_wait_ms=(input_stats["wait_s"] - window_wait_s) * 1e3 / window_steps,
                                  input_workers=input_stats["workers"], input_prefetch=input_stats["prefetch"])
                    window_start, window_samples, window_steps, window_wait_s = now, 0, 0, input_stats["wait_s"]
                    hit_rate = experiment.hit_rate()
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
                    if board is not None:
                        for key, value in record.items():
                            if key != "step" and isinstance(value, (int, float)):
                                board.add_scalar(key, value, step)
                if train.checkpoint_every and step % train.checkpoint_every == 0:
                    experiment.save(step)
                bar.update(1)
    finally:
        data.close()  # its threads stop, also when a step fails
    bar.close()
    if board is not None:
        board.close()
    experiment.finish_save()
    elapsed = time.perf_counter() - started
    if hasattr(experiment.collection, "flush"):
        experiment.collection.flush()
    summary_path = os.path.join(config.output_dir, "summary.json")
    if step == start_step and start_step > 0:
        # Resumed from a checkpoint at the run's last step (killed after it): nothing was left to
        # train. A finished run's summary stays; otherwise the checkpointed model is evaluated.
        if os.path.exists(summary_path):
            experiment.collection.close()
            with open(summary_path) as f:
                return json.load(f)
        if not evaluation:
            evaluation = experiment.evaluate()
    summary = {"steps": step, "samples": samples, "world_size": world, "seconds": elapsed,
               "samples_per_s": samples / max(elapsed, 1e-9),
               "auc": evaluation.get("auc"), "logloss": evaluation.get("logloss"),
               "oracle_auc": evaluation.get("oracle_auc"),
               "hit_rate": experiment.hit_rate(), "lookahead_depth": pipeline.depth,
               "peak_rss_bytes": _peak_rss_bytes(),
               "disk_bytes": _disk_bytes(experiment.tables_path) if config.storage.kind != "memory" else 0,
               "storage": config.storage.kind, "populate_s": populate_s,
               "torch_threads": torch.get_num_threads(), **_input_summary(data.stats(), train_s, step - start_step)}
    if main:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
    experiment.collection.close()
    return summary


def _input_summary(stats: Dict[str, Any], train_s: float, steps: int) -> Dict[str, Any]:
    """The summary's input figures: the training steps' time (`train_s`, evaluations and the rest
    left out), the share of it spent waiting for a batch (DS-Analyzer's data stall), the wait per
    step, and what the loader chose."""
    return {"train_seconds": train_s, "input_wait_share": stats["wait_s"] / train_s if train_s > 0 else 0.0,
            "input_wait_ms": stats["wait_s"] * 1e3 / steps if steps else 0.0,
            "input": {k: stats[k] for k in ("workers", "prefetch", "buffer_bytes", "batch_bytes", "decisions")}}


def _tensorboard(config: ExperimentConfig) -> Any:
    """A SummaryWriter under output_dir/tensorboard when train.tensorboard is set, else None."""
    if not config.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise ConfigError(f"train.tensorboard needs the tensorboard package (pip install tensorboard): {e}") from e
    return SummaryWriter(os.path.join(config.output_dir, "tensorboard"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the experiment's YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=200")
    parser.add_argument("--resume", action="store_true", help="continue from output_dir's latest checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_intermixed_args(argv)  # overrides and options in any order
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun
    if distributed:
        # gloo even on a CUDA host: the runner keeps the model, the plan and the collectives on the
        # CPU (NCCL would refuse their CPU tensors).
        dist.init_process_group(RUNNER_BACKEND)
    try:
        summary = run(config, resume=args.resume, progress=not args.no_progress)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    if not distributed or int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
