"""A runner's checkpoint read as tables, whatever world wrote it (`WrittenCheckpoint`): each
table's rows with their optimizer state, from the stores of disk tables (at the cut the
checkpoint names, opened read-only), from the ranks' files for tables TorchRec kept in memory
(each rank's shards) or replicated (rank 0's copy). Nothing of the checkpoint is written."""
from __future__ import annotations

import dataclasses
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
from ..stored_shards import StoredShard, TableRows, open_shard, read_shard, stored_shards
from ..virtual_tables import IdsActivity, saved_activity
from . import checkpoints

__all__ = ["WrittenCheckpoint", "written_checkpoint", "read_pointer"]


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
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # a dense model's buffers: no optimizer state


@dataclass(frozen=True)
class WrittenCheckpoint:
    """The checkpoint a run left in `output_dir`: written by `processes` processes (one process
    without torchrun, `one_process`, or the ranks of a torchrun job) at training step `step`, its
    tables (`checkpoints.TABLES_KEY`'s record), the cut of each process's disk tables (under None
    for one process, else by rank) in `tables_dir`, and its state files (checkpoint.pt, or each
    rank's)."""

    output_dir: str
    tables_dir: str
    one_process: bool
    processes: int
    step: int
    tables: Dict[str, Dict[str, Any]]
    cuts: Dict[Optional[int], Optional[Dict[str, Any]]]
    state_files: List[str]
    generation: str  # the directory under the run's tables path that holds its tables ("": the path itself)
    batches: int  # the batches trained by `step` (`checkpoints.BATCHES_KEY`)
    # Each disk table's stored shards where they are not all in `tables_dir` (some received from
    # another node: `shards_over_ranks`); None: found there.
    shards: Optional[Dict[str, List[StoredShard]]] = None

    @property
    def description(self) -> str:
        return f"the checkpoint at step {self.step} in {self.output_dir}"

    def check_tables_recorded(self) -> None:
        """ConfigError when the checkpoint does not record its tables (an earlier version's), which
        reading it as tables needs."""
        if not isinstance(self.tables, dict):
            where = self.state_files[0] if self.one_process else os.path.join(
                self.output_dir, checkpoints.SHARDED_CHECKPOINT_POINTER)
            raise ConfigError(f"{where} does not record its tables (written by an earlier mlkv_torch): it resumes on "
                              f"as many processes as wrote it, and its next checkpoint can be read as tables "
                              f"(exported, resumed on another number of processes)")

    def state_meaning(self, table: str) -> str:
        """What the columns of `table`'s optimizer state hold."""
        entry = self.tables[table]
        return _DENSE_STATE_MEANING if entry["sharding"] == "data_parallel" else _STATE_MEANING[entry["optimizer"]]

    @functools.cached_property
    def _stored_shards(self) -> Dict[str, List[StoredShard]]:
        if self.shards is not None:
            return self.shards
        try:
            return stored_shards(self.tables_dir, self.cuts, {n: (e["rows"], e["dim"]) for n, e in self.tables.items()})
        except ValueError as e:  # a rank's tables missing or incomplete
            raise ConfigError(f"{self.description}: {e}") from e

    def disk_shards(self, table: str) -> List[StoredShard]:
        """The stored shards of the disk table `table`."""
        return self._stored_shards[table]

    def stored_disk_shards(self, table: str) -> Optional[List[StoredShard]]:
        """`table`'s stored shards where it is on disk (a reshard may copy their rows as they are);
        None for a table in memory."""
        return self.disk_shards(table) if self.tables[table]["placement"] == "disk" else None

    @functools.cached_property
    def _activity(self) -> Dict[str, IdsActivity]:
        return saved_activity((s.path, s.step) for shards in self._stored_shards.values() for s in shards)

    def activity(self, table: str) -> Optional[IdsActivity]:
        """The activity of a virtual disk table's ids at the checkpoint (lookups counted, last
        looked up, holding a row), in the table's ids; None for a table that follows no ids."""
        return self._activity.get(table) if self.tables[table]["placement"] == "disk" else None

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
            yield from _disk_rows(self.disk_shards(table), row_layout_of(entry, entry["dim"]), chunk_rows)
        elif entry["sharding"] == "data_parallel":
            yield from self._replicated_rows(table, chunk_rows)
        else:
            yield from self._sharded_rows(table, chunk_rows)

    def dense_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
        """The dense model ({name: tensor}) and its optimizer's state ({name: {"sum", "step"}}), by
        the names a DLRM of the runner gives them in both worlds."""
        state = torch.load(self.state_files[0], weights_only=True, mmap=True)
        if self.one_process:
            dense = state["dense"]
            params = [name for name in dense if not name.endswith(_BUFFERS)]
            by_index = state["dense_optimizer"]["state"]
            return dense, {params[int(i)]: value for i, value in by_index.items()}
        tables = tuple(weight_key(t) for t in self.tables)
        dense = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor) and not k.endswith(tables)}
        return dense, {k: v for k, v in state["optim"]["state"].items() if not k.endswith(tables)}

    def _rank_state(self, rank: int) -> Dict[str, Any]:
        return torch.load(self.state_files[rank], weights_only=True, mmap=True)

    def _replicated_rows(self, table: str, chunk_rows: int) -> Iterator[TableRows]:
        """A replicated table: rank 0's copy, and the dense optimizer's state of it."""
        state = self._rank_state(0)
        weight = state_entry(state["model"], weight_key(table), table)
        optimizer_state = state_entry(state["optim"]["state"], weight_key(table), table, default={})
        accumulator = optimizer_state.get("sum", torch.zeros(weight.shape[0], 0))
        for start in range(0, weight.shape[0], chunk_rows):
            stop = min(start + chunk_rows, weight.shape[0])
            yield torch.arange(start, stop), weight[start:stop].clone(), accumulator[start:stop].reshape(
                stop - start, -1).clone()

    def _sharded_rows(self, table: str, chunk_rows: int) -> Iterator[TableRows]:
        """A table TorchRec sharded in memory: its row blocks, each with its columns joined across
        the ranks' column blocks, and their fused optimizer's state (its momentums, [rows] or
        [rows, columns] a block) joined as the rule keeps a whole row's."""
        entry = self.tables[table]
        # first row -> (first column, weights, momentums [rows, k] each): views of the mmapped files.
        blocks: Dict[int, List[Tuple[int, torch.Tensor, List[torch.Tensor]]]] = {}
        for rank in range(self.processes):
            state = self._rank_state(rank)
            weight = state_entry(state["model"], weight_key(table), table)
            optimizer_state = state_entry(state["optim"]["state"], weight_key(table), table, default={})
            moments = [optimizer_state[k]["local_shards"] for k in sorted(optimizer_state)
                       if k.startswith(f"{table}.momentum")]
            for i, (offsets, rows) in enumerate(weight["local_shards"]):  # a block's momentums: the i-th shards
                blocks.setdefault(offsets[0], []).append((offsets[1], rows,
                                                          [m[i][1].reshape(rows.shape[0], -1) for m in moments]))
        rule = row_layout_of(entry, entry["dim"]).optimizer
        for first_row in sorted(blocks):
            parts = sorted(blocks[first_row], key=lambda part: part[0])
            widths = [r.shape[1] for _, r, _ in parts]
            if [c for c, _, _ in parts] != [sum(widths[:i]) for i in range(len(parts))] or sum(widths) != entry["dim"]:
                raise ConfigError(f"table {table!r}: the checkpoint's blocks of rows from {first_row} do not hold "
                                  f"its {entry['dim']} columns once each (columns from {[c for c, _, _ in parts]})")
            for start in range(0, parts[0][1].shape[0], chunk_rows):
                stop = min(start + chunk_rows, parts[0][1].shape[0])
                yield (torch.arange(first_row + start, first_row + stop),
                       torch.cat([r[start:stop] for _, r, _ in parts], dim=1).clone(),
                       rule.joined_state([torch.cat([m[start:stop] for m in held], dim=1) if held else
                                          torch.zeros(stop - start, 0) for _, _, held in parts], widths).clone())


