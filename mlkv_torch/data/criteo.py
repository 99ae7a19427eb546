"""Criteo Kaggle / Terabyte click logs through torchrec.datasets.criteo.

Two layouts:
- ``npy``: torchrec's preprocessed files, ``<prefix>_dense.npy`` (float32 [rows, 13]),
  ``<prefix>_sparse.npy`` ([rows, 26]) and ``<prefix>_labels.npy`` ([rows, 1]) per day;
- ``tsv``: the raw logs (label, 13 integers, 26 hex categoricals per line), converted once into
  the npy layout under a cache directory by torchrec's own converter.

Batches come from torchrec's InMemoryBinaryCriteoIterDataPipe (memory-mapped, ids hashed into
each table's rows, each rank its share).
"""
from __future__ import annotations

import os
from typing import Iterator, List, Sequence, Tuple

__all__ = ["criteo_batches", "npy_files", "tsv_to_npy"]

_PARTS = ("dense", "sparse", "labels")


def npy_files(prefixes: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
    """The dense, sparse and labels files of each day prefix; FileNotFoundError names a missing one."""
    files: Tuple[List[str], List[str], List[str]] = ([], [], [])
    for prefix in prefixes:
        for part, paths in zip(_PARTS, files):
            path = f"{prefix}_{part}.npy"
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Criteo npy file {path!r} does not exist")
            paths.append(path)
    return files


def tsv_to_npy(tsv_paths: Sequence[str], cache_dir: str) -> List[str]:
    """Converts each TSV file (once: converted files are kept) into the npy layout under
    `cache_dir`; returns the day prefixes."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    os.makedirs(cache_dir, exist_ok=True)
    prefixes = []
    for tsv in tsv_paths:
        if not os.path.isfile(tsv):
            raise FileNotFoundError(f"Criteo TSV file {tsv!r} does not exist")
        prefix = os.path.join(cache_dir, os.path.basename(tsv).rsplit(".", 1)[0])
        outputs = [f"{prefix}_{part}.npy" for part in _PARTS]
        if not all(os.path.isfile(p) for p in outputs):
            partial = [p + ".partial.npy" for p in outputs]  # np.save keeps a name ending in .npy
            BinaryCriteoUtils.tsv_to_npys(tsv, *partial, dataset_name="criteo_1tb")
            for src, dst in zip(partial, outputs):
                os.replace(src, dst)
        prefixes.append(prefix)
    return prefixes


def criteo_batches(prefixes: Sequence[str], batch_size: int, cardinalities: Sequence[int], rank: int,
                   world_size: int) -> Iterator:
    """One pass over the days' rows in torchrec Batches of `batch_size` (the last partial one dropped)."""
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    dense, sparse, labels = npy_files(prefixes)
    return iter(InMemoryBinaryCriteoIterDataPipe(
        "train", dense, sparse, labels, batch_size=batch_size, rank=rank, world_size=world_size, drop_last=True,
        mmap_mode=True, hashes=list(cardinalities)))
