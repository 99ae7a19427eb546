"""Bytes the embedding tables send between ranks, counted where they are sent.

TorchRec moves a sharded collection's data with `torch.distributed.all_to_all_single`: the ids of
the input distribution (lengths, values and their split sizes, integers), the pooled embeddings
of the output distribution (floating point, in the forward) and their gradients (floating point,
in the backward). `EmbeddingTraffic` wraps that function while it is counting and adds, per call,
the bytes this rank sends to the other ranks (its own split stays in memory), by kind:

- ``ids``: integer tensors;
- ``outputs``: floating-point tensors sent outside autograd's backward (the forward);
- ``gradients``: floating-point tensors sent while autograd runs a backward.

Per-sample weights (floating point, in the input distribution) count as outputs.

Replicas of hot rows (mlkv_torch.torchrec.replicas) say which share of those bytes is theirs
(`reattribute`) and add what they send another way (`count`):

- ``replica_pushes``: the gradients of replicated rows pushed to their owners;
- ``replica_refreshes``: the rows the owners send back to refresh replicas;
- ``replica_choice``: the candidates for the hot rows each rank offers when they are chosen.

A share is moved on the rank that knows it, which for refreshes is not the rank that sends them:
one rank's figure of a kind may be off, all ranks' sum (`all_ranks`) is exact.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

KINDS = ("ids", "outputs", "gradients", "replica_pushes", "replica_refreshes", "replica_choice")

_lock = threading.Lock()
_active: List["EmbeddingTraffic"] = []  # counters counting now
_original: Optional[Any] = None  # torch.distributed.all_to_all_single while wrapped


def _in_backward() -> bool:
    # TorchRec's all-to-alls are autograd Functions, whose forward runs with grad mode off too:
    # only the engine knows whether a backward is running (its graph task, -1 outside one).
    return torch._C._current_graph_task_id() != -1


def _kind_of(tensor: torch.Tensor) -> str:
    if not tensor.is_floating_point():
        return "ids"
    return "gradients" if _in_backward() else "outputs"


def _sent_bytes(input: torch.Tensor, input_split_sizes: Optional[List[int]], group: Any) -> int:
    """Bytes of `input` that all_to_all_single sends to ranks other than this one."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if input.dim() == 0 or input.shape[0] == 0 or world <= 1:
        return 0
    row_bytes = input.numel() // input.shape[0] * input.element_size()
    if input_split_sizes is None:  # equal splits
        return (input.shape[0] - input.shape[0] // world) * row_bytes
    return (sum(input_split_sizes) - input_split_sizes[rank]) * row_bytes


def _counting_all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                                input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    sent = _sent_bytes(input, list(input_split_sizes) if input_split_sizes is not None else None, group)
    kind = _kind_of(input)
    with _lock:
        for counter in _active:
            counter.bytes[kind] += sent
    return _original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def reattribute(sent_as: str, kind: str, nbytes: int) -> None:
    """Moves `nbytes` that the all-to-alls count as `sent_as` to `kind`, in every counter counting now."""
    with _lock:
        for counter in _active:
            counter.bytes[sent_as] -= nbytes
            counter.bytes[kind] += nbytes


def count(kind: str, nbytes: int) -> None:
    """Adds `nbytes` this rank sends outside all_to_all_single to `kind`, in every counter counting now."""
    with _lock:
        for counter in _active:
            counter.bytes[kind] += nbytes


class EmbeddingTraffic:
    """Counts what this rank sends through all_to_all_single while counting (`with`, or `start` and
    `stop`); several may count at once. `bytes` holds this rank's totals by kind."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = dict.fromkeys(KINDS, 0)

    def start(self) -> None:
        global _original
        with _lock:
            if self in _active:
                return
            if not _active:
                _original = dist.all_to_all_single
                dist.all_to_all_single = _counting_all_to_all_single
            _active.append(self)

    def stop(self) -> None:
        global _original
        with _lock:
            if self not in _active:
                return
            _active.remove(self)
            if not _active:
                dist.all_to_all_single = _original
                _original = None

    def __enter__(self) -> "EmbeddingTraffic":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def all_ranks(self) -> Dict[str, int]:
        """The totals by kind summed over the ranks: a collective (every rank calls it) when a
        process group of several ranks is up, else this rank's."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return dict(self.bytes)
        totals = torch.tensor([self.bytes[k] for k in KINDS], dtype=torch.int64)
        dist.all_reduce(totals)
        return dict(zip(KINDS, (int(x) for x in totals)))
