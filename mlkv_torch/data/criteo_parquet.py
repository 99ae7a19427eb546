"""Criteo days as Parquet: a converted day (torchrec's npy layout) written as one Parquet file that
`data.kind: parquet` reads, for tools and machines that take Parquet (Ray, Spark, DuckDB).

Columns: `label` (int32), `int_0..int_12` (float32, the dense features as converted: their log),
`cat_0..cat_25` (int64, the categorical values whole: a schema takes them modulo its tables' rows,
as CriteoBatches does). Values are written unsigned: torchrec's own npy days hold those past 2**31
as negative int32 (the npy path hashes those negatives as torchrec's datapipe does, so for them
alone the two paths' hashed ids differ). `parquet_schema(cardinalities)` is the `data.parquet` section that reads it.

`convert_to_parquet_on_ray` converts many inputs at once, each input a Ray task on whichever node
of the cluster is free (the cache directory must be on a file system every node shares): the
same files as `convert_to_parquet`, N nodes taking about 1/N of the time for N inputs or more
(split one large day into parts with ``split -n l/N`` first).

The runner's own Criteo path stays the npy cache: memory-mapped arrays make batches several times
faster than decoding Parquet row groups (docs/benchmarks.md, "The input side").
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .criteo_batches import RAW_ID_MASK
from .criteo_convert import convert_file
from .criteo_npy import day_arrays
from .criteo_tsv import CAT_FEATURES, INT_FEATURES
from .ray_batches import connect_ray

__all__ = ["ParquetDays", "convert_to_parquet", "convert_to_parquet_on_ray", "day_to_parquet", "parquet_schema"]

_ROW_GROUP_ROWS = 1 << 17


def day_to_parquet(prefix: str, path: str, row_group_rows: int = _ROW_GROUP_ROWS) -> int:
    """Writes the converted day `prefix` (``<prefix>_dense.npy`` etc.) to the Parquet file `path`
    (whole or not at all), a row group of `row_group_rows` rows at a time; returns its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dense, sparse, labels = day_arrays(prefix)
    names = ["label", *(f"int_{i}" for i in range(INT_FEATURES)), *(f"cat_{i}" for i in range(CAT_FEATURES))]
    schema = pa.schema([("label", pa.int32()), *((f"int_{i}", pa.float32()) for i in range(INT_FEATURES)),
                        *((f"cat_{i}", pa.int64()) for i in range(CAT_FEATURES))])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"
    with pq.ParquetWriter(partial, schema) as writer:
        for first in range(0, len(labels), row_group_rows):
            rows = slice(first, first + row_group_rows)
            columns: List[Any] = [np.ascontiguousarray(labels[rows, 0], dtype=np.int32)]
            columns += [np.ascontiguousarray(dense[rows, i], dtype=np.float32) for i in range(INT_FEATURES)]
            columns += [sparse[rows, i].astype(np.int64) & RAW_ID_MASK for i in range(CAT_FEATURES)]
            writer.write_table(pa.table(columns, names=names), row_group_size=row_group_rows)
    os.replace(partial, path)
    return len(labels)


def parquet_schema(cardinalities: Sequence[int]) -> Dict[str, Any]:
    """The `data.parquet` schema of a Criteo day written by `day_to_parquet`, each categorical
    feature `cat_i` a table of cardinalities[i] rows (the runner's `t_cat_i`, as for Criteo)."""
    if len(cardinalities) != CAT_FEATURES:
        raise ValueError(f"Criteo has {CAT_FEATURES} categorical features, got {len(cardinalities)} cardinalities")
    return {"label": "label", "dense": [f"int_{i}" for i in range(INT_FEATURES)],
            "sparse": [{"column": f"cat_{i}", "rows": int(n)} for i, n in enumerate(cardinalities)]}


@dataclass
class ParquetDays:
    """One input converted: its npy day prefixes in the cache, the Parquet file of each day, rows
    in all, the seconds it took (the npy conversion served from the cache included) and the
    process that did it."""

    source: str
    prefixes: List[str]
    files: List[str]
    rows: int
    seconds: float
    pid: int


def convert_to_parquet(tsv_path: str, out_dir: str, days: Optional[int] = None, progress: bool = False
                       ) -> ParquetDays:
    """Converts the Criteo TSV `tsv_path` into the cache `out_dir` (criteo_convert.convert_file: once,
    reported on stderr with `progress`) and writes each of its days as
    ``<out_dir>/parquet/<entry>-<day>.parquet``."""
    started = time.perf_counter()
    done = convert_file(tsv_path, out_dir, days=days, progress=progress)
    files = []
    for prefix in done.prefixes:
        files.append(os.path.join(out_dir, "parquet", os.path.basename(os.path.dirname(prefix)) + "-"
                                  + os.path.basename(prefix) + ".parquet"))
        day_to_parquet(prefix, files[-1])
    return ParquetDays(os.path.abspath(tsv_path), list(done.prefixes), files, sum(done.rows),
                       time.perf_counter() - started, os.getpid())


def convert_to_parquet_on_ray(tsv_paths: Sequence[str], out_dir: str, days: Optional[int] = None,
                              address: str = "") -> List[ParquetDays]:
    """`convert_to_parquet` of each input as a Ray task (one CPU each; a task whose worker dies is
    run again: the conversion writes each file whole or not at all), on the cluster at `address`
    (empty: a local Ray of this machine's cores). The inputs' paths and `out_dir` must be the same
    on every node. Errors are raised as the in-process conversion raises them."""
    import ray

    started_ray = connect_ray(address, len(os.sched_getaffinity(0)))
    try:
        task = ray.remote(num_cpus=1, max_retries=3)(convert_to_parquet)
        refs = [task.remote(os.path.abspath(path), os.path.abspath(out_dir), days) for path in tsv_paths]
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:  # the task's own exception, as in-process
            raise e.as_instanceof_cause() from None
    finally:
        if started_ray:
            ray.shutdown()
