"""Exports a run's checkpoint as tables any tool reads, whatever world wrote it:

    python -m mlkv_torch.export OUTPUT_DIR OUT [--tables DIR]... [--chunk-rows N]

OUT gets one Parquet file per table (columns ``id`` int64, ``weight`` and, with optimizer state,
``state``: fixed-size lists of float32), ``dense.pt`` (the dense model and its optimizer's state
by parameter name, for ``torch.load``) and ``manifest.json``: the step and the batches trained by
then, each table's rows, columns, optimizer and placement, what its state columns hold, how the
rows a disk table never wrote start, and each file's rows, bytes and SHA-256. A virtual table's ids'
history goes to ``<table>.ids.parquet`` (``id``, ``lookups`` float32, ``last`` int64, ``holds_row``
bool; the ids its rounds evicted so far in the manifest), so an import judges each id by it as a
reshard does. Rows stream a chunk at a time; the
checkpoint is only read (its stores opened read-only), and OUT appears whole or not at all
(it is written as OUT.partial, then renamed). A run starts from an export with
``python -m mlkv_torch.train CONFIG --import OUT`` (`mlkv_torch.exported_tables`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

from .config import ConfigError
from .exported_tables import DENSE_FILE, FORMAT, MANIFEST, VERSION, file_sha256
from .read_ahead import read_ahead
from .stored_shards import stored_shards
from .train.checkpoint_tables import WrittenCheckpoint, written_checkpoint
from .virtual_tables import IdsActivity

__all__ = ["export_checkpoint"]


def export_checkpoint(output_dir: str, out: str, tables_dir: Union[str, Sequence[str], None] = None,
                      chunk_rows: int = 1 << 16) -> Dict[str, Any]:
    """Writes the checkpoint in `output_dir` (its disk tables under `tables_dir`, default
    ``output_dir/tables``; several: each node's `storage.path`, a rank's tables read from the one
    that holds them) to `out` as Parquet files and a manifest; returns the manifest. ConfigError
    names an output_dir without a checkpoint, a rank whose tables none of them holds, and an `out`
    that exists or cannot be written."""
    paths = [tables_dir] if tables_dir is None or isinstance(tables_dir, str) else list(tables_dir)
    checkpoint = written_checkpoint(output_dir, paths[0])
    if checkpoint is None:
        raise ConfigError(f"{output_dir!r} holds no checkpoint of a run (checkpoint.pt or checkpoint.latest): set "
                          f"train.checkpoint_every to take them")
    checkpoint.check_tables_recorded()
    if len(paths) > 1:
        tables = {name: (entry["rows"], entry["dim"]) for name, entry in checkpoint.tables.items()}
        try:
            shards = stored_shards([os.path.join(p, checkpoint.generation) for p in paths], checkpoint.cuts, tables)
        except ValueError as e:
            raise ConfigError(f"{checkpoint.description}: {e}") from e
        checkpoint = dataclasses.replace(checkpoint, shards=shards)
    if os.path.exists(out):
        raise ConfigError(f"{out!r} exists: export into a path that does not")
    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # an export killed before
    try:
        os.makedirs(partial)
    except OSError as e:
        raise ConfigError(f"{out!r} cannot be written: cannot create {partial!r} ({e.strerror or e})") from e
    manifest = {"format": FORMAT, "version": VERSION, "step": checkpoint.step, "batches": checkpoint.batches,
                "written_by": {"processes": checkpoint.processes, "one_process": checkpoint.one_process},
                "tables": {name: _export_table(checkpoint, name, partial, chunk_rows)
                           for name in sorted(checkpoint.tables)},
                "dense": _export_dense(checkpoint, partial)}
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(partial, out)
    return manifest


def _export_table(checkpoint: WrittenCheckpoint, name: str, directory: str, chunk_rows: int) -> Dict[str, Any]:
    """Writes table `name` to ``directory/<name>.parquet``; its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entry = dict(checkpoint.tables[name])
    file_name = f"{name}.parquet"
    path = os.path.join(directory, file_name)
    writer: Optional[Any] = None
    rows, state_columns = 0, 0
    try:
        for ids, weights, state in read_ahead(checkpoint.rows(name, chunk_rows), depth=2, name="mlkv-export"):
            state_columns = state.shape[1]
            columns: List[Any] = [pa.array(ids.numpy()), _fixed_lists(weights)]
            names = ["id", "weight"]
            if state_columns:
                columns.append(_fixed_lists(state))
                names.append("state")
            batch = pa.RecordBatch.from_arrays(columns, names=names)
            if writer is None:
                writer = pq.ParquetWriter(path, batch.schema, compression="none")
            writer.write_batch(batch)
            rows += ids.numel()
    finally:
        if writer is not None:
            writer.close()
    if writer is None:  # no rows: an empty file of the table's schema
        fields = [pa.field("id", pa.int64()), pa.field("weight", pa.list_(pa.float32(), entry["dim"]))]
        pq.write_table(pa.schema(fields).empty_table(), path)
    entry.update(file=file_name, rows_in_file=rows, bytes=os.path.getsize(path), sha256=file_sha256(path),
                 state={"columns": state_columns, "holds": checkpoint.state_meaning(name)},
                 initial_rows=checkpoint.initial_rows(name))
    activity = checkpoint.activity(name)
    if activity is not None:
        entry["activity"] = _export_activity(activity, directory, f"{name}.ids.parquet")
    return entry


