"""ParquetBatches: batch number -> torchrec Batch over a user's Parquet files, read by column.

A dataset is a list of Parquet files (or directories of them) and a schema: a label column,
dense float columns, and sparse features, each a column of int ids (one a sample), of lists of
int ids (any number a sample, a jagged feature) or of strings (hashed to ids, FNV-1a), each id
taken modulo its table's rows. Only the declared columns are read (Parquet's projection: the
other columns' bytes never leave the disk), one row group at a time: a row group is the unit of
reading and decoding, kept decoded while the batches around it are made (a few per process,
enough for a shuffle window), so a row group is read once per window however many batches it
feeds. Rows are ordered as ShuffledRows orders them (row_order.py): each of the ranks reads a
contiguous share of the rows, so of the row groups, and a batch is a function of its number, so
resume is exact, as for Criteo. A user's transform (transforms.py) may make declared columns from
others as each row group is read.

Bad input is refused when the files are opened (a missing column, a column of another type,
named with its file) or when a row group is decoded (nulls, negative ids), never trained on.
"""
from __future__ import annotations

import glob
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .row_order import ShuffledRows
from .transforms import RowGroupTransform

__all__ = ["BatchArrays", "ParquetBatches", "ParquetFormatError", "SparseFeature", "hash_strings", "parquet_batch",
           "parquet_files", "schema_features"]

_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


class ParquetFormatError(ValueError):
    """A Parquet file that does not hold the declared schema; the message names the file and column."""


@dataclass(frozen=True)
class SparseFeature:
    """A sparse feature: its `column`, the `table` it looks up (features naming one table share
    it) and that table's `rows` (ids are taken modulo them)."""

    column: str
    table: str
    rows: int


def parquet_files(entries: Sequence[str]) -> List[str]:
    """The Parquet files of `entries` (files, directories of ``*.parquet`` files, or glob
    patterns), in order, each directory's and pattern's sorted; ValueError names an entry that
    matches none."""
    files: List[str] = []
    for entry in entries:
        if os.path.isdir(entry):
            found = sorted(glob.glob(os.path.join(entry, "**", "*.parquet"), recursive=True))
        elif any(c in entry for c in "*?["):
            found = sorted(glob.glob(entry, recursive=True))
        else:
            found = [entry] if os.path.isfile(entry) else []
        if not found:
            raise ValueError(f"{entry!r} is no Parquet file, directory of them or pattern matching one")
        files.extend(found)
    return files


def hash_strings(strings: Any) -> np.ndarray:
    """FNV-1a (64-bit) of each string's UTF-8 bytes shifted right by one bit (a non-negative int64):
    a stable id for a string column's values, the same in every file and process. `strings`: a
    pyarrow string array."""
    import pyarrow as pa

    array = strings.cast(pa.large_string()) if not pa.types.is_large_string(strings.type) else strings
    n = len(array)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset:array.offset + n + 1]
    data = array.buffers()[2]
    bytes_ = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    # One pass per byte position over the strings that long: categorical values are short.
    for k in range(int(lengths.max()) if n else 0):
        live = np.flatnonzero(lengths > k)
        h[live] = (h[live] ^ bytes_[starts[live] + k].astype(np.uint64)) * _FNV_PRIME
    return (h >> np.uint64(1)).astype(np.int64)


class BatchArrays(NamedTuple):
    """A batch as numpy arrays: labels [n], dense [n, D] float32, and the ids of every sparse
    feature in turn (values) with each sample's count of them (lengths [features * n])."""

    labels: np.ndarray
    dense: np.ndarray
    values: np.ndarray
    lengths: np.ndarray


def parquet_batch(feature_names: Sequence[str], arrays: BatchArrays) -> Any:
    """The torchrec Batch of `arrays`, its sparse features named `feature_names`."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def tensor(array: np.ndarray) -> torch.Tensor:  # arrays from Ray's object store are read-only
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    lengths = tensor(arrays.lengths)
    per_key = lengths.view(len(feature_names), -1).sum(1).tolist()
    features = KeyedJaggedTensor(keys=list(feature_names), values=tensor(arrays.values), lengths=lengths,
                                 stride=len(arrays.labels), length_per_key=per_key)
    return Batch(dense_features=tensor(arrays.dense), sparse_features=features, labels=tensor(arrays.labels))


@dataclass
class _RowGroup:
    """A decoded row group: labels [n], dense [n, D] float32, and per sparse feature its ids and
    each row's first id (offsets [n + 1])."""

    labels: np.ndarray
    dense: np.ndarray
    ids: List[np.ndarray]
    offsets: List[np.ndarray]


