"""A checkpoint's disk tables as a world-independent set of stored shards: where each block of a
table's rows lies (`StoredShard`: a store, the checkpoint of it the cut names, the block of rows
and columns it holds), found from the cuts a checkpoint records (`stored_shards`), and read back
as global ids, weights and optimizer state (`read_shard`) without writing a byte, so the
checkpoint stays whole however the reading ends. Resuming on another number of ranks, and
exporting the tables, read a checkpoint this way."""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .read_ahead import read_ahead
from .row_layout import RowLayout
from .store import KVStore

__all__ = ["StoredShard", "stored_shards", "read_shard", "open_shard", "fill_shard", "same_columns", "TableRows"]

# A chunk of a table's rows: (ids [n], weights [n, columns], optimizer state [n, k]).
TableRows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_SHARD_DIRECTORY = re.compile(r"(?P<table>.+)_rows(?P<row>[0-9]+)_cols(?P<column>[0-9]+)")
_READ_BUDGET = 16 << 20  # log pages a read-only open holds in memory; the scan reads a few MiB at a time


@dataclass(frozen=True)
class StoredShard:
    """Rows [first_row, first_row + rows) and columns [first_column, first_column + columns) of
    `table`, in the store at `path` at its checkpoint `checkpoint` (keys local to the block),
    trained `step` optimizer steps."""

    table: str
    path: str
    checkpoint: Optional[int]
    step: int
    first_row: int
    rows: int
    first_column: int
    columns: int


def stored_shards(tables_dir: Union[str, Sequence[str]], cuts: Mapping[Optional[int], Optional[Dict[str, Any]]],
                  tables: Mapping[str, Tuple[int, int]], listed: Optional[Mapping[int, List[str]]] = None
                  ) -> Dict[str, List[StoredShard]]:
    """Every stored shard of the disk tables a checkpoint's cuts name, by table. `cuts` holds one
    process's cut under the key None (its tables at ``tables_dir/<table>``), or each rank's under
    its rank (``tables_dir/rank<r>/<table>_rows<r0>_cols<c0>``; None for a rank without disk
    tables); `tables` gives each table's (rows, columns) in the model. Several `tables_dir`s (each
    node's own disk, seen from one machine): a rank's directory is in the first that holds it.
    ValueError names a table the model does not have, a shard whose directory is missing, and a
    table whose stored shards leave rows or columns uncovered (a rank's cut lost). `listed`: the
    names in a rank's directory where another process listed them (a directory on another node's
    disk; its shards' paths are the ones it has there)."""
    tables_dirs = [tables_dir] if isinstance(tables_dir, str) else list(tables_dir)
    found: Dict[str, List[StoredShard]] = defaultdict(list)
    for rank, cut in cuts.items():
        if cut is None:
            continue
        candidates = [d if rank is None else os.path.join(d, f"rank{rank}") for d in tables_dirs]
        directory = next((d for d in candidates if os.path.isdir(d)), candidates[0])
        if listed is not None and rank in listed:
            names = listed[rank]
        elif rank is not None and not os.path.isdir(directory):
            raise ValueError(f"rank {rank}'s tables of the checkpoint are not here: {directory} is missing (on "
                             f"another node's own disk, or lost): read them where it is, or resume under "
                             f"torchrun with that node in the job")
        else:
            names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        for table, entry in cut["tables"].items():
            if table not in tables:
                raise ValueError(f"the checkpoint holds table {table!r}, which this model does not have "
                                 f"(its tables: {sorted(tables)})")
            if rank is None:
                blocks = [(table, 0, 0)]
            else:
                blocks = [(n, int(m["row"]), int(m["column"])) for n in names
                          for m in [_SHARD_DIRECTORY.fullmatch(n)] if m is not None and m["table"] == table]
            if len(blocks) != 1:
                raise ValueError(f"table {table!r}: {directory} holds {len(blocks)} shard directories of it "
                                 f"({[b[0] for b in blocks]}) where its cut names one")
            name, row, column = blocks[0]
            found[table].append(StoredShard(table, os.path.join(directory, name), entry["checkpoint"], entry["step"],
                                            row, 0, column, 0))
    return {table: _with_extents(table, shards, *tables[table]) for table, shards in found.items()}


def _with_extents(table: str, shards: List[StoredShard], rows: int, columns: int) -> List[StoredShard]:
    """`shards` with their rows and columns: a block reaches the next block's first row (of the
    same columns) or the table's end, and the next columns' first column or the table's width."""
    column_starts = sorted({s.first_column for s in shards})
    column_stops = dict(zip(column_starts, column_starts[1:] + [columns]))
    row_stops: Dict[Tuple[int, int], int] = {}
    for start in column_starts:
        row_starts = sorted(s.first_row for s in shards if s.first_column == start)
        if row_starts[0] != 0:
            raise ValueError(f"table {table!r}: no stored shard holds its rows from 0 (columns from {start}); "
                             f"a rank's cut is missing from the checkpoint")
        row_stops.update({(r, start): stop for r, stop in zip(row_starts, row_starts[1:] + [rows])})
    if column_starts[0] != 0:
        raise ValueError(f"table {table!r}: no stored shard holds its columns from 0; a rank's cut is missing")
    return sorted((StoredShard(s.table, s.path, s.checkpoint, s.step, s.first_row,
                               row_stops[s.first_row, s.first_column] - s.first_row, s.first_column,
                               column_stops[s.first_column] - s.first_column) for s in shards),
                  key=lambda s: (s.first_column, s.first_row))


