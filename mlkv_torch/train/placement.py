"""Where a run trains and over which process groups its ranks talk, chosen once for the run.

Under torchrun with `device: cuda` each rank trains on `cuda:LOCAL_RANK`, and the default process
group is NCCL: DistributedModelParallel's all-to-alls and the dense model's DDP all-reduces carry
GPU tensors. NCCL refuses CPU tensors, and the runner's own collectives carry them (statistics,
barriers, rows moved between nodes' disks on a reshard), so they go over a gloo group of the
runner's own (`runner_group`). On the CPU both groups are gloo: the suite runs the same path.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError

__all__ = ["RUNNER_BACKEND", "Placement", "choose_placement", "this_process_placement", "join_process_group",
           "make_runner_group", "runner_group_held", "runner_group", "forget_runner_group"]

RUNNER_BACKEND = "gloo"  # the runner's own collectives carry CPU tensors

_runner_group: Optional[dist.ProcessGroup] = None


@dataclass(frozen=True)
class Placement:
    """This process's device, and the backend of the default process group (the model's)."""

    device: torch.device
    backend: str


def choose_placement(device: str, distributed: bool, local_rank: int, local_world: int, gpus: int) -> Placement:
    """The placement of a process that is rank `local_rank` of `local_world` on its node, on a
    node with `gpus` GPUs, for the config's `device`. ConfigError for a config that cannot work
    here (a GPU asked for where there is none, more ranks on a node than its GPUs)."""
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo")
    if gpus == 0:
        raise ConfigError("device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    if not distributed:
        return Placement(torch.device("cuda"), "gloo")
    if local_world > gpus:
        raise ConfigError(f"device cuda: {local_world} ranks on this node (torchrun --nproc_per_node) and {gpus} "
                          f"GPU{'s' if gpus > 1 else ''} here: each rank trains on a GPU of its own (NCCL refuses "
                          f"two ranks on one); start at most {gpus} a node")
    return Placement(torch.device("cuda", local_rank), "nccl")


def this_process_placement(device: str, distributed: bool) -> Placement:
    """`choose_placement` for this process, from torchrun's environment and the GPUs torch sees."""
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    return choose_placement(device, distributed, int(os.environ.get("LOCAL_RANK", "0")),
                            int(os.environ.get("LOCAL_WORLD_SIZE", "1")), gpus)


def join_process_group(placement: Placement) -> None:
    """init_process_group for a worker that torchrun started, on `placement`'s backend and device,
    in a store of its attempt's own.

    TorchElastic's agent keeps one store for the whole job, and an attempt's ranks would read the
    addresses the ranks of the attempt it restarts left there (and fail to connect): each attempt
    (TORCHELASTIC_RESTART_COUNT) keys its process group under a prefix of its own. A node that
    joins again counts its attempts from 0, so a job whose nodes come and go (`--nnodes MIN:MAX`)
    runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 then hosts a store of each attempt's
    own, and no prefix is needed.
    """
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # another launcher: its own rendezvous
        dist.init_process_group(placement.backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun's agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0)
    if agent_store:  # else rank 0 hosts a store of this attempt's own
        store = dist.PrefixStore(f"mlkv/attempt{attempt}/", store)
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world)


def make_runner_group() -> None:
    """Makes the runner's gloo group over every rank of the default group (every rank together)."""
    global _runner_group
    _runner_group = dist.new_group(backend=RUNNER_BACKEND)


@contextlib.contextmanager
def runner_group_held() -> Iterator[None]:
    """The runner's group within the block where the default group is up: made on entry where none
    is (every rank together: a user's own process group), dropped on exit if made here."""
    made = dist.is_available() and dist.is_initialized() and _runner_group is None
    if made:
        make_runner_group()
    try:
        yield
    finally:
        if made:
            forget_runner_group()


def runner_group() -> dist.ProcessGroup:
    """The group the runner's collectives go over (`make_runner_group`)."""
    if _runner_group is None:
        raise RuntimeError("the runner's process group is made after the default one (make_runner_group, "
                           "or mlkv_torch.train.run)")
    return _runner_group


def forget_runner_group() -> None:
    """Drops the runner's group (destroy_process_group destroys it with the default one)."""
    global _runner_group
    _runner_group = None
