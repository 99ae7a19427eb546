"""LookaheadPipeline: trains on batch t while the disk rows of batches t+1..t+k are read.

The ids of future batches are known before they are needed (MLKV's Lookahead): the pipeline
keeps a window of the next k batches from the data loader and, as a batch enters the window,
asks every disk table of the model to start reading its rows (`lookahead`), so the reads
overlap the training of the batches before it. Lookahead never changes results: at
staleness 0 training equals the loop without the pipeline.

``depth="auto"`` picks k from the measured read-ahead latency and step time, k =
ceil(latency / step time) within [1, max_depth], and re-measures every few steps, so it
follows them when they change.

The model takes a batch and returns ``(loss, output)``, as torchrec's DLRMTrain does; the
batch has ``sparse_features`` (a KeyedJaggedTensor), as torchrec's Batch. Disk tables are
found in the model: every `DiskTableModule` (DiskEmbeddingBagCollection, DiskEmbeddingCollection:
one process; ShardedDiskEmbeddingBagCollection, ShardedDiskEmbeddingCollection: under
DistributedModelParallel).

Under DistributedModelParallel the ids of a batch reach the rank that holds their rows only
after TorchRec's input distribution, so the sharded collection's ``lookahead`` runs that
input distribution for the batch entering the window (an all-to-all of its ids, which its
forward runs again k steps later) and then starts the reads on each rank. It is a collective:
every rank runs the pipeline in lockstep (as DMP training itself requires: the same number of
batches on every rank), and with ``depth="auto"`` the ranks agree on k (the largest any rank
wants) at each re-measurement. TorchRec's own PrefetchTrainPipelineSparseDist reuses the
forward's input distribution instead, but looks only one batch ahead and needs CUDA streams.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .checks import is_int
from .disk_modules import DiskTableModule
from .ranks import collective_device

__all__ = ["LookaheadPipeline"]

_ADAPT_EVERY = 8  # steps between readings of the read-ahead latency (and choices of the auto depth)
_EWMA = 0.3


def _disk_collections(model: nn.Module) -> List[DiskTableModule]:
    """The modules of `model` that look ahead on a batch's KeyedJaggedTensor: one-process disk
    collections and sharded ones (not the DiskEmbeddingBags inside them, which take ids)."""
    return [m for m in model.modules() if isinstance(m, DiskTableModule)]


class LookaheadPipeline:
    """A TorchRec-style training pipeline (``progress(dataloader_iter)``) that looks ahead.

    Works on a model with DiskEmbeddingBagCollection in one process and on a
    DistributedModelParallel model with disk tables (ShardedDiskEmbeddingBagCollection), where
    every rank must call `progress` alike (see the module's docstring).

    Args:
        model: returns ``(loss, output)`` for a batch (torchrec's DLRMTrain, or DMP over it).
        optimizer: stepped after each backward (fused disk tables update in backward).
        depth: batches looked ahead (0: none), or "auto".
        max_depth: the largest depth "auto" picks.
        device: where the model trains: each batch is copied there as it enters the window, after its
            read-ahead starts from the host's copy of its ids (default: batches stay where they are).

    Example::

        pipeline = LookaheadPipeline(dmp, optimizer, depth="auto")
        batches = iter(dataloader)
        while True:
            try:
                loss, logits, labels = pipeline.progress(batches)
            except StopIteration:
                break
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, depth: Union[int, str] = 1,
                 max_depth: int = 8, device: Optional[Union[str, torch.device]] = None) -> None:
        if depth != "auto" and (not is_int(depth) or depth < 0):
            raise ValueError(f"depth must be a non-negative int or 'auto', got {depth!r}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be positive, got {max_depth}")
        self._model, self._optimizer = model, optimizer
        self._auto = depth == "auto"
        self._depth = 1 if self._auto else int(depth)
        self._max_depth = max_depth
        self._device = torch.device(device) if device is not None else None
        self._window: Deque[Any] = deque()
        self._tables = _disk_collections(model)
        # The groups whose ranks look ahead together must also agree on the depth.
        groups = (t.lookahead_process_group for t in self._tables)
        self._groups: List[dist.ProcessGroup] = list({id(g): g for g in groups if g is not None}.values())
        self._steps = 0
        self._batches_taken = 0  # drawn from the data loader, to name a bad one
        self._step_ms = 0.0
        self._lookahead_ms = 0.0
        self._latency_ms = 0.0

    @property
    def depth(self) -> int:
        """Batches looked ahead now."""
        return self._depth

    def stats(self) -> Dict[str, float]:
        """What the pipeline measured (times in ms).

        Returns:
            ``depth``; ``step_ms``, a moving average of forward, backward and optimizer step;
            ``read_ahead_latency_ms``, the largest the disk tables report (with depth "auto", as
            read at its last choice, every few steps, and under DMP the largest of any rank:
            "auto" picks the depth from these two); ``lookahead_ms``, a moving average of the time to issue one batch's
            lookahead (under DMP: its input distribution, including the wait for the other
            ranks); ``disk_collections``, the disk collections found in the model.
        """
        latency_ms = self._latency_ms if self._auto else self._table_latency_ms()
        return {"depth": self._depth, "step_ms": self._step_ms, "read_ahead_latency_ms": latency_ms,
                "lookahead_ms": self._lookahead_ms, "disk_collections": len(self._tables)}

    def _fill(self, dataloader_iter: Iterator[Any]) -> None:
        while len(self._window) <= self._depth:
            try:
                batch = next(dataloader_iter)
            except StopIteration:
                return
            self._batches_taken += 1
            self._check_batch(batch, self._batches_taken - 1)
            tokens: List[Optional[int]] = []  # each collection's read-ahead of the batch
            if self._depth > 0 and self._tables:  # rows of this batch start coming in now, steps before it trains
                start = time.perf_counter()
                tokens = [collection.lookahead(batch.sparse_features) for collection in self._tables]
                self._lookahead_ms = self._average(self._lookahead_ms, (time.perf_counter() - start) * 1e3)
            if self._device is not None:
                batch = batch.to(self._device, non_blocking=True)
            self._window.append((batch, tokens))

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Trains one batch; returns the model's output. Raises StopIteration when the data ends."""
        self._fill(dataloader_iter)
        if not self._window:
            raise StopIteration
        batch, tokens = self._window.popleft()
        # Its lookups pool from its read-aheads, named: no search among them by its ids.
        for collection, token in itertools.zip_longest(self._tables, tokens):
            collection.read_ahead_next(token)
        start = time.perf_counter()
        self._optimizer.zero_grad()
        loss, output = self._model(batch)
        loss.backward()
        self._optimizer.step()
        self._step_ms = self._average(self._step_ms, (time.perf_counter() - start) * 1e3)
        self._steps += 1
        if self._auto and self._steps % _ADAPT_EVERY == 0:
            self._adapt()
        return output

    @staticmethod
    def _check_batch(batch: Any, index: int) -> None:
        """Refuses a batch whose parts disagree on its size, naming them (DLRM would fail later with a
        bare size error, or a disk table would look ahead on ids that never train)."""
        sparse = getattr(batch, "sparse_features", None)
        if sparse is None or not callable(getattr(sparse, "stride", None)):
            raise TypeError(f"batch {index} has no sparse_features (a KeyedJaggedTensor): "
                            f"got {type(batch).__name__}")
        samples = sparse.stride()
        for name in ("dense_features", "labels"):
            part = getattr(batch, name, None)
            if isinstance(part, torch.Tensor) and part.dim() > 0 and part.shape[0] != samples:
                raise ValueError(f"batch {index}: {name} has {part.shape[0]} rows but "
                                 f"sparse_features has {samples} samples")

    @staticmethod
    def _average(average: float, sample: float) -> float:
        """The moving average after `sample` (the first sample starts it)."""
        return sample if average == 0.0 else (1 - _EWMA) * average + _EWMA * sample

    def _table_latency_ms(self) -> float:
        """The largest read-ahead latency the disk tables of this rank report (their stats() read the
        stores too: not for every step)."""
        return max((stats.get("read_ahead_latency_ms", 0.0) for collection in self._tables
                    for stats in collection.stats().values()), default=0.0)

    def _adapt(self) -> None:
        """Depth "auto": picks the depth from the read-ahead latency and the step time."""
        latency_ms = self._table_latency_ms()
        wanted = 0  # no measurement yet: keep the depth
        if latency_ms > 0 and self._step_ms > 0:
            wanted = min(self._max_depth, max(1, math.ceil(latency_ms / self._step_ms)))
        if self._groups:  # every rank must fill its window alike, or the lookaheads' collectives deadlock
            agreed = torch.tensor([latency_ms, float(wanted)], dtype=torch.float64)
            for group in self._groups:  # the model's groups: NCCL on GPUs
                on_device = agreed.to(collective_device(group))
                dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
                agreed = on_device.cpu()
            latency_ms, wanted = float(agreed[0]), int(agreed[1])
        self._latency_ms = latency_ms
        if wanted > 0:
            self._depth = wanted