def _export_activity(activity: IdsActivity, directory: str, file_name: str) -> Dict[str, Any]:
    """A virtual table's ids' history, to ``directory/file_name``; its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(directory, file_name)
    pq.write_table(pa.table({"id": activity.ids.numpy(), "lookups": activity.counts.float().numpy(),
                             "last": activity.last.numpy(), "holds_row": activity.holds_row.numpy()}), path,
                   compression="none")
    return {"file": file_name, "ids": int(activity.ids.numel()), "evicted": int(activity.evicted),
            "bytes": os.path.getsize(path), "sha256": file_sha256(path)}


def _export_dense(checkpoint: WrittenCheckpoint, directory: str) -> Dict[str, Any]:
    """Writes the dense model and its optimizer's state to ``directory/dense.pt``; its manifest entry."""
    import torch

    model, optimizer = checkpoint.dense_state()
    path = os.path.join(directory, DENSE_FILE)
    torch.save({"model": {k: v.clone() for k, v in model.items()},
                "optimizer": {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.items()}}, path)
    return {"file": DENSE_FILE, "parameters": sorted(model), "bytes": os.path.getsize(path),
            "sha256": file_sha256(path)}


def _fixed_lists(values: Any) -> Any:
    import pyarrow as pa

    flat = values.float().contiguous().reshape(-1).numpy()
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), values.shape[1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.export",
                                     description="Export a run's checkpoint (any number of processes wrote it) as "
                                                 "one Parquet file per table, the dense model (dense.pt) and a "
                                                 "manifest; a run starts from it with python -m mlkv_torch.train "
                                                 "CONFIG --import OUT.")
    parser.add_argument("output_dir", help="the run's output_dir, which holds its checkpoint")
    parser.add_argument("out", help="the directory to write (it must not exist)")
    parser.add_argument("--tables", action="append", default=None,
                        help="where the run kept its disk tables (its storage.path); default OUTPUT_DIR/tables. "
                             "Give it once a node where each node kept its own (each node's storage.path, seen "
                             "from here)")
    parser.add_argument("--chunk-rows", type=int, default=1 << 16, help="rows read and written at a time")
    args = parser.parse_args(argv)
    try:
        manifest = export_checkpoint(args.output_dir, args.out, args.tables, args.chunk_rows)
    except ConfigError as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    rows = sum(t["rows_in_file"] for t in manifest["tables"].values())
    print(f"[export] step {manifest['step']}: {len(manifest['tables'])} tables, {rows:,} rows, to {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
