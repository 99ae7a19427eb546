"""torchrec's npy layout of a Criteo day: the files of a day prefix, read memory-mapped.

The layout is torchrec's (``BinaryCriteoUtils.tsv_to_npys`` with ``criteo_1tb``), bit for bit:
per day prefix, ``<prefix>_dense.npy`` (float32 [rows, 13], ``log(x - min + 2)`` with the day's
minimum over all 13 columns), ``<prefix>_sparse.npy`` (int64 [rows, 26], the hex values) and
``<prefix>_labels.npy`` (int32 [rows, 1]); missing values are 0.
"""
from __future__ import annotations

import io
import os
from typing import List, Sequence, Tuple

import numpy as np

from .criteo_tsv import CAT_FEATURES, INT_FEATURES

__all__ = ["NPY_PARTS", "day_arrays", "npy_files", "npy_header"]

NPY_PARTS = ("dense", "sparse", "labels")


def npy_files(prefixes: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
    """The dense, sparse and labels files of each day prefix; FileNotFoundError names a missing one."""
    files: Tuple[List[str], List[str], List[str]] = ([], [], [])
    for prefix in prefixes:
        for part, paths in zip(NPY_PARTS, files):
            path = f"{prefix}_{part}.npy"
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Criteo npy file {path!r} does not exist")
            paths.append(path)
    return files


def day_arrays(prefix: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A day's dense, sparse and labels arrays, memory-mapped; ValueError names a file that does not fit."""
    dense_path, sparse_path, labels_path = (paths[0] for paths in npy_files([prefix]))
    arrays = []
    for path, columns in ((dense_path, INT_FEATURES), (sparse_path, CAT_FEATURES), (labels_path, 1)):
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ValueError(f"Criteo npy file {path!r} cannot be read: {e}") from e
        if array.ndim != 2 or array.shape[1] != columns:
            raise ValueError(f"Criteo npy file {path!r} has shape {array.shape}, expected (rows, {columns})")
        arrays.append(array)
    if not arrays[0].shape[0] == arrays[1].shape[0] == arrays[2].shape[0]:
        raise ValueError(f"Criteo day {prefix!r}: dense, sparse and labels have {arrays[0].shape[0]}, "
                         f"{arrays[1].shape[0]} and {arrays[2].shape[0]} rows")
    return arrays[0], arrays[1], arrays[2]



def npy_header(dtype, shape: Tuple[int, int]) -> bytes:
    """The npy header np.save writes for a C-order array of `dtype` and `shape`."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
    return buffer.getvalue()
