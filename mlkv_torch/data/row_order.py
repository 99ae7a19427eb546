"""ShuffledRows: which rows of a dataset batch number n holds, for every source read by row number.

The rows are one sequence (the days or files concatenated); batch j of an epoch holds rows
[j * batch_size, (j + 1) * batch_size) (the rows past the last whole batch are left out), and batch
number n is batch n % batches_per_epoch of epoch n // batches_per_epoch. With a shuffle window of W
batches, each epoch permutes the rows within every window of W consecutive batches and the order of
the whole windows, seeded by (seed, epoch, window): the shuffle is reproducible, reads stay within
a window's span of the files, and a batch is a function of its number alone (exact resume).
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["ShuffledRows"]


class ShuffledRows:
    """Row numbers of numbered batches over `rows` rows (see the module's docstring)."""

    def __init__(self, rows: int, batch_size: int, shuffle_window: int = 0, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if shuffle_window < 0:
            raise ValueError(f"shuffle_window must be non-negative, got {shuffle_window}")
        self.rows, self.batch_size = rows, batch_size
        self.batches_per_epoch = rows // batch_size
        self.shuffle_window, self.seed = shuffle_window, seed
        self._permutations: dict = {}  # (epoch, window) -> that window's row permutation, the last few
        self._lock = threading.Lock()

    def __call__(self, number: int) -> np.ndarray:
        """The rows of batch `number` (any non-negative int: epochs repeat with their own shuffle),
        ascending when shuffled."""
        if number < 0:
            raise ValueError(f"batch numbers are non-negative, got {number}")
        epoch, j = divmod(number, self.batches_per_epoch)
        size = self.batch_size
        if not self.shuffle_window:
            return np.arange(j * size, (j + 1) * size, dtype=np.int64)
        window_batches = self.shuffle_window
        whole_windows = self.batches_per_epoch // window_batches
        position, offset = divmod(j, window_batches)
        window = position
        if position < whole_windows:  # whole windows trade places; a short last one stays last
            window = int(self._permutation(epoch, -1, whole_windows)[position])
        in_window = min(window_batches, self.batches_per_epoch - window * window_batches)
        permutation = self._permutation(epoch, window, in_window * size)
        chosen = permutation[offset * size:(offset + 1) * size]
        return np.sort(chosen) + window * window_batches * size

    def _permutation(self, epoch: int, window: int, length: int) -> np.ndarray:
        key = (epoch, window)
        with self._lock:
            permutation = self._permutations.get(key)
        if permutation is None:
            permutation = np.random.default_rng([self.seed, epoch, window + 1]).permutation(length)
            with self._lock:
                if len(self._permutations) >= 8:  # a worker per window at most, with room for the next
                    self._permutations.pop(next(iter(self._permutations)))
                self._permutations[key] = permutation
        return permutation
