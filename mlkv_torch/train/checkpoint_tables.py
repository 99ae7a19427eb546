"""A runner's checkpoint read as tables, whatever world wrote it (`WrittenCheckpoint`): each
table's rows with their optimizer state, from the stores of disk tables (at the cut the
checkpoint names, opened read-only), from the ranks' files for tables TorchRec kept in memory
(each rank's shards) or replicated (rank 0's copy). Nothing of the checkpoint is written."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..config import ConfigError
from ..cut import read_json_record
from ..disk_table import TABLE_RECORD
from ..row_layout import RowLayout
from ..store import KVStore
from ..stored_shards import StoredShard, read_shard, stored_shards
from . import checkpoints

__all__ = ["WrittenCheckpoint", "written_checkpoint", "TableRows"]

TableRows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (ids [n], weights [n, dim], state [n, k])

# What each column of a table's optimizer state holds, by optimizer (the disk tables' rules and
# FBGEMM's fused ones keep the same state).
_STATE_MEANING = {
    "sgd": "none",
    "adagrad": "Adagrad's sum of squared gradients, one per element",
    "rowwise_adagrad": "row-wise Adagrad's accumulator: the mean over the row of squared gradients, summed over "
                       "steps",
    "adam": "Adam's first moments (dim columns), then its second moments (dim columns)",
}
_DENSE_STATE_MEANING = "the dense optimizer's (torch.optim.Adagrad) sum of squared gradients, one per element"


@dataclass(frozen=True)
class WrittenCheckpoint:
    """The checkpoint a run left in `output_dir`: written by `processes` processes (one process
    without torchrun, `one_process`, or the ranks of a torchrun job) at training step `step`, its
    tables (`checkpoints.TABLES_KEY`'s record), the cut of each process's disk tables (under None
    for one process, else by rank), and its state files (checkpoint.pt, or each rank's)."""

    output_dir: str
    tables_dir: str
    one_process: bool
    processes: int
    step: int
    tables: Dict[str, Dict[str, Any]]
    cuts: Dict[Optional[int], Optional[Dict[str, Any]]]
    state_files: List[str]

    def state_meaning(self, table: str) -> str:
        """What the columns of `table`'s optimizer state hold."""
        entry = self.tables[table]
        return _DENSE_STATE_MEANING if entry["sharding"] == "data_parallel" else _STATE_MEANING[entry["optimizer"]]

    @functools.cached_property
    def _stored_shards(self) -> Dict[str, List[StoredShard]]:
        return stored_shards(self.tables_dir, self.cuts, {n: (e["rows"], e["dim"]) for n, e in self.tables.items()})

    def disk_shards(self, table: str) -> List[StoredShard]:
        """The stored shards of the disk table `table`."""
        return self._stored_shards[table]

    def initial_rows(self, table: str) -> Optional[Dict[str, Any]]:
        """How the rows a disk table never wrote start: {"seed", "distribution": [kind, a, b]}, the
        arguments of `mlkv_torch.store.initial_rows` (None for a table in memory: every row is
        in the checkpoint)."""
        if self.tables[table]["placement"] != "disk":
            return None
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        from ..torchrec.tables import initial_distribution_of

        entry = self.tables[table]
        record = read_json_record(os.path.join(self.disk_shards(table)[0].path, TABLE_RECORD), "the table's seed")
        config = EmbeddingBagConfig(name=table, num_embeddings=entry["rows"], embedding_dim=entry["dim"],
                                    feature_names=[table])
        return {"seed": record["seed"] if record else None, "distribution": list(initial_distribution_of(config))}

    def rows(self, table: str, chunk_rows: int = 1 << 16) -> Iterator[TableRows]:
        """`table`'s rows at the checkpoint, chunk by chunk: (ids, weights [n, dim] float32,
        optimizer state [n, k] float32). A disk table gives the rows it wrote (the others are its
        initial rows, `initial_rows`); a table in memory gives every row."""
        entry = self.tables[table]
        if entry["placement"] == "disk":
            yield from _disk_rows(self.disk_shards(table), _layout(entry, entry["dim"]), chunk_rows)
        elif entry["sharding"] == "data_parallel":
            yield from self._replicated_rows(table, chunk_rows)
        else:
            yield from self._sharded_rows(table)

    def _rank_state(self, rank: int) -> Dict[str, Any]:
        return torch.load(self.state_files[rank], weights_only=True, mmap=True)

    def _replicated_rows(self, table: str, chunk_rows: int) -> Iterator[TableRows]:
        """A replicated table: rank 0's copy, and the dense optimizer's state of it."""
        state = self._rank_state(0)
        weight = _entry(state["model"], _weight_key(table), table)
        optimizer_state = _entry(state["optim"]["state"], _weight_key(table), table, default={})
        accumulator = optimizer_state.get("sum", torch.zeros(weight.shape[0], 0))
        for start in range(0, weight.shape[0], chunk_rows):
            stop = min(start + chunk_rows, weight.shape[0])
            yield torch.arange(start, stop), weight[start:stop].clone(), accumulator[start:stop].reshape(
                stop - start, -1).clone()

    def _sharded_rows(self, table: str) -> Iterator[TableRows]:
        """A table TorchRec sharded in memory: each rank's row blocks of every column, and their
        fused optimizer's state (its momentums, [rows] or [rows, dim] each)."""
        for rank in range(self.processes):
            state = self._rank_state(rank)
            weight = _entry(state["model"], _weight_key(table), table)
            optimizer_state = _entry(state["optim"]["state"], _weight_key(table), table, default={})
            moments = [optimizer_state[k]["local_shards"] for k in sorted(optimizer_state)
                       if k.startswith(f"{table}.momentum")]
            for i, (offsets, rows) in enumerate(weight["local_shards"]):
                if offsets[1] != 0 or rows.shape[1] != self.tables[table]["dim"]:
                    raise ConfigError(f"table {table!r} is sharded column-wise in memory: reading such a table "
                                      f"out of a checkpoint is not supported yet")
                state_columns = [m[i][1].reshape(rows.shape[0], -1) for m in moments]
                yield (torch.arange(offsets[0], offsets[0] + rows.shape[0]), rows.clone(),
                       torch.cat(state_columns, dim=1) if state_columns else torch.zeros(rows.shape[0], 0))


def _weight_key(table: str) -> str:
    return f"embedding_bags.{table}.weight"


def _entry(state: Dict[str, Any], suffix: str, table: str, default: Any = None) -> Any:
    """The value of `state` whose key ends with `suffix`."""
    found = [v for k, v in state.items() if k.endswith(suffix)]
    if not found and default is None:
        raise ConfigError(f"table {table!r}: the checkpoint's state holds no {suffix}")
    return found[0] if found else default


def _layout(entry: Dict[str, Any], columns: int) -> RowLayout:
    from .experiment import _OPTIMIZERS

    rule = _OPTIMIZERS[entry["optimizer"]](lr=1.0)  # the learning rate does not shape the rows
    return RowLayout(columns, getattr(torch, entry["dtype"]), rule)


def _disk_rows(shards: List[StoredShard], layout: RowLayout, chunk_rows: int) -> Iterator[TableRows]:
    """The rows a disk table's stores hold: each row block's, its columns joined across the column
    shards (rows are written in every column shard together: the first's keys are read from the
    others)."""
    by_columns: Dict[int, List[StoredShard]] = {}
    for shard in shards:
        by_columns.setdefault(shard.first_column, []).append(shard)
    first, *others = sorted(by_columns)
    for block in by_columns[first]:
        partners = [next(s for s in by_columns[c] if s.first_row == block.first_row) for c in others]
        stores = [_open_read_only(s, _layout_of(layout, s.columns)) for s in partners]
        try:
            for ids, weights, state in read_shard(block, _layout_of(layout, block.columns), chunk_rows):
                weight_parts, state_parts = [weights], [state]
                for partner, store in zip(partners, stores):
                    part = _layout_of(layout, partner.columns)
                    words = store.get(ids - partner.first_row)
                    weight_parts.append(part.weights_of(words[:, :part.weight_words]))
                    state_parts.append(words[:, part.weight_words:])
                yield ids, torch.cat(weight_parts, dim=1).float(), torch.cat(state_parts, dim=1)
        finally:
            for store in stores:
                store.close()


def _layout_of(layout: RowLayout, columns: int) -> RowLayout:
    return RowLayout(columns, layout.dtype, layout.optimizer)


def _open_read_only(shard: StoredShard, layout: RowLayout) -> KVStore:
    return KVStore(shard.path, layout.weight_words + layout.state_dim, torch.float32, 16 << 20, cut_checkpoints=True,
                   checkpoint=shard.checkpoint, key_limit=shard.rows, read_only=True)


def written_checkpoint(output_dir: str, tables_dir: Optional[str] = None) -> Optional[WrittenCheckpoint]:
    """The checkpoint `output_dir` holds (None when it holds none); its disk tables under
    `tables_dir` (default ``output_dir/tables``). ConfigError names a checkpoint written by a
    version that did not record its tables, and one with both kinds of checkpoint."""
    tables_dir = tables_dir if tables_dir is not None else os.path.join(output_dir, "tables")
    one_process = os.path.join(output_dir, checkpoints.ONE_PROCESS_CHECKPOINT)
    pointer = os.path.join(output_dir, checkpoints.SHARDED_CHECKPOINT_POINTER)
    if os.path.exists(one_process) and os.path.exists(pointer):
        raise ConfigError(f"{output_dir!r} holds a checkpoint of one process ({checkpoints.ONE_PROCESS_CHECKPOINT}) "
                          f"and one of a torchrun job ({checkpoints.SHARDED_CHECKPOINT_POINTER}): remove the one "
                          f"you do not mean")
    if os.path.exists(one_process):
        state = checkpoints.load_checkpoint(one_process)
        return WrittenCheckpoint(output_dir, tables_dir, True, 1, int(state["step"]),
                                 _tables_of(state, one_process), {None: state.get("cut")}, [one_process])
    if os.path.exists(pointer):
        with open(pointer) as f:
            record = json.load(f)
        directory = os.path.join(output_dir, record["directory"])
        cuts = {int(rank): cut for rank, cut in record["cuts"].items()}
        files = [os.path.join(directory, f"rank{r}.pt") for r in range(len(cuts))]
        step = int(record["directory"].rsplit("-", 1)[1])
        return WrittenCheckpoint(output_dir, tables_dir, False, len(cuts), step, _tables_of(record, pointer), cuts,
                                 files)
    return None


def _tables_of(record: Dict[str, Any], path: str) -> Dict[str, Dict[str, Any]]:
    tables = record.get(checkpoints.TABLES_KEY)
    if not isinstance(tables, dict):
        raise ConfigError(f"{path} does not record its tables (written by an earlier mlkv_torch): reading it needs a "
                          f"checkpoint written by this version; resume it and let it take one")
    return tables