class ParquetBatches:
    """Numbered torchrec Batches over Parquet files (see the module's docstring).

    Args:
        files: Parquet files (or directories, or glob patterns: `parquet_files`).
        batch_size: samples per batch.
        label: the label column (numeric or bool; a click is > 0).
        dense: the dense float columns (nulls read as 0, as Criteo's missing values).
        sparse: the sparse features.
        shuffle_window: batches per shuffled window; 0 keeps the files' order.
        seed: the shuffle's seed.
        transform: a user's transform of each row group before it is decoded (transforms.py);
            the declared columns are those it returns.
        world: ranks sharing the files, each reading its own share of the rows (ShuffledRows), so
            of the row groups.
    """

    def __init__(self, files: Sequence[str], batch_size: int, label: str, dense: Sequence[str],
                 sparse: Sequence[SparseFeature], shuffle_window: int = 0, seed: int = 0,
                 transform: Optional[RowGroupTransform] = None, world: int = 1) -> None:
        import pyarrow.parquet as pq

        if not sparse:
            raise ValueError("a Parquet dataset needs at least one sparse feature")
        self.files = parquet_files(files)
        self.label, self.dense, self.sparse = label, list(dense), list(sparse)
        for name in [*self.dense, *(f.column for f in self.sparse)]:
            if name == label:  # a model fed its own label learns nothing it can use
                raise ValueError(f"column {label!r} is the label and is declared as a feature too")
        self.columns = [label, *self.dense, *dict.fromkeys(f.column for f in self.sparse)]
        self.transform = transform
        self._transform = transform.load() if transform is not None else None
        self._readers, self._row_groups = [], []  # (file, row group) in row order
        self._file_columns: List[List[str]] = []  # the columns read from each file
        starts = [0]
        self.bytes_read_per_epoch = self.bytes_per_epoch = 0  # the declared columns', every column's
        for path in self.files:
            try:
                reader = pq.ParquetFile(path, pre_buffer=False)
            except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
                raise ParquetFormatError(f"Parquet file {path!r} cannot be read: {e}") from e
            self._file_columns.append(self._columns_to_read(path, reader.schema_arrow))
            self._readers.append(reader)
            meta = reader.metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                self._row_groups.append((len(self._readers) - 1, g))
                starts.append(starts[-1] + group.num_rows)
                for c in range(group.num_columns):
                    chunk = group.column(c)
                    self.bytes_per_epoch += chunk.total_compressed_size
                    if chunk.path_in_schema.split(".")[0] in self._file_columns[-1]:
                        self.bytes_read_per_epoch += chunk.total_compressed_size
        self._starts = np.asarray(starts, dtype=np.int64)
        self.rows, self.row_groups = int(self._starts[-1]), len(self._row_groups)
        try:
            self.row_indices = ShuffledRows(self.rows, batch_size, shuffle_window, seed, world)
        except ValueError as e:
            raise ValueError(f"the Parquet files {self.files} {e}") from None
        self.batch_size, self.batches_per_epoch = batch_size, self.row_indices.batches_per_epoch
        self.feature_names = [f.column for f in self.sparse]
        # Decoded row groups, the most recently used last: enough for a shuffle window and the next.
        rows_per_group = max(1, self.rows // len(self._row_groups))
        window_rows = max(1, shuffle_window) * batch_size
        self._keep = 2 + 2 * -(-window_rows // rows_per_group)
        self._decoded: "OrderedDict[int, _RowGroup]" = OrderedDict()
        self._decoding: Dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.row_groups_read = 0  # decoded so far (a row group read again once dropped counts again)

    def _columns_to_read(self, path: str, schema: Any) -> List[str]:
        """The columns of the file `path` (of `schema`) to read: the declared ones, or, with a
        transform, those of them the file has and those the transform reads; the declared
        columns (the transform's output) checked against the schema."""
        if self._transform is None:
            self._check_schema(path, schema)
            return self.columns
        missing = [name for name in self.transform.reads if name not in schema.names]
        if missing:
            raise ParquetFormatError(f"Parquet file {path!r} has no column {missing[0]!r}, which the transform "
                                     f"{self.transform.function} reads (it has {schema.names})")
        columns = list(dict.fromkeys([*(c for c in self.columns if c in schema.names), *self.transform.reads]))
        # The transform's output for no rows: a declared column it does not make is named before any batch.
        self._transformed(schema.empty_table().select(columns), path, "its schema (no rows)")
        return columns

    def _transformed(self, table: Any, path: str, where: str) -> Any:
        """The transform's table of `table` (read from `path`, `where` in it), checked: a Table of
        as many rows holding the declared columns."""
        import pyarrow as pa

        name = self.transform.function
        try:
            out = self._transform(table)
        except Exception as e:  # the user's code: its error, said where it happened
            raise RuntimeError(f"the transform {name} failed on Parquet file {path!r}, {where}: "
                               f"{type(e).__name__}: {e}") from e
        if not isinstance(out, pa.Table):
            raise TypeError(f"the transform {name} returned a {type(out).__name__} for Parquet file {path!r}, "
                            f"{where}; it must return a pyarrow Table")
        if out.num_rows != table.num_rows:  # rows are numbered before it runs: it may not drop or add any
            raise ValueError(f"the transform {name} returned {out.num_rows} rows for the {table.num_rows} of "
                             f"Parquet file {path!r}, {where}; it must keep every row (filter the files instead)")
        self._check_schema(path, out.schema, f" (after the transform {name})")
        return out

    def _check_schema(self, path: str, schema: Any, after: str = "") -> None:
        import pyarrow as pa

        def column_type(name: str) -> Any:
            if name not in schema.names:
                raise ParquetFormatError(f"Parquet file {path!r}{after} has no column {name!r} "
                                         f"(it has {schema.names})")
            return schema.field(name).type

        numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
        for name, role in [(self.label, "the label"), *((d, "a dense feature") for d in self.dense)]:
            kind = column_type(name)
            if not any(test(kind) for test in numeric):
                raise ParquetFormatError(f"Parquet file {path!r}{after}: column {name!r} ({role}) has type "
                                         f"{kind}; it must be numeric")
        for feature in self.sparse:
            kind = column_type(feature.column)
            inner = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
            if not (pa.types.is_integer(inner) or pa.types.is_string(inner) or pa.types.is_large_string(inner)):
                raise ParquetFormatError(f"Parquet file {path!r}{after}: column {feature.column!r} (a sparse "
                                         f"feature) has type {kind}; it must be int, string, or a list of either")

    def __call__(self, number: int) -> Any:
        """Batch `number` (any non-negative int: epochs repeat with their own shuffle)."""
        return parquet_batch(self.feature_names, self.arrays(number))

    def arrays(self, number: int) -> BatchArrays:
        """Batch `number` as numpy arrays (what a Ray worker sends: no torch objects to pickle)."""
        parts = [(self._row_group(g), local) for g, local in self._rows_by_row_group(number)]
        labels = np.concatenate([group.labels[local] for group, local in parts])
        dense = np.concatenate([group.dense[local] for group, local in parts])
        values, lengths = [], []
        for f in range(len(self.sparse)):
            for group, local in parts:
                first, last = group.offsets[f][local], group.offsets[f][local + 1]
                counts = last - first
                lengths.append(counts)
                # Each row's ids, in row order: position k of the output reads first[row] + (k - row's start).
                starts = np.repeat(first - (np.cumsum(counts) - counts), counts)
                values.append(group.ids[f][starts + np.arange(int(counts.sum()), dtype=np.int64)])
        return BatchArrays(labels, dense, np.concatenate(values), np.concatenate(lengths))

    def decode_row_groups(self, number: int) -> None:
        """Decodes the row groups batch `number` reads, kept for the batches around it, making no
        batch (a Ray actor decodes its next row groups while another makes batches)."""
        for g, _ in self._rows_by_row_group(number):
            self._row_group(g)

    def _rows_by_row_group(self, number: int) -> List[Tuple[int, np.ndarray]]:
        """(row group, rows of it in the group's numbering) of each row group batch `number` reads."""
        rows = self.row_indices(number)
        bounds = np.searchsorted(rows, self._starts)
        return [(g, rows[lo:hi] - self._starts[g]) for g, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
                if lo < hi]

    def _row_group(self, g: int) -> _RowGroup:
        """Row group `g` decoded, from the cache or read now (one thread decodes it, others wait)."""
        with self._lock:
            group = self._decoded.get(g)
            if group is not None:
                self._decoded.move_to_end(g)
                return group
            event = self._decoding.get(g)
            mine = event is None
            if mine:
                event = self._decoding[g] = threading.Event()
        if not mine:
            event.wait()
            with self._lock:
                group = self._decoded.get(g)
            return group if group is not None else self._row_group(g)  # its decoder failed: try it here
        try:
            group = self._decode(g)
            with self._lock:
                self._decoded[g] = group
                self.row_groups_read += 1
                while len(self._decoded) > self._keep:
                    self._decoded.popitem(last=False)
            return group
        finally:
            with self._lock:
                del self._decoding[g]
            event.set()

    def _decode(self, g: int) -> _RowGroup:
        import pyarrow as pa
        import pyarrow.compute as pc

        file, index = self._row_groups[g]
        path = self.files[file]
        # One thread a row group: the loader's threads are the parallelism, within their CPU budget.
        table = self._readers[file].read_row_group(index, columns=self._file_columns[file], use_threads=False)
        if self._transform is not None:
            table = self._transformed(table, path, f"row group {index}")

        def column(name: str) -> Any:
            return table.column(name).combine_chunks()

        label = column(self.label)
        if label.null_count:
            raise ParquetFormatError(f"Parquet file {path!r}, row group {index}: column {self.label!r} (the label) "
                                     f"has {label.null_count} nulls")
        labels = (label.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False) > 0).astype(np.float32)
        dense = np.empty((table.num_rows, len(self.dense)), dtype=np.float32)
        for d, name in enumerate(self.dense):
            # Unsafe: large integers (prices in cents, timestamps) round to the nearest float, as numpy would.
            values = pc.fill_null(column(name).cast(pa.float32(), safe=False), 0.0).to_numpy(zero_copy_only=False)
            # NaN is how pandas writes a missing float: missing, as a null. An infinity is no value to train on.
            values = np.nan_to_num(values, nan=0.0, posinf=np.inf, neginf=-np.inf)
            if not np.isfinite(values).all():
                raise ParquetFormatError(f"Parquet file {path!r}, row group {index}: column {name!r} (a dense "
                                         f"feature) has {int(np.isinf(values).sum())} infinite values")
            dense[:, d] = values
        ids, offsets = [], []
        for feature in self.sparse:
            array = column(feature.column)
            where = f"Parquet file {path!r}, row group {index}: column {feature.column!r}"
            if array.null_count:
                raise ParquetFormatError(f"{where} has {array.null_count} null rows")
            if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
                row_offsets = np.asarray(array.offsets, dtype=np.int64)
                inner = array.values.slice(int(row_offsets[0]), int(row_offsets[-1] - row_offsets[0]))
                row_offsets = row_offsets - row_offsets[0]
            else:
                inner, row_offsets = array, np.arange(len(array) + 1, dtype=np.int64)
            if inner.null_count:
                raise ParquetFormatError(f"{where} has {inner.null_count} null ids in its lists")
            if pa.types.is_integer(inner.type):
                raw = inner.to_numpy(zero_copy_only=False)
                if raw.dtype != np.uint64:  # uint64 ids of 2**63 and up keep their remainder, taken unsigned
                    raw = raw.astype(np.int64, copy=False)
                    if raw.size and int(raw.min()) < 0:
                        raise ParquetFormatError(f"{where} has a negative id ({int(raw.min())})")
            else:
                raw = hash_strings(inner)
            ids.append((raw % raw.dtype.type(feature.rows)).astype(np.int64, copy=False))
            offsets.append(row_offsets)
        return _RowGroup(labels, dense, ids, offsets)


def schema_features(sparse: Sequence[Any]) -> Tuple[List[SparseFeature], List[Tuple[str, int, List[str]]]]:
    """The sparse features of a config's schema (entries with column, table, rows) and the tables
    they make: (name, rows, feature names), each table once, in order of first use; ValueError
    when two features name one table with different rows."""
    features = [SparseFeature(s.column, s.table or s.column, s.rows) for s in sparse]
    columns = [f.column for f in features]
    if len(set(columns)) != len(columns):  # a feature is its column: TorchRec keys features by name
        raise ValueError(f"column {next(c for c in columns if columns.count(c) > 1)!r} is declared twice")
    tables: Dict[str, Tuple[int, List[str]]] = {}
    for f in features:
        rows, names = tables.setdefault(f.table, (f.rows, []))
        if rows != f.rows:
            raise ValueError(f"table {f.table!r} is given {rows} rows by one feature and {f.rows} by {f.column!r}")
        names.append(f.column)
    return features, [(name, rows, names) for name, (rows, names) in tables.items()]

