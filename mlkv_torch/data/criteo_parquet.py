"""Criteo days as Parquet: a converted day (torchrec's npy layout) written as one Parquet file that
`data.kind: parquet` reads, for tools and machines that take Parquet (Ray, Spark, DuckDB).

Columns: `label` (int32), `int_0..int_12` (float32, the dense features as converted: their log),
`cat_0..cat_25` (int64, the categorical values whole: a schema takes them modulo its tables' rows,
as CriteoBatches does). `parquet_schema(cardinalities)` is the `data.parquet` section that reads it.

The runner's own Criteo path stays the npy cache: memory-mapped arrays make batches several times
faster than decoding Parquet row groups (docs/benchmarks.md, "The input side").
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

import numpy as np

from .criteo_tsv import CAT_FEATURES, INT_FEATURES

__all__ = ["day_to_parquet", "parquet_schema"]

_ROW_GROUP_ROWS = 1 << 17


def day_to_parquet(prefix: str, path: str, row_group_rows: int = _ROW_GROUP_ROWS) -> int:
    """Writes the converted day `prefix` (``<prefix>_dense.npy`` etc.) to the Parquet file `path`
    (whole or not at all), a row group of `row_group_rows` rows at a time; returns its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .criteo_batches import day_arrays

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
            columns += [np.ascontiguousarray(sparse[rows, i], dtype=np.int64) for i in range(CAT_FEATURES)]
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
