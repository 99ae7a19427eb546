"""Bytes the embedding tables send between ranks, counted where they are sent.

TorchRec moves a sharded collection's data with `torch.distributed.all_to_all_single`: the ids of
the input distribution (lengths, values and their split sizes, integers), the pooled embeddings
of the output distribution (floating point, in the forward) and their gradients (floating point,
in the backward); row-wise shardings reduce-scatter the pooled partial sums instead and
all-gather their gradients. `EmbeddingTraffic` wraps those functions while it is counting and
adds, per call, the bytes this rank sends to the other ranks (its own part stays in memory), by
kind:

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

from .ranks import collective_device

KINDS = ("ids", "outputs", "gradients", "replica_pushes", "replica_refreshes", "replica_choice")

_lock = threading.Lock()
_active: List["EmbeddingTraffic"] = []  # counters counting now
_originals: Dict[str, Any] = {}  # the torch.distributed functions wrapped while counting, by name


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# For each collective TorchRec's shardings send embeddings with: the tensor sent, and the bytes of
# it this rank sends to the others (its own part stays). Row-wise shardings reduce-scatter the
# pooled partial sums in the forward and all-gather their gradients in the backward.
def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
    return input, _sent_bytes(input, list(input_split_sizes) if input_split_sizes is not None else None, group)


def _reduce_scatter_tensor(output, input, op=None, group=None, **_):
    return input, _nbytes(input) - _nbytes(output)


def _reduce_scatter(output, input_list, op=None, group=None, **_):
    return output, sum(_nbytes(t) for t in input_list) - _nbytes(input_list[dist.get_rank(group)])


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, **_):
    return input_tensor, _nbytes(input_tensor) * (dist.get_world_size(group) - 1)


def _all_gather(tensor_list, tensor, group=None, **_):
    return tensor, _nbytes(tensor) * (dist.get_world_size(group) - 1)


_SENT = {"all_to_all_single": _all_to_all_single, "reduce_scatter_tensor": _reduce_scatter_tensor,
         "reduce_scatter": _reduce_scatter, "all_gather_into_tensor": _all_gather_into_tensor,
         "all_gather": _all_gather}


def _counting(name: str) -> Any:
    def collective(*args: Any, **kwargs: Any) -> Any:
        sent, nbytes = _SENT[name](*args, **kwargs)
        kind = _kind_of(sent)
        with _lock:
            for counter in _active:
                counter.bytes[kind] += nbytes
            original = _originals[name]
        return original(*args, **kwargs)
    return collective


def reattribute(sent_as: str, kind: str, nbytes: int) -> None:
    """Moves `nbytes` that the all-to-alls count as `sent_as` to `kind`, in every counter counting now."""
    with _lock:
        for counter in _active:
            counter.bytes[sent_as] -= nbytes
            counter.bytes[kind] += nbytes


def count(kind: str, nbytes: int) -> None:
    """Adds `nbytes` this rank sends outside the counted collectives to `kind`, in every counter counting now."""
    with _lock:
        for counter in _active:
            counter.bytes[kind] += nbytes


class EmbeddingTraffic:
    """Counts what this rank sends through the collectives above while counting (`with`, or `start`
    and `stop`); several may count at once. `bytes` holds this rank's totals by kind."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = dict.fromkeys(KINDS, 0)

    def start(self) -> None:
        with _lock:
            if self in _active:
                return
            if not _active:
                for name in _SENT:
                    _originals[name] = getattr(dist, name)
                    setattr(dist, name, _counting(name))
            _active.append(self)

    def stop(self) -> None:
        with _lock:
            if self not in _active:
                return
            _active.remove(self)
            if not _active:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()

    def __enter__(self) -> "EmbeddingTraffic":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def all_ranks(self, group: Optional[dist.ProcessGroup] = None) -> Dict[str, int]:
        """The totals by kind summed over the ranks of `group` (None: the default group): a
        collective (every rank calls it) when a process group is up, else this rank's."""
        if not (dist.is_available() and dist.is_initialized()):
            return dict(self.bytes)
        totals = torch.tensor([self.bytes[k] for k in KINDS], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(totals, group=group)
        return dict(zip(KINDS, (int(x) for x in totals.cpu())))
