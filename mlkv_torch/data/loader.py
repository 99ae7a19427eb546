"""BatchLoader: numbered batches made on worker threads ahead of training, delivered in order.

A batch is a function of its number (``make_batch(number)``), so what training sees depends on
neither the number of threads nor the buffer depth, and a loader resumed at a number delivers
exactly what the first one would have from there, at once, whatever the step reached. Batches
go through torchdata.nodes: a ParallelMapper on threads (in order) under a Prefetcher. The
loader measures what DS-Analyzer calls data stalls (the time training waits in ``next``) and,
where its InputTuner is "auto", re-decides threads and depth as the run goes, rebuilding the
nodes from the next batch number when the choice changes.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from .tuning import InputChoice, InputTuner, InputWindow

__all__ = ["BatchLoader", "batch_bytes"]

_FIRST_DECISION = 8  # batches delivered before the first decision; then at twice as many, up to
_DECISION_PERIOD = 256  # batches between later decisions


def batch_bytes(batch: Any) -> int:
    """Bytes held by the tensors of a batch (a torchrec Batch, a KeyedJaggedTensor, a tensor, or
    dataclasses, tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if hasattr(batch, "values") and hasattr(batch, "lengths") and hasattr(batch, "offsets"):  # a KJT
        return sum(batch_bytes(t) for t in (batch.values(), batch.lengths(), batch.offsets()))
    if dataclasses.is_dataclass(batch):
        return sum(batch_bytes(getattr(batch, f.name)) for f in dataclasses.fields(batch))
    if isinstance(batch, dict):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return sum(batch_bytes(v) for v in batch)
    return 0


class _MakeTimes:
    """The workers' times to make batches since the last `take` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum = self._max = 0.0
        self._count = 0
        self.batch_bytes = 0

    def add(self, seconds: float, made: Any) -> None:
        with self._lock:
            self._sum += seconds
            self._max = max(self._max, seconds)
            self._count += 1
            if not self.batch_bytes:
                self.batch_bytes = batch_bytes(made)

    def take(self) -> tuple:
        """(mean seconds, max seconds), and starts over."""
        with self._lock:
            result = (self._sum / self._count if self._count else 0.0, self._max)
            self._sum = self._max = 0.0
            self._count = 0
            return result


class BatchLoader:
    """Batches ``make_batch(first)``, ``make_batch(first + stride)``, ... (`count` of them, or
    endless with None), made by worker threads and delivered in order.

    Args:
        make_batch: batch number -> batch; called on worker threads, so it must be thread-safe.
        first: the first batch's number.
        count: batches to deliver; None: endless.
        stride: between consecutive numbers (ranks take every world_size-th batch).
        tuner: threads and buffer depth, fixed or "auto" (default: one thread, depth 2).

    Example::

        loader = BatchLoader(lambda n: synthetic_batch(generator, n, 2048), first=0, count=100,
                             tuner=InputTuner("auto", "auto", cpu_budget=1))
        for batch in loader:
            ...
        loader.stats()["wait_s"]  # how long training waited for input
    """

    def __init__(self, make_batch: Callable[[int], Any], first: int = 0, count: Optional[int] = None,
                 stride: int = 1, tuner: Optional[InputTuner] = None) -> None:
        if stride < 1:
            raise ValueError(f"stride must be positive, got {stride}")
        if count is not None and count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        self._make_batch, self._first, self._count, self._stride = make_batch, first, count, stride
        self._tuner = tuner or InputTuner(1, 2)
        self._choice = self._tuner.initial()
        self._node: Optional[Iterator[Any]] = None
        self._nodes: List[Any] = []  # torchdata nodes whose threads make the batches
        self._made = _MakeTimes()
        self._delivered = 0
        self._next_decision = _FIRST_DECISION
        self._decisions = 0
        self._workers_needed = 0  # the last window's (InputTuner.workers_needed), 0 before any
        self._input_cores = 0.0  # the last window's busy loader threads: batch time over step time
        self._last_return: Optional[float] = None  # when training last got a batch
        self._wait_s = 0.0  # over the loader's life
        self._window_wait_s = self._window_step_s = 0.0
        self._window_batches = 0

    @property
    def choice(self) -> InputChoice:
        """The threads and buffer depth in use."""
        return self._choice

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> Any:
        called = time.perf_counter()
        if self._last_return is not None:
            self._window_step_s += called - self._last_return
        if self._count is not None and self._delivered >= self._count:
            self.close()
            raise StopIteration
        started = self._node is None
        if started:
            self._node = self._build()
        batch = next(self._node)
        waited = time.perf_counter() - called
        self._wait_s += waited
        if not started:  # a new pipeline's first batch measures its start, not the pace
            self._window_wait_s += waited
            self._window_batches += 1
        self._delivered += 1
        if self._delivered >= self._next_decision:
            self._decide()
        self._last_return = time.perf_counter()
        return batch

    def _timed(self, number: int) -> Any:
        began = time.perf_counter()
        made = self._make_batch(number)
        self._made.add(time.perf_counter() - began, made)
        return made

    def _build(self) -> Iterator[Any]:
        """torchdata nodes that make the batches from the next undelivered number on."""
        from torchdata.nodes import IterableWrapper, ParallelMapper, Prefetcher

        start = self._first + self._delivered * self._stride
        numbers = itertools.count(start, self._stride) if self._count is None else \
            range(start, self._first + self._count * self._stride, self._stride)
        mapped = ParallelMapper(IterableWrapper(numbers), self._timed, num_workers=self._choice.workers,
                                in_order=True, method="thread")
        prefetched = Prefetcher(mapped, prefetch_factor=self._choice.prefetch)
        prefetched.reset()
        self._nodes = [prefetched, mapped]  # the consumer's end first: the order they are stopped in
        return prefetched

    def _decide(self) -> None:
        self._next_decision = min(2 * self._next_decision, self._next_decision + _DECISION_PERIOD)
        make_s, make_max_s = self._made.take()
        if self._window_batches == 0:
            return
        per_batch = 1e3 / self._window_batches
        window = InputWindow(batches=self._window_batches, make_ms=make_s * 1e3, make_max_ms=make_max_s * 1e3,
                             step_ms=self._window_step_s * per_batch, wait_ms=self._window_wait_s * per_batch,
                             batch_bytes=self._made.batch_bytes)
        self._window_wait_s = self._window_step_s = 0.0
        self._window_batches = 0
        # Measured with fixed settings too: a run that waits is told what the input needs either way.
        self._workers_needed = InputTuner.workers_needed(self._choice, window)
        self._input_cores = window.make_ms / max(window.step_ms + window.wait_ms, 1e-3)
        if not self._tuner.tunes:
            return
        self._decisions += 1
        choice = self._tuner.decide(self._choice, window)
        if choice != self._choice:
            self._choice = choice
            self._stop()  # the next batch comes from new nodes

    def stats(self) -> Dict[str, Any]:
        """What the loader did and measured.

        Returns:
            ``batches`` delivered; ``wait_s``, the time training waited in ``next`` in all;
            ``workers`` and ``prefetch``, the settings in use; ``buffer_bytes``, the most bytes
            its batches hold under them; ``batch_bytes``; ``decisions`` taken by the tuner;
            ``workers_needed``, the threads the last measured rates call for whatever the budgets (0
            before the first decision), beside ``cpu_budget``, the threads this host gives the loader;
            ``input_cores``, the cores making batches took at training's pace (0 before a decision).
        """
        return {"batches": self._delivered, "wait_s": self._wait_s, "workers": self._choice.workers,
                "prefetch": self._choice.prefetch, "batch_bytes": self._made.batch_bytes,
                "buffer_bytes": InputTuner.bytes_in_flight(self._choice, self._made.batch_bytes),
                "decisions": self._decisions, "workers_needed": self._workers_needed,
                "cpu_budget": self._tuner.cpu_budget, "input_cores": self._input_cores}

    def state_dict(self) -> Dict[str, int]:
        """The position: the number of the next batch to deliver."""
        return {"next_batch": self._first + self._delivered * self._stride}

    def close(self) -> None:
        """Stops the worker threads (the loader delivers nothing more)."""
        self._stop()

    def _stop(self) -> None:
        """Stops the nodes' threads now and drops their batches: torchdata 0.11 would stop them only
        once the cycle collector reaches its iterators, holding their batches until then."""
        for node in self._nodes:
            part = node
            while part is not None:  # a node's iterator, and the iterator's own, own the threads
                shutdown = getattr(part, "_shutdown", None)
                if callable(shutdown):
                    shutdown()
                part = getattr(part, "_it", None)
        self._nodes, self._node = [], None
