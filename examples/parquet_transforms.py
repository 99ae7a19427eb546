"""Row-group transforms for `data.parquet.transform` (docs/data.md): each takes a pyarrow Table of a
row group's columns and returns it with a feature made from others, one row per row.

    PYTHONPATH=examples python -m mlkv_torch.train configs/parquet_example.yaml \\
      'data.parquet.transform={function: parquet_transforms:crossed, args: {columns: [c_0, c_3], into: c_12}}'
"""
from typing import List

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def crossed(table: pa.Table, columns: List[str], into: str) -> pa.Table:
    """Column `into` becomes the cross of the int id columns `columns`: one id for each combination
    of their values (mixed with a multiply-xorshift; the runner takes it modulo the table's rows)."""
    mixed = np.zeros(table.num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the mixing wraps around 2**64 by design
        for name in columns:
            ids = table.column(name).to_numpy(zero_copy_only=False).astype(np.uint64)
            mixed = (mixed ^ ids) * np.uint64(0x9E3779B97F4A7C15)
            mixed ^= mixed >> np.uint64(29)
    return _with_column(table, into, pa.array((mixed >> np.uint64(1)).astype(np.int64)))


def bucketized(table: pa.Table, column: str, boundaries: List[float], into: str) -> pa.Table:
    """Column `into` becomes the bucket of numeric `column` among the ascending `boundaries` (0 below
    the first; a missing value falls in bucket 0)."""
    values = pc.fill_null(table.column(column), boundaries[0] - 1).to_numpy(zero_copy_only=False)
    return _with_column(table, into, pa.array(np.searchsorted(np.asarray(boundaries), values, side="right")))


def _with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)