def read_shard(shard: StoredShard, layout: RowLayout, chunk_rows: int = 1 << 16, part: str = "all"
               ) -> Iterator[TableRows]:
    """The rows `shard`'s store holds at its checkpoint, as (global ids [n], weights [n, columns] of
    the layout's dtype, optimizer state [n, state_dim] float32) chunks in the log's order, read
    sequentially from a read-only open (nothing is written); `part` as `KVStore.scan`'s ("base":
    those in the base run, in increasing id order). `layout` is the shard's: its embedding_dim is
    the shard's columns. ValueError names the table when its stored rows are another width than
    `layout` gives (the embedding_dim, weight type or optimizer changed)."""
    if layout.embedding_dim != shard.columns:
        raise ValueError(f"table {shard.table!r}: layout of {layout.embedding_dim} columns for a shard of "
                         f"{shard.columns}")
    with open_shard(shard, layout) as store:
        for keys, rows in store.scan(chunk_rows, part):
            yield keys + shard.first_row, layout.weights_of(rows[:, :layout.weight_words]).clone(), \
                rows[:, layout.weight_words:].clone()


def open_shard(shard: StoredShard, layout: RowLayout) -> KVStore:
    """`shard`'s store at its checkpoint, opened read-only (nothing is written); ValueError names the
    table when its stored rows are another width than `layout` gives."""
    words = layout.weight_words + layout.state_dim
    try:
        return KVStore(shard.path, words, torch.float32, _READ_BUDGET, cut_checkpoints=True,
                       checkpoint=shard.checkpoint, key_limit=shard.rows, read_only=True)
    except ValueError as e:
        if "dim" not in str(e):
            raise
        raise ValueError(f"table {shard.table!r}: its stored rows at {shard.path} are not {words} words wide, as "
                         f"{layout.embedding_dim} columns of {layout.dtype} with {type(layout.optimizer).__name__}'s "
                         f"state make them: the table's embedding_dim, weight type or optimizer differs from the "
                         f"run that wrote it ({e})") from e


def fill_shard(bag: Any, first_row: int, first_column: int, sources: List[StoredShard], layout: RowLayout,
               chunk_rows: int = 1 << 16) -> int:
    """Writes into `bag` (a DiskEmbeddingBag holding rows [first_row, first_row + bag.num_embeddings)
    and columns [first_column, first_column + bag.embedding_dim) of a table) every row the stored
    shards `sources` of that table hold in its block, with its optimizer state, and sets its
    optimizer step to theirs; returns the rows written. Rows the sources never wrote stay as the
    bag's own rows never written (the same seed gives the same initial rows). ValueError when the
    columns are split otherwise than the sources' (a column shard's state belongs to its columns)."""
    overlapping = _overlapping(sources, first_row, bag.num_embeddings, first_column, bag.embedding_dim)
    if not same_columns(sources, first_row, bag.num_embeddings, first_column, bag.embedding_dim):
        split = sorted({(s.first_column, s.first_column + s.columns) for s in sources})
        raise ValueError(f"table {sources[0].table!r}: the checkpoint splits its columns as {split}, and this plan "
                         f"holds columns [{first_column}, {first_column + bag.embedding_dim}) in one shard")
    stop_row = first_row + bag.num_embeddings

    def rows_inside() -> Iterator[TableRows]:
        # The base runs' rows first, source after source in id order: they come in increasing id
        # order, which the bag writes once, straight into its base; then the logs' rows.
        for part in ("base", "log"):
            for source in sorted(overlapping, key=lambda s: s.first_row):
                for ids, weights, state in read_shard(source, layout, chunk_rows, part):
                    inside = (ids >= first_row) & (ids < stop_row)
                    if bool(inside.any()):
                        yield ids[inside] - first_row, weights[inside], state[inside] if layout.state_dim else None

    written = 0
    with bag.filling() as write:
        # The next chunks are read while this one is written (both let go of the GIL).
        for ids, weights, state in read_ahead(rows_inside(), depth=2, name="mlkv-fill"):
            write(ids, weights, state)
            written += ids.numel()
    steps = {s.step for s in overlapping}
    if steps:
        bag.steps = max(steps)
    return written


def same_columns(sources: List[StoredShard], first_row: int, rows: int, first_column: int, columns: int) -> bool:
    """Whether the stored shards holding rows [first_row, first_row + rows) of columns
    [first_column, first_column + columns) hold exactly those columns (a block's rows then copy as
    they are)."""
    return all(s.first_column == first_column and s.columns == columns
               for s in _overlapping(sources, first_row, rows, first_column, columns))


def _overlapping(sources: List[StoredShard], first_row: int, rows: int, first_column: int, columns: int
                 ) -> List[StoredShard]:
    return [s for s in sources if s.first_row < first_row + rows and first_row < s.first_row + s.rows
            and s.first_column < first_column + columns and first_column < s.first_column + s.columns]
