"""Resuming a checkpoint written by another number of processes (`--resume`, and TorchElastic's
restarts into another world), or starting from an export (`--import`): this run's plan is made for
its own world, its tables are opened empty (a reshard's in a directory of their own, `generation`)
and filled from the source, which is only read (a `WrittenCheckpoint` or an `ExportedTables`):
each row lands on the rank whose shard holds it, with its optimizer state, wherever either plan
put the table (disk, sharded in memory, replicated). The dense model and its optimizer come from
the source's copy of them. The caller then takes a checkpoint of the new world at once, and only
then lets an old one go, so a kill at any moment leaves one checkpoint whole and a retry begins
again."""
from __future__ import annotations

import re
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from ..config import ConfigError
from ..read_ahead import read_ahead
from ..row_layout import RowLayout
from ..store import initial_rows
from ..stored_shards import StoredShard, TableRows, fill_shard, same_columns
from ..virtual_tables import IdsActivity
from .checkpoint_tables import state_entry, weight_key

__all__ = ["GENERATION", "generation", "shard_layout", "plan_differs", "check_tables", "load_resharded", "TableSource",
           "fill_disk_shard", "carry_activity", "fill_memory_table"]

# A directory of tables filled by a reshard, under the run's tables path.
GENERATION = re.compile(r"(one-process|world[0-9]+)-step[0-9]+(-replanned)?")
_CHUNK_ROWS = 1 << 16


class TableSource(Protocol):
    """What a run is filled from: a checkpoint of another world (`WrittenCheckpoint`) or an export
    (`mlkv_torch.exported_tables.ExportedTables`)."""

    step: int
    batches: int  # the batches the job trained by `step`, over all its ranks
    tables: Dict[str, Dict[str, Any]]  # each table's rows, dim, dtype, optimizer, placement, sharding
    description: str  # what it is, in a message

    def initial_rows(self, table: str) -> Optional[Dict[str, Any]]: ...

    def stored_disk_shards(self, table: str) -> Optional[List[StoredShard]]: ...

    def rows(self, table: str, chunk_rows: int = ...) -> Iterator[TableRows]: ...

    def activity(self, table: str) -> Optional[IdsActivity]: ...

    def dense_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]: ...


def generation(world_size: int, one_process: bool, step: int, read: str = "") -> str:
    """The directory (under the tables path) of tables resharded at `step` for this world, other
    than the one the checkpoint read keeps its tables in (`read`: the same world at the same step,
    under another plan)."""
    name = f"{'one-process' if one_process else f'world{world_size}'}-step{step}"
    return name if name != read else f"{name}-replanned"


def shard_layout(sharding: Any) -> List[List[int]]:
    """Where a TorchRec ParameterSharding puts a table's rows: [rank, first row, first column, rows,
    columns] per shard, sorted; a replicated table's ranks as [rank] each. Table-wise, column-wise
    and table-column-wise plans of a table whole on one rank are the same layout (TorchRec's
    planner picks among them as among equals, and its sharded module relabels them)."""
    shards = getattr(sharding.sharding_spec, "shards", None)
    if not shards:
        return [[rank] for rank in sorted(sharding.ranks or [])]
    return sorted([s.placement.rank(), *s.shard_offsets, *s.shard_sizes] for s in shards)


def plan_differs(written: Any, plan: Any) -> bool:
    """Whether TorchRec's ShardingPlan `plan` puts a table elsewhere (disk or memory) or lays its
    shards out otherwise than a checkpoint's tables (`written`, `checkpoints.TABLES_KEY`'s record)
    say. False for a checkpoint that records no tables (an earlier version's); one that records no
    layouts is compared by placement and the kind of sharding."""
    from ..torchrec.kernel import DISK_KERNEL

    if not isinstance(written, dict):
        return False
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            entry = written.get(table)
            if entry is None:
                continue  # check_tables names it
            placement = "disk" if sharding.compute_kernel == DISK_KERNEL else "memory"
            layout = entry.get("shards")
            if placement != entry["placement"] or (shard_layout(sharding) != layout if layout is not None else
                                                   _kind(sharding.sharding_type) != _kind(entry["sharding"])):
                return True
    return False


def _kind(sharding_type: str) -> str:
    """Sharding types a table whole on one rank may be labelled with alike (`shard_layout`)."""
    return "table_column_wise" if sharding_type in ("table_wise", "column_wise") else sharding_type


def check_tables(written: Dict[str, Dict[str, Any]], this_run: Dict[str, Dict[str, Any]],
                 source: str = "the checkpoint") -> None:
    """ConfigError naming a table that one side lacks or whose rows, columns, weight type or
    optimizer differ between `source` (a checkpoint or an export; its tables `written`) and this run."""
    lacking, extra = sorted(set(this_run) - set(written)), sorted(set(written) - set(this_run))
    if lacking or extra:
        differences = ([f"it lacks {lacking}"] if lacking else []) + \
            ([f"it has {extra}, which this run does not"] if extra else [])
        raise ConfigError(f"{source}'s tables differ from this run's: {'; '.join(differences)}: run with the data "
                          f"and model config it was written with")
    for name, entry in this_run.items():
        for key in ("rows", "dim", "dtype", "optimizer"):
            if written[name][key] != entry[key]:
                raise ConfigError(f"table {name!r}: {source}'s {key} is {written[name][key]!r}, this run's "
                                  f"{entry[key]!r}: run with the config it was written with")


