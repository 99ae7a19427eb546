"""A Parquet dataset to try `data.kind: parquet` on: SyntheticCTR's planted model written as a
wide table, more columns than a model reads (as production logs are).

    python -m mlkv_torch.data.parquet_generate OUT_DIR --rows 10000000 [--files 10] [--row-group-rows 131072]
        [--held-out]   # rows of the same planted model that a training set of any size never holds

Columns: `label` (int8 clicks), `dense_0..` (float32, 3% nulls), the sparse features `c_0..`
cycling through three kinds: int64 ids, lists of int64 ids (the planted id first, then 0-2 ids
drawn from the same table), and strings (the id as 8 hex digits, hashed to an id when read), then
`unused_columns` columns no model reads (floats, ints and strings). `configs/parquet_example.yaml`
declares the default layout's schema.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["generate", "sparse_kind"]

# The default layout: 6 dense and 13 sparse columns the model reads, with the label 20 of 40 columns.
DEFAULT_CARDINALITIES = (1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 93_145, 5_683, 80_000, 3_194)
DEFAULT_DENSE, DEFAULT_UNUSED = 6, 20
_BLOCK_ROWS = 1 << 17
_HELD_OUT_FIRST_BLOCK = 1 << 40  # the generator's batches from here on: no training set reaches them


def sparse_kind(feature: int) -> str:
    """The column kind of sparse feature `feature`: "int", "list" or "string", in turn."""
    return ("int", "list", "string")[feature % 3]


def _hex_strings(values: np.ndarray, digits: int, prefix: bytes = b""):
    """`values` (non-negative ints) as lowercase hex strings of `digits` digits after `prefix`, a
    pyarrow string array (numpy's string formatting is a Python call per value)."""
    import pyarrow as pa

    shifts = np.arange(4 * (digits - 1), -1, -4, dtype=np.uint64)
    nibbles = (values.astype(np.uint64)[:, None] >> shifts) & np.uint64(15)
    text = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[nibbles.astype(np.intp)]
    if prefix:
        text = np.concatenate([np.tile(np.frombuffer(prefix, dtype=np.uint8), (len(values), 1)), text], axis=1)
    width = text.shape[1]
    offsets = pa.array(np.arange(0, width * len(values) + 1, width, dtype=np.int32))
    return pa.StringArray.from_buffers(len(values), offsets.buffers()[1], pa.py_buffer(np.ascontiguousarray(text)))


def _block(model, index: int, rows: int, unused: int, seed: int):
    import pyarrow as pa

    dense, ids, labels, _ = model.batch(index, rows)
    rng = np.random.default_rng([seed, index, 7])
    columns = {"label": pa.array(labels.numpy().astype(np.int8))}
    dense_np = dense.numpy()
    for d in range(dense_np.shape[1]):
        columns[f"dense_{d}"] = pa.array(dense_np[:, d], mask=rng.random(rows) < 0.03)
    ids_np = ids.numpy()
    for f, n in enumerate(model.cardinalities):
        kind, column = sparse_kind(f), ids_np[:, f]
        if kind == "int":
            columns[f"c_{f}"] = pa.array(column)
        elif kind == "list":
            extra = rng.integers(0, 3, rows)
            lengths = 1 + extra
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(0, n, int(lengths.sum()))
            values[offsets[:-1]] = column  # the planted id first
            columns[f"c_{f}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        else:
            columns[f"c_{f}"] = _hex_strings(column, 8)
    for u in range(unused):
        kind = u % 4
        if kind in (0, 1):
            columns[f"unused_{u}"] = pa.array(rng.standard_normal(rows).astype(np.float32))
        elif kind == 2:
            columns[f"unused_{u}"] = pa.array(rng.integers(0, 1 << 40, rows))
        else:
            columns[f"unused_{u}"] = _hex_strings(rng.integers(0, 1 << 48, rows), 12, b"session-")
    return pa.table(columns)


def generate(out_dir: str, rows: int, files: int = 1, row_group_rows: int = _BLOCK_ROWS, seed: int = 0,
             cardinalities: Sequence[int] = DEFAULT_CARDINALITIES, num_dense: int = DEFAULT_DENSE,
             unused_columns: int = DEFAULT_UNUSED, held_out: bool = False) -> List[str]:
    """Writes `rows` rows into `files` Parquet files `part-NNNNN.parquet` of `out_dir`, row groups of
    `row_group_rows`; returns the files. Each file appears whole or not at all. `seed` is the planted
    model's; `held_out` draws rows of that model no training set (held_out False) holds, to evaluate on."""
    import pyarrow.parquet as pq

    from .synthetic import SyntheticCTR

    if rows < 1 or files < 1 or row_group_rows < 1:
        raise ValueError(f"rows, files and row_group_rows must be positive, got {rows}, {files}, {row_group_rows}")
    model = SyntheticCTR(cardinalities=tuple(cardinalities), num_dense=num_dense, seed=seed)
    os.makedirs(out_dir, exist_ok=True)
    per_file = -(-rows // files)
    written, block = [], _HELD_OUT_FIRST_BLOCK if held_out else 0
    for k in range(files):
        first, last = k * per_file, min(rows, (k + 1) * per_file)
        if first >= last:
            break
        path = os.path.join(out_dir, f"part-{k:05d}.parquet")
        partial = path + ".partial"
        writer = None
        try:
            for start in range(first, last, row_group_rows):
                table = _block(model, block, min(row_group_rows, last - start), unused_columns, seed)
                block += 1
                if writer is None:
                    writer = pq.ParquetWriter(partial, table.schema)
                writer.write_table(table, row_group_size=row_group_rows)
        finally:
            if writer is not None:
                writer.close()
        os.replace(partial, path)
        written.append(path)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (2 on any error, reported on stderr)."""
    paragraphs = __doc__.split("\n\n")  # what it makes, the usage, the columns
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.data.parquet_generate",
                                     description=" ".join(paragraphs[0].split()),
                                     epilog=" ".join(paragraphs[2].split()))
    parser.add_argument("out", metavar="OUT_DIR", help="the directory the Parquet files go to (made if missing)")
    parser.add_argument("--rows", type=int, required=True, help="rows in all, dealt out over the files")
    parser.add_argument("--files", type=int, default=1, help="Parquet files to write (default 1)")
    parser.add_argument("--row-group-rows", type=int, default=_BLOCK_ROWS,
                        help=f"rows of each row group (default {_BLOCK_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="the planted model's and the draws' seed (default 0)")
    parser.add_argument("--unused-columns", type=int, default=DEFAULT_UNUSED,
                        help=f"columns no model reads, after the others (default {DEFAULT_UNUSED})")
    parser.add_argument("--held-out", action="store_true", help="rows to evaluate on: the same model, other draws")
    args = parser.parse_args(argv)
    try:
        started = time.perf_counter()
        paths = generate(args.out, args.rows, args.files, args.row_group_rows, args.seed,
                         unused_columns=args.unused_columns, held_out=args.held_out)
        seconds = time.perf_counter() - started
        size = sum(os.path.getsize(p) for p in paths)
        print(f"{args.out}: {len(paths)} files, {args.rows} rows, {size / 1e6:.1f} MB, {seconds:.1f} s", flush=True)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
