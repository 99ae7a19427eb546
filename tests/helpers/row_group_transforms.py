"""Row-group transforms the tests name by import path ("row_group_transforms:price_buckets"): a
user's module, imported by the loader's threads and by Ray's workers (PYTHONPATH holds tests/helpers/)."""
import os
import time

import numpy as np
import pyarrow as pa


def price_buckets(table: pa.Table, boundaries: list) -> pa.Table:
    """A sparse feature `bucket` (one id a row) from the dense column dense_0, and dense_1 doubled."""
    prices = table.column("dense_0").to_numpy(zero_copy_only=False)
    buckets = np.searchsorted(np.asarray(boundaries), np.nan_to_num(prices, nan=0.0)).astype(np.int64)
    doubled = pa.array(table.column("dense_1").to_numpy(zero_copy_only=False) * 2, type=pa.float64())
    table = table.set_column(table.schema.get_field_index("dense_1"), "dense_1", doubled)
    return table.append_column("bucket", pa.array(buckets))


def drops_the_first_row(table: pa.Table) -> pa.Table:
    return table.slice(1)


def fails_on_rows(table: pa.Table) -> pa.Table:
    if table.num_rows:
        raise KeyError("no price list for this region")
    return table


def not_a_table(table: pa.Table) -> dict:
    return table.to_pydict()


def slow_and_logged(table: pa.Table, seconds: float, log: str) -> pa.Table:
    """`table` unchanged, a row group with rows taking `seconds` more to decode; appends the process
    id and when it began and ended to the file `log` (a line a row group)."""
    if table.num_rows:
        began = time.monotonic()
        time.sleep(seconds)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {began} {time.monotonic()}\n")
    return table