def load_resharded(experiment: Any, source: TableSource) -> int:
    """Fills `experiment` (built for this world, its tables empty) from `source`; returns the step."""
    check_tables(source.tables, experiment.table_manifest(), source.description)
    this_run = experiment.table_manifest()
    for table, first_row, first_column, bag in experiment.collection.local_disk_shards():
        fill_disk_shard(source, table, first_row, first_column, bag)
        carry_activity(source, table, first_row, bag)
    if experiment.distributed:
        _load_sharded_state(experiment, source, this_run)
    else:
        _load_one_process_state(experiment, source)
    return source.step


def fill_disk_shard(source: TableSource, table: str, first_row: int, first_column: int, bag: Any) -> None:
    """A disk shard of this run (`bag`, empty): rows, state and step from a checkpoint's stores
    directly where its columns are split as here and its rule is the same (no row is converted),
    else from the table's rows read whole, their state converted to the bag's rule."""
    layout = RowLayout(bag.embedding_dim, bag.dtype, bag.optimizer)
    initial = source.initial_rows(table)
    if initial is not None and initial["seed"] != bag.seed:
        raise ConfigError(f"table {table!r}: the rows it never wrote start from seed {initial['seed']} there, from "
                          f"{bag.seed} here: use the seed it was written with (the runner's train.seed)")
    entry = source.tables[table]
    shards = source.stored_disk_shards(table)
    if shards is not None and entry["optimizer"] == bag.optimizer.name and \
            same_columns(shards, first_row, bag.num_embeddings, first_column, bag.embedding_dim):
        fill_shard(bag, first_row, first_column, shards, layout, _CHUNK_ROWS)
        return
    stop_row = first_row + bag.num_embeddings
    # The rows in increasing id order (a checkpoint's base runs', an export's first) go in once.
    with bag.filling() as write:
        for ids, weights, state in read_ahead(source.rows(table, _CHUNK_ROWS), depth=2, name="mlkv-reshard"):
            inside = (ids >= first_row) & (ids < stop_row)
            if bool(inside.any()):
                write(ids[inside] - first_row, weights[inside][:, first_column:first_column + bag.embedding_dim],
                      converted_state(_state_kind(entry), bag.optimizer.name, state[inside], first_column,
                                      bag.embedding_dim, entry["dim"]))
    bag.steps = source.step


def carry_activity(source: TableSource, table: str, first_row: int, bag: Any) -> None:
    """A virtual table's ids keep their lookups counted and ages where the source saved them (else
    each id a shard was filled with counts as looked up now, as `load_rows` adopts it), and the
    table its count of ids evicted."""
    activity = source.activity(table)
    if activity is None or not bag.follows_ids:
        return
    ids, counts, last, holds_row, evicted = activity
    inside = (ids >= first_row) & (ids < first_row + bag.num_embeddings)
    # The table's evictions so far go with its first shard, so its shards' count sums to them.
    bag.restore_id_activity(ids[inside] - first_row, counts[inside], last[inside], holds_row[inside],
                            int(evicted) if first_row == 0 else 0)


def _state_kind(entry: Dict[str, Any]) -> str:
    """Whose state a table's rows carry: its optimizer's, or the dense optimizer's (replicated)."""
    return "dense_adagrad" if entry["sharding"] == "data_parallel" else entry["optimizer"]


def converted_state(source: str, target: str, state: torch.Tensor, first_column: int, columns: int, dim: int
                    ) -> Optional[torch.Tensor]:
    """Optimizer state kept for `source` ("sgd", "adagrad", "rowwise_adagrad", "adam", or
    "dense_adagrad": torch's Adagrad of a replicated table), as `target` keeps it for columns
    [first_column, first_column + columns) of a `dim`-wide row. Element-wise sums are Adagrad's
    either way; row-wise Adagrad's accumulator is the mean of them over the row (what it would
    have summed), and stands for each element's the other way (an approximation); a row-wise
    state read across column shards ([n, shards]) becomes their mean. None: the target keeps no
    state, or none can carry over (Adam's moments from Adagrad's sums): rows start it afresh."""
    source, target = (("adagrad" if kind == "dense_adagrad" else kind) for kind in (source, target))
    columns_of = slice(first_column, first_column + columns)
    if target == "sgd" or source == "sgd":
        return None
    if source == "rowwise_adagrad" and target == "rowwise_adagrad":
        return state.mean(dim=1, keepdim=True)
    if source == "rowwise_adagrad" and target == "adagrad":
        return state.mean(dim=1, keepdim=True).expand(-1, columns).contiguous()
    if source == "adagrad" and target == "adagrad":
        return state[:, columns_of]
    if source == "adagrad" and target == "rowwise_adagrad":
        return state[:, columns_of].mean(dim=1, keepdim=True)
    if source == "adam" and target == "adam":
        return torch.cat([state[:, :dim][:, columns_of], state[:, dim:][:, columns_of]], dim=1)
    return None