def weight_key(table: str) -> str:
    return f"embedding_bags.{table}.weight"


def state_entry(state: Dict[str, Any], suffix: str, table: str, default: Any = None) -> Any:
    """The value of `state` whose key ends with `suffix`."""
    found = [v for k, v in state.items() if k.endswith(suffix)]
    if not found and default is None:
        raise ConfigError(f"table {table!r}: the checkpoint's state holds no {suffix}")
    return found[0] if found else default


def row_layout_of(entry: Dict[str, Any], columns: int) -> RowLayout:
    from .experiment import _OPTIMIZERS

    rule = _OPTIMIZERS[entry["optimizer"]](lr=1.0)  # the learning rate does not shape the rows
    return RowLayout(columns, getattr(torch, entry["dtype"]), rule)


def _disk_rows(shards: List[StoredShard], layout: RowLayout, chunk_rows: int) -> Iterator[TableRows]:
    """The rows a disk table's stores hold: each row block's, its columns joined across the column
    shards (rows are written in every column shard together: the first's keys are read from the
    others); the base runs' rows first, block after block, in increasing id order (a table filled
    from them loads them straight into its base, `KVStore.filling`), then the logs'."""
    by_columns: Dict[int, List[StoredShard]] = {}
    for shard in shards:
        by_columns.setdefault(shard.first_column, []).append(shard)
    first, *others = sorted(by_columns)
    for part, block in [(part, block) for part in ("base", "log")
                        for block in sorted(by_columns[first], key=lambda s: s.first_row)]:
        partners = [next(s for s in by_columns[c] if s.first_row == block.first_row) for c in others]
        stores = [open_shard(s, _layout_of(layout, s.columns)) for s in partners]
        try:
            for ids, weights, state in read_shard(block, _layout_of(layout, block.columns), chunk_rows, part):
                weight_parts, state_parts = [weights], [state]
                for partner, store in zip(partners, stores):
                    columns = _layout_of(layout, partner.columns)
                    words = store.get(ids - partner.first_row)
                    weight_parts.append(columns.weights_of(words[:, :columns.weight_words]))
                    state_parts.append(words[:, columns.weight_words:])
                yield ids, torch.cat(weight_parts, dim=1).float(), layout.optimizer.joined_state(
                    state_parts, [block.columns] + [p.columns for p in partners])
        finally:
            for store in stores:
                store.close()


