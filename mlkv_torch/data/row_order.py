"""ShuffledRows: which rows of a dataset batch number n holds, for every source read by row number.

The rows are one sequence (the days or files concatenated). Step s of rank r trains batch number
s * world + r. With `world` 1 (Criteo) the numbers are one sequence of batches dealt out to the
ranks in turn, as torchrec's InMemoryBinaryCriteoIterDataPipe deals them. With `world` ranks
(Parquet, where a row group read is the cost), each rank owns a contiguous share of the rows, as
that datapipe splits them when it shuffles the training set (rows // world each, the first
rows % world ranks one more), so it reads only its own row groups: batch n is rank n % world's
batch k = n // world, and that rank's batch j of an epoch holds its share's rows
[j * batch_size, (j + 1) * batch_size); every rank has as many batches per epoch (the smallest
share's whole batches), and the rows past them are left out. Epochs repeat.

With a shuffle window of W batches, each epoch permutes a rank's rows within every window of W
consecutive batches and the order of the whole windows, seeded by (seed, epoch, window, and the
rank when there are several): the shuffle is reproducible, reads stay within a window's span of
the files, and a batch is a function of its number (and the world) alone: exact resume.
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["ShuffledRows"]


class ShuffledRows:
    """Row numbers of numbered batches over `rows` rows shared by `world` ranks (see the module's docstring)."""

    def __init__(self, rows: int, batch_size: int, shuffle_window: int = 0, seed: int = 0, world: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if shuffle_window < 0:
            raise ValueError(f"shuffle_window must be non-negative, got {shuffle_window}")
        if world < 1:
            raise ValueError(f"world must be positive, got {world}")
        self.rows, self.batch_size, self.world = rows, batch_size, world
        share, self._longer_shares = divmod(rows, world)
        self.share = share  # rows of the smallest share
        self.batches_per_rank = share // batch_size
        self.batches_per_epoch = self.batches_per_rank * world
        if self.batches_per_rank == 0:  # the callers name their files before this
            ranks = f" for each of {world} ranks" if world > 1 else ""
            raise ValueError(f"hold {rows} rows, fewer than one batch ({batch_size}){ranks}")
        self.shuffle_window, self.seed = shuffle_window, seed
        self._permutations: dict = {}  # (rank, epoch, window) -> that window's row permutation, the last few
        self._lock = threading.Lock()

    def first_row(self, rank: int) -> int:
        """The first row of `rank`'s share."""
        return rank * self.share + min(rank, self._longer_shares)

    def describe_share(self, rank: int) -> str:
        """What `rank` reads, in words (the runner says it for each rank)."""
        first = self.first_row(rank)
        last = self.first_row(rank + 1) - 1
        return (f"rank {rank} of {self.world} reads rows {first:,}-{last:,} of {self.rows:,} "
                f"({self.batches_per_rank:,} batches an epoch)")

    def __call__(self, number: int) -> np.ndarray:
        """The rows of batch `number` (any non-negative int: epochs repeat with their own shuffle),
        ascending when shuffled."""
        if number < 0:
            raise ValueError(f"batch numbers are non-negative, got {number}")
        rank, k = number % self.world, number // self.world
        epoch, j = divmod(k, self.batches_per_rank)
        size, first = self.batch_size, self.first_row(rank)
        if not self.shuffle_window:
            return np.arange(first + j * size, first + (j + 1) * size, dtype=np.int64)
        window_batches = self.shuffle_window
        whole_windows = self.batches_per_rank // window_batches
        position, offset = divmod(j, window_batches)
        window = position
        if position < whole_windows:  # whole windows trade places; a short last one stays last
            window = int(self._permutation(rank, epoch, -1, whole_windows)[position])
        in_window = min(window_batches, self.batches_per_rank - window * window_batches)
        permutation = self._permutation(rank, epoch, window, in_window * size)
        chosen = permutation[offset * size:(offset + 1) * size]
        return np.sort(chosen) + first + window * window_batches * size

    def _permutation(self, rank: int, epoch: int, window: int, length: int) -> np.ndarray:
        key = (rank, epoch, window)
        with self._lock:
            permutation = self._permutations.get(key)
        if permutation is None:
            # One rank's seeds are those of a single process: a run of one is unchanged by the ranks' shares.
            entropy = [self.seed, epoch, window + 1] + ([rank] if self.world > 1 else [])
            permutation = np.random.default_rng(entropy).permutation(length)
            with self._lock:
                if len(self._permutations) >= 8:  # a worker per window at most, with room for the next
                    self._permutations.pop(next(iter(self._permutations)))
                self._permutations[key] = permutation
        return permutation
