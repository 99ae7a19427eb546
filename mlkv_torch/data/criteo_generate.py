"""A Criteo TSV file of Kaggle's format drawn from SyntheticCTR's planted model, to try the Criteo
recipe without the dataset (a model learns from it)."""
from __future__ import annotations

import contextlib
import os
from typing import Optional, Sequence

import numpy as np

from .criteo_tsv import CAT_FEATURES, write_tsv
from .synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCTR

__all__ = ["generate"]

_MISSING_INT = 0.04
_MISSING_CATEGORICAL = 0.03
_MISSING_STREAM = 0x4D495353  # keeps the missing-value draws apart from SyntheticCTR's own streams
_GENERATE_BLOCK_ROWS = 1 << 16


def generate(path: str, rows: int, seed: int = 0, cardinalities: Optional[Sequence[int]] = None) -> int:
    """Writes `rows` Criteo TSV lines drawn from SyntheticCTR's planted model; returns the rows.

    Ids are SyntheticCTR's, as 8 lowercase hex digits (so ``value % cardinality`` is the id);
    labels are its Bernoulli labels; integer feature j is ``floor(exp(2 x_j + 2))`` of its dense
    normal x_j, minus 3 for feature 2 (which goes negative like Kaggle's I2). 4% of the integers
    and 3% of the categoricals are missing (empty), drawn from `seed`. gzip when `path` ends in .gz.

    Args:
        path: the output file (its directory is created; the file appears whole or not at all).
        rows: lines to write (positive).
        seed: the generator's seed.
        cardinalities: ids per categorical feature, 26 of them (default Criteo Kaggle's).
    """
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    cardinalities = tuple(CRITEO_KAGGLE_CARDINALITIES if cardinalities is None else cardinalities)
    if len(cardinalities) != CAT_FEATURES:
        raise ValueError(f"Criteo has {CAT_FEATURES} categorical features, got {len(cardinalities)} cardinalities")
    if max(cardinalities) >= 1 << 32:
        raise ValueError("cardinalities must be below 2**32 (8 hex digits)")
    model = SyntheticCTR(cardinalities=cardinalities, seed=seed)

    def blocks():
        for index, first in enumerate(range(0, rows, _GENERATE_BLOCK_ROWS)):
            count = min(_GENERATE_BLOCK_ROWS, rows - first)
            dense, ids, labels, _ = model.batch(index, count)
            missing = np.random.default_rng([seed, index, _MISSING_STREAM])
            ints = np.floor(np.exp(2.0 * dense.numpy() + 2.0)).astype(np.int32)
            ints[:, 1] -= 3
            yield (labels.numpy().astype(np.int32), ints, missing.random(ints.shape) < _MISSING_INT,
                   ids.numpy().astype(np.uint32), missing.random(tuple(ids.shape)) < _MISSING_CATEGORICAL)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"  # a killed run leaves no file of the final name to be converted
    try:
        written = write_tsv(partial, blocks(), compress=path.endswith(".gz"))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise
    os.replace(partial, path)
    return written
