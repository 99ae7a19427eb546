"""A disk table: its record (TABLE.json: size, seed, how its rows start), how a table is
created, reopened and destroyed on disk, and where its directory is."""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .checks import is_int
from .cut import read_json_record, write_json_record
from .store import KVStore, RocksDBStore, initial_rows
from .virtual_tables import IdPolicy


TABLE_RECORD = "TABLE.json"


def draw_seed() -> int:
    """The seed of tables built without one (``seed=None``), read from the state of torch's
    default generator: after the same ``torch.manual_seed`` (and the same random draws since),
    tables start from the same rows, as EmbeddingBagCollection's do. It draws nothing: the
    model's other layers, and TorchRec's own tables, initialise as they would without it."""
    return zlib.crc32(torch.get_rng_state().numpy().tobytes()) & 0x7FFFFFFF


def _read_record(table_path: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(table_path, TABLE_RECORD)
    record = read_json_record(path, "the seed of the table's initial rows")
    if record is None:
        return None
    if not isinstance(record, dict) or isinstance(record.get("seed"), bool) or not isinstance(record.get("seed"), int):
        raise ValueError(f"{path} is corrupted: it records no integer 'seed', got {record!r}")
    return record


def _write_record(table_path: str, record: Dict[str, Any]) -> None:
    write_json_record(os.path.join(table_path, TABLE_RECORD), record)


def destroy_table(path: str) -> None:
    """Deletes a closed table's files: its KVStore's and its record (what a table that holds no
    rows yet needs to reopen with another row layout)."""
    KVStore.destroy(path)
    for name in (TABLE_RECORD, TABLE_RECORD + ".tmp"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class DiskTable:
    """One table of a DiskTableBatch.

    Args:
        name: named in errors and stats.
        num_embeddings: rows; ids must lie in [0, num_embeddings).
        path: the directory of its store.
        seed: seed of the initial values of its rows never written.
        first_column: the table holds columns [first_column, first_column + dim) of a wider
            table (a column shard); its initial rows are that slice of the wider table's.
        expected_rows: pre-sizes the store's index for this many rows; by default it starts at
            a bucket (64 bytes) and grows with the rows written, whatever num_embeddings.
        init: how rows never written start: ("uniform", low, high) or ("normal", mean, std);
            default TorchRec's ("uniform", -sqrt(1/num_embeddings), sqrt(1/num_embeddings)).
        seed_drawn: `seed` was drawn (``seed=None``), not chosen: a reopened table keeps the
            seed it was created with (a chosen seed must equal it).
        first_row: the table holds rows [first_row, first_row + num_embeddings) of a longer
            table (a row shard, its ids local to its block); its initial rows are that block of the
            longer table's.
        id_policy: a virtual table's rules for its ids (`mlkv_torch.virtual_tables.IdPolicy`):
            the frequency filter and eviction; None: every id looked up keeps its row.
    """

    name: str
    num_embeddings: int
    path: str
    seed: int = 0
    first_column: int = 0
    expected_rows: Optional[int] = None
    init: Optional[Tuple[str, float, float]] = None
    seed_drawn: bool = False
    first_row: int = 0
    id_policy: Optional[IdPolicy] = None

    def __post_init__(self) -> None:
        if not is_int(self.num_embeddings) or self.num_embeddings <= 0:
            raise ValueError(f"num_embeddings must be a positive int, got {self.num_embeddings!r}")
        for name in ("first_column", "first_row"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        if self.init is not None and (len(self.init) != 3 or self.init[0] not in ("uniform", "normal")):
            raise ValueError(f"table {self.name!r}: init must be ('uniform', low, high) or ('normal', mean, std), "
                             f"got {self.init!r}")

    def initial_distribution(self) -> Tuple[str, float, float]:
        """("uniform", low, high) or ("normal", mean, std) of the rows never written."""
        if self.init is not None:
            return self.init[0], float(self.init[1]), float(self.init[2])
        bound = (1.0 / self.num_embeddings) ** 0.5
        return "uniform", -bound, bound

    def initial_rows(self, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows `ids` hold until written (what the cache generates for them)."""
        kind, a, b = self.initial_distribution()
        params = dict(mean=a, std=b) if kind == "normal" else dict(low=a, high=b)
        return initial_rows(ids + self.first_row, dim, seed=self.seed, dtype=dtype, first_column=self.first_column,
                            **params)


def settle_reopened(tables: Sequence[DiskTable], stores: Sequence[Union[KVStore, RocksDBStore]], reopen: bool
                     ) -> List[DiskTable]:
    """The tables as their directories have them. A directory that holds rows from an earlier run
    is reopened only when `reopen` says so; a reopened table keeps the seed it was created with (its
    rows never written must not change), and a fresh one records its seed."""
    records = [_read_record(t.path) for t in tables]
    # A KVStore counts its rows; for RocksDB a record says an earlier run opened the table.
    holds = [len(store) > 0 if isinstance(store, KVStore) else record is not None
             for store, record in zip(stores, records)]
    held = [f"{t.name!r} at {t.path}" + (f" ({len(store):,} rows)" if isinstance(store, KVStore) else "")
            for t, store, h in zip(tables, stores, holds) if h]
    if held and not reopen:  # a second run of a script would otherwise continue silently from the first's rows
        raise FileExistsError(f"{'; '.join(held)}: the directory holds rows and optimizer state from an earlier run. "
                              f"Pass reopen=True to continue from them, or remove them (mlkv_torch.remove_tables) "
                              f"to start from initial rows")
    settled = []
    for t, record, h in zip(tables, records, holds):
        if record is not None and (h or reopen):
            if not t.seed_drawn and record["seed"] != t.seed:
                raise ValueError(f"table {t.name!r} at {t.path} was created with seed {record['seed']}, not {t.seed}: "
                                 f"its rows never written derive from it. Pass that seed, or none")
            t = replace(t, seed=record["seed"])
        else:
            _write_record(t.path, {"seed": t.seed})
        settled.append(t)
    return settled


def directory_path(path: Union[str, os.PathLike]) -> str:
    """`path` as a str; TypeError naming the argument when it is not a path (None, say)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (the tables' directory), got {type(path).__name__}")
    return os.fspath(path)
