"""An export (`python -m mlkv_torch.export`) loaded into a user's own model: the way a trained
table leaves the job that made it for another job, an evaluation or serving, whatever the world
size and plan on either side. The runner's ``--import`` does the same for its own model."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..disk_modules import DiskTableModule
from .state_dicts import disk_tables_left_out

__all__ = ["load_export"]


def load_export(model: nn.Module, path: str, optimizer: Optional[Any] = None) -> int:
    """Fills every embedding table of `model` from the export at `path` and returns its step.

    `model` is a DistributedModelParallel model (call it on every rank: each fills the blocks it
    holds, on disk or in memory, table-wise, row-wise, column-wise or replicated) or a module
    holding DiskEmbeddingBagCollections or EmbeddingBagCollections in one process. Its tables are
    matched by name; each must be in the export with the same rows and columns (ConfigError names
    the one that is not), while tables of the export the model lacks are left out. Disk tables
    must be as their sharder opened them, empty; rows a disk table never wrote start as they did
    there (the same seed: `DiskEmbeddingBagCollectionSharder(seed=...)`, the runner's train.seed).

    Optimizer state comes with the rows: a disk table's in its store, a sharded in-memory table's
    into `optimizer` (default: ``model.fused_optimizer``, a DistributedModelParallel's), converted
    where the model's rule differs from the export's as a reshard converts it (element-wise and
    row-wise Adagrad into each other; a rule with no conversion starts its state afresh). A
    replicated table's state belongs to the user's dense optimizer, and the dense model to the
    user: the export's ``dense.pt`` holds the runner's, by parameter name."""
    from ..exported_tables import read_export, read_export_on_ranks
    from ..train.reshard import carry_activity, fill_disk_shard, fill_memory_table

    exported = read_export_on_ranks(path) if dist.is_available() and dist.is_initialized() else read_export(path)
    tables = _model_tables(model)
    _check_against_export(tables, exported.tables, exported.description)
    disk = {name for module in model.modules() if isinstance(module, DiskTableModule)
            for name in module.disk_table_names}
    for module in model.modules():
        if isinstance(module, DiskTableModule):
            for table, first_row, first_column, bag in module.local_disk_shards():
                fill_disk_shard(exported, table, first_row, first_column, bag)
                carry_activity(exported, table, first_row, bag)
    # The collections that keep tables in memory, each with its state dict: not the whole model's,
    # which would copy every row of a one-process disk collection.
    collections = [m for m in model.modules() if set(_tables_of(m)) - disk]
    if not collections:
        return exported.step
    if optimizer is None:
        optimizer = getattr(model, "fused_optimizer", None)
    with disk_tables_left_out(), torch.no_grad():
        optimizer_state = optimizer.state_dict() if optimizer is not None else {"state": {}}
        for collection in collections:
            collection_state = collection.state_dict()
            for table in sorted(set(_tables_of(collection)) - disk):
                entry = _memory_entry(table, tables[table], collection_state, optimizer_state["state"])
                fill_memory_table(exported, table, entry, collection_state, optimizer_state["state"])
            collection.load_state_dict(collection_state)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
    return exported.step


def _tables_of(module: nn.Module) -> Dict[str, Any]:
    """The configs by name of the tables `module` itself holds (a collection, sharded or not)."""
    configs = getattr(module, "_table_name_to_config", None)  # TorchRec's sharded collections
    if configs is None and callable(getattr(module, "embedding_bag_configs", None)):
        configs = {c.name: c for c in module.embedding_bag_configs()}
    if configs is None and callable(getattr(module, "embedding_configs", None)):
        configs = {c.name: c for c in module.embedding_configs()}
    return dict(configs or {})


def _model_tables(model: nn.Module) -> Dict[str, Any]:
    """The model's embedding tables' configs by name, from its (sharded or not) collections."""
    tables: Dict[str, Any] = {}
    for module in model.modules():
        tables.update(_tables_of(module))
    if not tables:
        raise ConfigError(f"{type(model).__name__} holds no embedding table (an EmbeddingBagCollection, a "
                          f"DiskEmbeddingBagCollection or their sharded modules) to load an export into")
    return tables


def _check_against_export(tables: Dict[str, Any], exported: Dict[str, Dict[str, Any]], source: str) -> None:
    """ConfigError naming a table of the model the export lacks, or whose rows or columns differ."""
    lacking = sorted(set(tables) - set(exported))
    if lacking:
        raise ConfigError(f"{source} holds no table {lacking} of the model (it holds {sorted(exported)})")
    for name, config in tables.items():
        for key, value in (("rows", config.num_embeddings), ("dim", config.embedding_dim)):
            if exported[name][key] != value:
                raise ConfigError(f"table {name!r}: {source}'s {key} is {exported[name][key]}, the model's {value}")


def _memory_entry(table: str, config: Any, collection_state: Dict[str, Any], optimizer_state: Dict[str, Any]
                  ) -> Dict[str, Any]:
    """What `fill_memory_table` needs of a table TorchRec keeps in memory: its columns, whether it
    is replicated (a plain tensor in the state dict: the dense optimizer's), and its fused rule,
    told by the state TorchRec keeps for it (none: SGD; two moments: Adam; one per element: Adagrad;
    one per row: row-wise Adagrad)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from ..train.checkpoint_tables import state_entry, weight_key

    found = [key for key in collection_state if key.endswith(weight_key(table))]
    if not found:
        raise ConfigError(f"table {table!r} is in memory but its rows are not in its collection's state dict under "
                          f"{weight_key(table)} (an EmbeddingCollection's tables load into disk tables only)")
    replicated = not isinstance(collection_state[found[0]], ShardedTensor)
    held = state_entry(optimizer_state, weight_key(table), table, default={})
    moments = [held[k] for k in sorted(held) if k.startswith(f"{table}.momentum")]
    if not moments:
        rule = "sgd"
    elif len(moments) == 2:
        rule = "adam"
    else:
        # (The shape from the metadata: a ShardedTensor warns on any torch function.)
        shape = moments[0].metadata().size if isinstance(moments[0], ShardedTensor) else moments[0].shape
        rule = "adagrad" if len(shape) == 2 else "rowwise_adagrad"
    return {"dim": config.embedding_dim, "optimizer": rule, "sharding": "data_parallel" if replicated else "sharded"}
