"""LookaheadPipeline: trains on batch t while the disk rows of batches t+1..t+k are read.

The ids of future batches are known before they are needed (MLKV's Lookahead): the pipeline
keeps a window of the next k batches from the data loader and, as a batch enters the window,
asks every disk table of the model to start reading its rows (`lookahead`), so the reads
overlap the training of the batches before it. Lookahead never changes results: at
staleness 0 training equals the loop without the pipeline.

``depth="auto"`` picks k from the measured prefetch latency and step time, k =
ceil(latency / step time) within [1, max_depth], and re-measures every few steps, so it
follows them when they change.

The model takes a batch and returns ``(loss, output)``, as torchrec's DLRMTrain does; the
batch has ``sparse_features`` (a KeyedJaggedTensor), as torchrec's Batch. Disk tables are
found in the model: every module with ``lookahead(KeyedJaggedTensor)`` and
``embedding_bag_configs()`` (DiskEmbeddingBagCollection). Under DistributedModelParallel the
ids reach a table's rank only after TorchRec's input distribution, which this pipeline does
not run ahead: there it trains without lookahead.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Union

import torch
from torch import nn

__all__ = ["LookaheadPipeline"]

_ADAPT_EVERY = 8  # steps between re-measurements of the auto depth
_EWMA = 0.3


class LookaheadPipeline:
    """A TorchRec-style training pipeline (``progress(dataloader_iter)``) that looks ahead.

    Args:
        model: returns ``(loss, output)`` for a batch (torchrec's DLRMTrain).
        optimizer: stepped after each backward (fused disk tables update in backward).
        depth: batches looked ahead (0: none), or "auto".
        max_depth: the largest depth "auto" picks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, depth: Union[int, str] = 1,
                 max_depth: int = 8) -> None:
        if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise ValueError(f"depth must be a non-negative int or 'auto', got {depth!r}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be positive, got {max_depth}")
        self._model, self._optimizer = model, optimizer
        self._auto = depth == "auto"
        self._depth = 1 if self._auto else int(depth)
        self._max_depth = max_depth
        self._window: Deque[Any] = deque()
        self._tables: List[nn.Module] = [m for m in model.modules()
                                         if callable(getattr(m, "lookahead", None)) and hasattr(m, "embedding_bag_configs")]
        self._steps = 0
        self._step_ms = 0.0
        self._latency_ms = 0.0

    @property
    def depth(self) -> int:
        """Batches looked ahead now."""
        return self._depth

    def stats(self) -> Dict[str, float]:
        """The depth, the step time and the prefetch latency it was chosen from (ms, moving averages)."""
        return {"depth": self._depth, "step_ms": self._step_ms, "prefetch_latency_ms": self._latency_ms,
                "disk_collections": len(self._tables)}

    def _fill(self, dataloader_iter: Iterator[Any]) -> None:
        while len(self._window) <= self._depth:
            try:
                batch = next(dataloader_iter)
            except StopIteration:
                return
            self._window.append(batch)
            if self._depth > 0:  # rows of this batch start coming in now, steps before it trains
                for collection in self._tables:
                    collection.lookahead(batch.sparse_features)

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Trains one batch; returns the model's output. Raises StopIteration when the data ends."""
        self._fill(dataloader_iter)
        if not self._window:
            raise StopIteration
        batch = self._window.popleft()
        start = time.perf_counter()
        self._optimizer.zero_grad()
        loss, output = self._model(batch)
        loss.backward()
        self._optimizer.step()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        self._step_ms = elapsed_ms if self._steps == 0 else (1 - _EWMA) * self._step_ms + _EWMA * elapsed_ms
        self._steps += 1
        if self._auto and self._steps % _ADAPT_EVERY == 0:
            self._adapt()
        return output

    def _adapt(self) -> None:
        latencies = [stats.get("prefetch_latency_ms", 0.0) for collection in self._tables
                     for stats in collection.stats().values()]
        self._latency_ms = max(latencies, default=0.0)
        if self._latency_ms > 0 and self._step_ms > 0:
            self._depth = min(self._max_depth, max(1, math.ceil(self._latency_ms / self._step_ms)))
