"""An export (`python -m mlkv_torch.export`) read back as tables, for a run that starts from it
(``python -m mlkv_torch.train CONFIG --import EXPORT``, any number of processes, any plan): the
manifest's step and tables, each table's rows from its Parquet file a chunk at a time, and the
dense model with its optimizer's state. Each file is checked against the manifest's size and
SHA-256 before any row is read, so a damaged or partial export is refused before a table fills."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .config import ConfigError
from .stored_shards import TableRows
from .virtual_tables import IdsActivity

__all__ = ["ExportedTables", "read_export", "read_export_on_ranks", "file_sha256", "MANIFEST", "DENSE_FILE", "FORMAT",
           "VERSION"]

# The export's layout (`mlkv_torch.export` writes it).
MANIFEST = "manifest.json"
DENSE_FILE = "dense.pt"
FORMAT = "mlkv-torch-tables"
VERSION = 1


@dataclass(frozen=True)
class ExportedTables:
    """The export at `path`: written at training step `step` (`batches` trained by then over all
    ranks) by `processes` processes, its tables (the manifest's entries: rows, dim, dtype,
    optimizer, placement, sharding, file, state, initial_rows) and its dense model's file."""

    path: str
    step: int
    batches: int  # the batches the job trained by `step`, over all its ranks
    processes: int
    tables: Dict[str, Dict[str, Any]]
    dense_file: str

    @property
    def description(self) -> str:
        return f"the export at {self.path}"

    def initial_rows(self, table: str) -> Optional[Dict[str, Any]]:
        """How the rows the table's file lacks start (`WrittenCheckpoint.initial_rows`)."""
        return self.tables[table]["initial_rows"]

    def stored_disk_shards(self, table: str) -> None:
        """An export holds no stores: every table's rows come through `rows`."""
        return None

    def activity(self, table: str) -> Optional[IdsActivity]:
        """A virtual table's ids' history (`WrittenCheckpoint.activity`) from its ids file; None for a
        table that follows no ids (or an export written before exports kept it: an import then counts
        each id it holds as looked up afresh)."""
        import pyarrow.parquet as pq

        entry = self.tables[table].get("activity")
        if entry is None:
            return None
        ids = pq.read_table(os.path.join(self.path, entry["file"]))
        id_, lookups, last, holds_row = (torch.from_numpy(ids.column(c).to_numpy(zero_copy_only=False).copy())
                                         for c in ("id", "lookups", "last", "holds_row"))
        return IdsActivity(id_, lookups, last, holds_row, torch.tensor(entry["evicted"]))

    def rows(self, table: str, chunk_rows: int = 1 << 16) -> Iterator[TableRows]:
        """`table`'s rows in its file, chunk by chunk: (ids, weights [n, dim] float32, optimizer
        state [n, k] float32)."""
        import pyarrow.parquet as pq

        entry = self.tables[table]
        columns = entry["state"]["columns"]
        with pq.ParquetFile(os.path.join(self.path, entry["file"])) as parquet:
            for batch in parquet.iter_batches(batch_size=chunk_rows):
                ids = torch.from_numpy(batch.column("id").to_numpy(zero_copy_only=False).copy())
                weights = _matrix(batch.column("weight"), entry["dim"])
                state = _matrix(batch.column("state"), columns) if columns else torch.zeros(ids.numel(), 0)
                yield ids, weights, state

    def dense_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
        """The dense model ({name: tensor}) and its optimizer's state ({name: {"sum", "step"}})."""
        state = torch.load(os.path.join(self.path, self.dense_file), weights_only=True)
        return state["model"], state["optimizer"]


def _matrix(column: Any, width: int) -> torch.Tensor:
    return torch.from_numpy(column.flatten().to_numpy(zero_copy_only=False).copy()).reshape(-1, width)


def read_export(path: str, share: Tuple[int, int] = (0, 1)) -> ExportedTables:
    """The export at `path`, its manifest and files checked; ConfigError names what is missing,
    of another format, damaged or of another shape than the manifest says. `share` (part, parts):
    only every parts-th file from the part-th is read whole for its checksum (the processes of a
    job divide the reading, `read_export_on_ranks`)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        partial = os.path.exists(path.rstrip("/") + ".partial")
        raise ConfigError(f"{path!r} is not an export: it holds no {MANIFEST}" +
                          (" (an export of it was killed before it finished: export again)" if partial else ""))
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}, not {FORMAT!r}")
        if manifest["version"] != VERSION:
            raise ValueError(f"version {manifest['version']} (this mlkv_torch reads version {VERSION})")
        step, tables = int(manifest["step"]), dict(manifest["tables"])
        dense = manifest.get("dense")
        if dense is None:
            raise ValueError("it records no dense model (an export of an earlier mlkv_torch: export the checkpoint "
                             "again)")
        files = [(name, e["file"], e["bytes"], e["sha256"]) for name, e in tables.items()]
        files += [(f"{name}'s ids", e["activity"]["file"], e["activity"]["bytes"], e["activity"]["sha256"])
                  for name, e in tables.items() if "activity" in e]
        files.append(("the dense model", dense["file"], dense["bytes"], dense["sha256"]))
        processes = int(manifest["written_by"]["processes"])
        batches = int(manifest.get("batches", step * processes))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{manifest_path}: not a manifest this mlkv_torch reads: {e}") from e
    part, parts = share
    for i, (what, file_name, size, sha256) in enumerate(files):
        _check_file(path, what, file_name, size, sha256 if i % parts == part else None)
    for name, entry in tables.items():
        _check_schema(os.path.join(path, entry["file"]), name, entry)
    return ExportedTables(path, step, batches, processes, tables, dense["file"])


def read_export_on_ranks(path: str) -> ExportedTables:
    """`read_export` by every rank of the default process group, each reading its share of the
    files for their checksums (one read of the export in all, not one a rank); a problem any rank
    finds is raised on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    exported, problem = None, None
    try:
        exported = read_export(path, (rank, world))
    except ConfigError as e:
        problem = str(e)
    problems: List[Optional[str]] = [None] * world
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise ConfigError(found)
    assert exported is not None
    return exported


def _check_file(path: str, what: str, file_name: str, size: int, sha256: Optional[str]) -> None:
    """ConfigError unless the file is there with its size and, unless `sha256` is None, its checksum."""
    full = os.path.join(path, file_name)
    if not os.path.isfile(full):
        raise ConfigError(f"the export at {path!r} lacks {file_name} ({what}'s file)")
    if os.path.getsize(full) != size or (sha256 is not None and file_sha256(full) != sha256):
        raise ConfigError(f"{full} ({what}) is damaged: its size or SHA-256 differs from the manifest's")


def _check_schema(full: str, table: str, entry: Dict[str, Any]) -> None:
    """ConfigError unless the table's file has the columns and widths the manifest says."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(full)
    expected = [("id", None), ("weight", entry["dim"])] + \
        ([("state", entry["state"]["columns"])] if entry["state"]["columns"] else [])
    for column, width in expected:
        index = schema.get_field_index(column)
        kind = schema.field(index).type if index >= 0 else None
        fits = kind is not None and (kind == pa.int64() if width is None else
                                     pa.types.is_fixed_size_list(kind) and kind.list_size == width
                                     and kind.value_type == pa.float32())
        if not fits:
            wanted = "int64" if width is None else f"a fixed-size list of {width} float32"
            raise ConfigError(f"{full} (table {table!r}): column {column!r} should be {wanted}, it is "
                              f"{kind if kind is not None else 'missing'}")


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's content, as the manifest records it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