def _load_sharded_state(experiment: Any, source: TableSource, this_run: Dict[str, Dict[str, Any]]) -> None:
    """This rank's tables in memory, its dense model and its optimizers, from the checkpoint."""
    from ..torchrec import disk_tables_left_out

    with disk_tables_left_out():
        model = experiment.model.state_dict()
        optimizer = experiment._optimizer_state_without_disk_tables()
        for table, entry in this_run.items():
            if entry["placement"] == "memory":
                fill_memory_table(source, table, entry, model, optimizer["state"])
        dense, dense_optimizer = source.dense_state()
        tables = tuple(weight_key(t) for t in this_run)
        for key, value in model.items():
            if isinstance(value, torch.Tensor) and not key.endswith(tables):
                value.copy_(_named(dense, key, "the dense model"))
        for key, value in optimizer["state"].items():
            if not key.endswith(tables):
                for name, tensor in value.items():
                    tensor.copy_(_named(dense_optimizer, key, "the dense optimizer")[name])
        experiment.model.load_state_dict(model)
        full = experiment.optimizer.state_dict()  # the disk tables' entries: their steps, as filled
        full["state"].update(optimizer["state"])
        experiment.optimizer.load_state_dict(full)


def _load_one_process_state(experiment: Any, source: TableSource) -> None:
    """One process: the dense model, and its optimizer (torch's Adagrad over the dense parameters
    in the model's order), from the checkpoint."""
    dense, dense_optimizer = source.dense_state()
    names = experiment.dense_parameter_names()
    experiment.model.load_state_dict({name: _named(dense, name, "the dense model") for name in names}, strict=False)
    state = experiment.optimizer.state_dict()
    state["state"] = {i: _named(dense_optimizer, name, "the dense optimizer") for i, name in enumerate(names)}
    experiment.optimizer.load_state_dict(state)


def _named(values: Dict[str, Any], key: str, what: str) -> Any:
    if key not in values:
        raise ConfigError(f"the checkpoint's {what} holds no {key!r} (its keys: {sorted(values)[:8]} ...)")
    return values[key]


def fill_memory_table(source: TableSource, table: str, entry: Dict[str, Any], model: Dict[str, Any],
                      optimizer: Dict[str, Any]) -> None:
    """This rank's blocks of a table TorchRec keeps in memory (sharded or replicated), and their
    optimizer state (TorchRec's momentums, or the dense optimizer's sum), from the checkpoint's
    rows; rows a disk table never wrote start as its initial rows there did."""
    blocks = _blocks(state_entry(model, weight_key(table), table))
    if not blocks:
        return  # another rank's table
    held = state_entry(optimizer, weight_key(table), table, default={})
    keys = ["sum"] if entry["sharding"] == "data_parallel" else \
        sorted(k for k in held if k.startswith(f"{table}.momentum"))
    moments = [_blocks(held[k]) for k in keys if k in held]
    initial = source.initial_rows(table)
    if initial is not None:  # every row of a disk table: those it never wrote start as there
        kind, a, b = initial["distribution"]
        bounds = dict(mean=a, std=b) if kind == "normal" else dict(low=a, high=b)
        for offsets, tensor in blocks:
            ids = torch.arange(offsets[0], offsets[0] + tensor.shape[0])
            rows = initial_rows(ids, entry["dim"], seed=initial["seed"], **bounds)
            tensor.copy_(rows[:, offsets[1]:offsets[1] + tensor.shape[1]])
        for parts in moments:
            for _, tensor in parts:
                tensor.zero_()
    source_kind, target_kind = _state_kind(source.tables[table]), _state_kind(entry)
    for ids, weights, state in read_ahead(source.rows(table, _CHUNK_ROWS), depth=2, name="mlkv-reshard"):
        for i, ((first_row, first_column), tensor) in enumerate(blocks):
            _put_rows(tensor, first_row, ids, weights[:, first_column:first_column + tensor.shape[1]])
            converted = converted_state(source_kind, target_kind, state, first_column, tensor.shape[1], entry["dim"]) \
                if moments else None
            if converted is None:
                continue
            # The block's momentums are the i-th shards of each ([rows] or [rows, columns]), side by side here.
            for part, parts in zip(converted.split(converted.shape[1] // len(moments), dim=1), moments):
                moment = parts[i][1]
                _put_rows(moment, first_row, ids, part.reshape(part.shape[0], *moment.shape[1:]))


def _put_rows(tensor: torch.Tensor, first: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes the `rows` whose `ids` fall in `tensor`'s block of rows from `first`."""
    inside = (ids >= first) & (ids < first + tensor.shape[0])
    if bool(inside.any()):
        tensor[ids[inside] - first] = rows[inside]


def _blocks(value: Any) -> List[Tuple[List[int], torch.Tensor]]:
    """(offsets [row, column], tensor) of this rank's blocks of a state dict's value: a
    ShardedTensor's local shards, a replicated tensor whole."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return [((list(s.metadata.shard_offsets) + [0])[:2], s.tensor) for s in value.local_shards()]
    return [([0, 0], value)]