def _layout_of(layout: RowLayout, columns: int) -> RowLayout:
    return dataclasses.replace(layout, embedding_dim=columns)


def written_checkpoint(output_dir: str, tables_path: Optional[str] = None) -> Optional[WrittenCheckpoint]:
    """The checkpoint `output_dir` holds (None when it holds none), its disk tables under
    `tables_path` (default ``output_dir/tables``; the generation the checkpoint names beneath).
    Where a reshard left both kinds (killed before it removed the one it read), the newer."""
    tables_path = tables_path if tables_path is not None else os.path.join(output_dir, "tables")
    one_process = os.path.join(output_dir, checkpoints.ONE_PROCESS_CHECKPOINT)
    pointer = os.path.join(output_dir, checkpoints.SHARDED_CHECKPOINT_POINTER)
    found = [p for p in (one_process, pointer) if os.path.exists(p)]
    if not found:
        return None
    if max(found, key=lambda p: os.stat(p).st_mtime_ns) == one_process:
        state = checkpoints.load_checkpoint(one_process)
        generation = state.get(checkpoints.GENERATION_KEY, "")
        step = int(state["step"])
        return WrittenCheckpoint(output_dir, os.path.join(tables_path, generation) if generation else tables_path,
                                 True, 1, step, state.get(checkpoints.TABLES_KEY), {None: state.get("cut")},
                                 [one_process], generation, int(state.get(checkpoints.BATCHES_KEY, step)))
    directory, step, cuts, record = read_pointer(pointer)
    generation = record.get(checkpoints.GENERATION_KEY, "")
    files = [os.path.join(output_dir, directory, f"rank{r}.pt") for r in range(len(cuts))]
    return WrittenCheckpoint(output_dir, os.path.join(tables_path, generation) if generation else tables_path,
                             False, len(cuts), step, record.get(checkpoints.TABLES_KEY), cuts, files, generation,
                             int(record.get(checkpoints.BATCHES_KEY, step * len(cuts))))


def read_pointer(pointer: str) -> Tuple[str, int, Dict[int, Any], Dict[str, Any]]:
    """(directory name, step, each rank's cut, the whole record) of a torchrun checkpoint's pointer;
    ConfigError names one of an earlier version and one naming another directory than its run's."""
    try:
        with open(pointer) as f:
            record = json.load(f)
        directory, cuts = record["directory"], {int(rank): cut for rank, cut in record["cuts"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{pointer} was written by an earlier mlkv_torch (it points at a copy of every row, not at "
                          f"cuts of the tables); resume it with that version") from e
    named = checkpoints.CHECKPOINT_DIRECTORY.fullmatch(directory) if isinstance(directory, str) else None
    if named is None:  # a later checkpoint removes the directory the pointer names: only one of ours
        raise ConfigError(f"{pointer} names directory {directory!r}, not a checkpoint-<step> directory of this run: "
                          f"refusing to use it")
    return directory, int(named.group(1)), cuts, record
