"""How many threads make batches and how many batches wait ready: just enough to keep ahead of training.

The rule follows tf.data's AUTOTUNE and Cachew's autoscaling: from the measured time to make a
batch and the time training takes per batch, `workers` is the fewest threads whose combined
rate exceeds training's by a margin, and a thread is added while training still waits (Cachew
adds a worker while it helps); `prefetch` is the slowest batch's time counted in steps, plus
one, so that one slow batch is absorbed by the buffer. Both are bounded: the threads by a CPU
budget (the cores torch and the disk tables' threads leave), the buffered batches by a memory
budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

from ..checks import is_int

__all__ = ["InputChoice", "InputTuner", "InputWindow"]

_HEADROOM = 1.5  # batch production must outpace training by this factor
_WAIT_TARGET = 0.01  # share of step time spent waiting above which a thread is added

Auto = Literal["auto"]


@dataclass(frozen=True)
class InputChoice:
    """The loader's settings: `workers` threads make batches, `prefetch` finished batches wait."""

    workers: int
    prefetch: int


@dataclass(frozen=True)
class InputWindow:
    """What the loader measured since its last decision.

    Args:
        batches: batches delivered.
        make_ms: mean wall time of a worker to make one batch.
        make_max_ms: the slowest batch's.
        step_ms: mean time training spent per batch outside the loader (the consumer's pace).
        wait_ms: mean time training waited per batch.
        batch_bytes: bytes of one batch's tensors.
    """

    batches: int
    make_ms: float
    make_max_ms: float
    step_ms: float
    wait_ms: float
    batch_bytes: int

    @property
    def wait_share(self) -> float:
        """Time waiting, of the time per batch."""
        total = self.step_ms + self.wait_ms
        return self.wait_ms / total if total > 0 else 0.0


class InputTuner:
    """Decides `InputChoice`s from `InputWindow`s.

    Args:
        workers: a fixed number of threads, or "auto".
        prefetch: a fixed buffer depth (batches), or "auto".
        cpu_budget: the most threads "auto" uses (at least 1).
        memory_budget_bytes: the most bytes the batches in flight (made, being made and
            buffered) may hold under "auto", as long as one thread and one buffered batch fit.
    """

    def __init__(self, workers: Union[int, Auto] = "auto", prefetch: Union[int, Auto] = "auto",
                 cpu_budget: int = 1, memory_budget_bytes: int = 256 << 20) -> None:
        for name, value in (("workers", workers), ("prefetch", prefetch)):
            if value != "auto" and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}")
        if cpu_budget < 1:
            raise ValueError(f"cpu_budget must be at least 1, got {cpu_budget}")
        if memory_budget_bytes < 1:
            raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
        self.workers, self.prefetch = workers, prefetch
        self.cpu_budget, self.memory_budget_bytes = cpu_budget, memory_budget_bytes

    @property
    def tunes(self) -> bool:
        """Whether any setting is "auto"."""
        return self.workers == "auto" or self.prefetch == "auto"

    def initial(self) -> InputChoice:
        """The settings before anything is measured."""
        return InputChoice(1 if self.workers == "auto" else self.workers,
                           2 if self.prefetch == "auto" else self.prefetch)

    @staticmethod
    def workers_needed(current: InputChoice, window: InputWindow) -> int:
        """The threads `window`'s rates call for under `current`, before any budget: the fewest whose
        combined rate outpaces training's by the margin, and one more than now while training still
        waits (Cachew's rule). More than the CPU budget says this host has too few cores for this
        input at this step rate (preprocess elsewhere, or once and cache it)."""
        needed = max(1, math.ceil(_HEADROOM * window.make_ms / max(window.step_ms, 1e-3)))
        if window.wait_share > _WAIT_TARGET:  # the model said enough, training says otherwise
            needed = max(needed, current.workers + 1)
        return needed

    def decide(self, current: InputChoice, window: InputWindow) -> InputChoice:
        """The settings for what follows `window`, measured under `current`."""
        workers = current.workers
        if self.workers == "auto":
            workers = self.workers_needed(current, window)
            if workers < current.workers and window.wait_share > _WAIT_TARGET / 2:
                workers = current.workers  # fewer only while training clearly does not wait
            # Each thread holds up to two batches, and one more must fit the buffer.
            affordable_workers = (self.memory_budget_bytes // max(window.batch_bytes, 1) - 1) // 2
            workers = max(1, min(workers, self.cpu_budget, affordable_workers))
        else:
            workers = self.workers
        prefetch = current.prefetch
        if self.prefetch == "auto":
            prefetch = max(2, math.ceil(window.make_max_ms / max(window.step_ms, 1e-3)) + 1)
            # A worker holds up to two batches in flight besides the buffer.
            affordable = self.memory_budget_bytes // max(window.batch_bytes, 1) - 2 * workers
            prefetch = max(1, min(prefetch, affordable))
        return InputChoice(workers, prefetch)

    @staticmethod
    def bytes_in_flight(choice: InputChoice, batch_bytes: int) -> int:
        """The most bytes the loader's batches hold under `choice`."""
        return (choice.prefetch + 2 * choice.workers) * batch_bytes
