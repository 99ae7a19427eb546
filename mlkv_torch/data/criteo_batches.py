"""CriteoBatches: batch number -> torchrec Batch over Criteo days in torchrec's npy layout.

The days are memory-mapped and read as one sequence of rows, batch by number as ShuffledRows
orders them (row_order.py: windows shuffled per epoch, a batch a function of its number). Ids are
hashed into each table's rows (``id % cardinality``) and the dense features are used as converted
(torchrec's converter takes their log), as torchrec's InMemoryBinaryCriteoIterDataPipe does.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .batch import one_id_per_feature_batch
from .criteo_npy import day_arrays
from .criteo_tsv import CAT_FEATURES
from .row_order import ShuffledRows

__all__ = ["CriteoBatches", "RAW_ID_MASK", "RAW_ID_SPACE"]

RAW_ID_SPACE = 1 << 32  # Criteo's categorical values are 32-bit: raw ids take them whole
RAW_ID_MASK = np.int64(RAW_ID_SPACE - 1)


class CriteoBatches:
    """Numbered torchrec Batches over Criteo days (see the module's docstring).

    Args:
        prefixes: the days, as torchrec's npy prefixes (``<prefix>_dense.npy`` etc.).
        batch_size: samples per batch.
        cardinalities: rows of each of the 26 tables (ids are taken modulo them); None: raw ids, the
            categorical values themselves as unsigned 32-bit ids (tables of RAW_ID_SPACE rows).
        feature_names: the 26 sparse features' names (default torchrec's ``cat_0`` .. ``cat_25``).
        shuffle_window: batches per shuffled window; 0 keeps the files' order.
        seed: the shuffle's seed.
    """

    def __init__(self, prefixes: Sequence[str], batch_size: int, cardinalities: Optional[Sequence[int]],
                 feature_names: Sequence[str] = tuple(f"cat_{i}" for i in range(CAT_FEATURES)),
                 shuffle_window: int = 0, seed: int = 0) -> None:
        if cardinalities is not None and (len(cardinalities) != CAT_FEATURES or min(cardinalities) < 1):
            raise ValueError(f"cardinalities must be {CAT_FEATURES} positive counts, got {list(cardinalities)}")
        self._days = [day_arrays(p) for p in prefixes]
        self._day_starts = np.cumsum([0] + [len(d[0]) for d in self._days])
        self.rows = int(self._day_starts[-1])
        try:  # numbered across the ranks, as torchrec's datapipe deals them out (any rank reads any row of a map)
            self.row_indices = ShuffledRows(self.rows, batch_size, shuffle_window, seed)
        except ValueError as e:
            raise ValueError(f"the Criteo days {list(prefixes)} {e}") from None
        self.batch_size, self.batches_per_epoch = batch_size, self.row_indices.batches_per_epoch
        self._hashes = None if cardinalities is None else np.asarray(cardinalities, dtype=np.int64).reshape(
            1, CAT_FEATURES)
        self.feature_names = list(feature_names)

    def __call__(self, number: int) -> Any:
        """Batch `number` (any non-negative int: epochs repeat with their own shuffle)."""
        rows = self.row_indices(number)
        dense, sparse, labels = self._gather(rows)
        # Raw: the 32-bit values unsigned, as torchrec's own npy files may hold them as negative int32.
        ids = torch.from_numpy(sparse & RAW_ID_MASK if self._hashes is None else sparse % self._hashes)
        return one_id_per_feature_batch(self.feature_names, torch.from_numpy(dense), ids,
                                        torch.from_numpy(labels.reshape(-1)))

    def _gather(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The dense, sparse and labels rows at `rows` (ascending), read from the days they fall in."""
        parts: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        bounds = np.searchsorted(rows, self._day_starts)
        for day, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if lo == hi:
                continue
            local = rows[lo:hi] - self._day_starts[day]
            dense, sparse, labels = self._days[day]
            if local[-1] - local[0] + 1 == len(local):  # a contiguous run: a slice reads it in one go
                index = slice(int(local[0]), int(local[-1]) + 1)
                parts.append((dense[index], sparse[index], labels[index]))
            else:
                parts.append((dense[local], sparse[local], labels[local]))
        return tuple(np.concatenate(p) for p in zip(*parts))  # copies: batches outlive the maps' pages
