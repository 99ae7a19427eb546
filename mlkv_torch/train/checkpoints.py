"""The runner's checkpoint files: written whole or not at all, loaded without running code, and a
rank's part of a sharded state copied out and back in; the step boundaries that a checkpoint's
writing spreads its work over."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import re
import threading
from typing import Any, Iterator, Optional

import torch

from ..config import ConfigError
from ..cut import sync_directory

ONE_PROCESS_CHECKPOINT = "checkpoint.pt"  # in output_dir
SHARDED_CHECKPOINT_POINTER = "checkpoint.latest"  # in output_dir under torchrun: names the latest directory
# Under torchrun, what checkpoint.latest may name: checkpoint-<step>, or checkpoint-<step>-world<ranks> where
# a reshard checkpoints at the step of the checkpoint it read (which keeps its directory until then).
CHECKPOINT_DIRECTORY = re.compile(r"checkpoint-([0-9]+)(-world[0-9]+)?")
# In checkpoint.pt's state and checkpoint.latest: each table's rows, columns, weight type, optimizer and
# placement (Experiment.table_manifest), which reading the checkpoint without the run's config needs.
TABLES_KEY = "tables"
# Beside it: the directory under the tables path that holds the checkpoint's disk tables ("": the path
# itself; a reshard fills a directory of its own, `reshard.generation`).
GENERATION_KEY = "generation"
# Beside them: how many batches the job has trained by the checkpoint's step, whatever worlds trained
# them (each step trains one batch a rank): a run on another world goes on from the next batch.
BATCHES_KEY = "batches"


class StepBoundaries:
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


def check_resumable(output_dir: str, checkpoint_every: Optional[int]) -> None:
    """ConfigError saying so when `output_dir` holds no checkpoint to resume (of any world: one
    of another number of processes is resharded)."""
    if any(os.path.exists(os.path.join(output_dir, name)) for name in (ONE_PROCESS_CHECKPOINT,
                                                                       SHARDED_CHECKPOINT_POINTER)):
        return
    every = ("train.checkpoint_every is not set" if checkpoint_every is None
             else f"one every train.checkpoint_every={checkpoint_every} steps")
    raise ConfigError(f"--resume: output_dir {output_dir!r} holds no checkpoint to continue from ({every}); "
                      f"start over with --overwrite")


def load_checkpoint(path: str) -> Any:
    """A checkpoint file's state, loaded with torch's weights-only unpickler (tensors and plain values:
    a file that holds anything else could run code as it loads, so it is refused)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0]
        raise ConfigError(f"{path} holds objects other than tensors and plain values, which could run code as "
                          f"they load: refusing to load it ({reason})") from e


def drop_records_after(metrics_path: str, step: int) -> None:
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


def save_whole(state: Any, path: str) -> None:
    """torch.save of `state` to `path`, whole or not at all (a crash leaves what was there), durably."""
    partial = path + ".partial"
    torch.save(state, partial)
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)
    sync_directory(os.path.dirname(path) or ".")


def local_copy(state: Any) -> Any:
    """This rank's part of a state_dict, copied to the CPU (later steps cannot change it, and any
    device of any world reads it back), as plain objects: a ShardedTensor becomes
    {"local_shards": [(offsets, tensor)]}."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(state, ShardedTensor):
        return {"local_shards": [(list(shard.metadata.shard_offsets), shard.tensor.detach().to("cpu", copy=True))
                                 for shard in state.local_shards()]}
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: local_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_copy(v) for v in state)
    return copy.deepcopy(state)


def restored(target: Any, saved: Any, where: str = "") -> Any:
    """`target` (a state_dict of this rank) with the values of `saved` (`local_copy` of one): each
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
        return {k: restored(v, saved[k], f"{where}.{k}" if where else str(k)) for k, v in target.items()}
    if isinstance(target, (list, tuple)) and isinstance(saved, (list, tuple)) and len(target) == len(saved):
        return type(target)(restored(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(target, saved)))
    return saved
