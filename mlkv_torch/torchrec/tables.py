"""How TorchRec's tables become disk tables: their pooling, data type, initial distribution and
seed (`disk_table_spec`), and how a collection's or a rank's tables are opened, each viewed as a
DiskEmbeddingBag, with the routing of their features (`open_disk_tables`)."""
from __future__ import annotations

import functools
import inspect
import warnings
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, PoolingType

from .. import optim as optim_lib
from ..disk_table import DiskTable
from ..embedding import DiskEmbeddingBag
from ..opening import TableSpec, open_tables
from ..row_layout import RowLayout
from ..table_batch import DiskTableBatch
from ..table_settings import BatchSettings
from ..virtual_tables import IdPolicy
from .routing import KernelRouting

POOLING_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


DATA_TYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


_INIT_FNS = {torch.nn.init.uniform_: ("uniform", "a", "b"), torch.nn.init.normal_: ("normal", "mean", "std")}


def initial_distribution_of(config: Any) -> Tuple[str, float, float]:
    """How a TorchRec table's rows start on disk: ("uniform", low, high) or ("normal", mean, std).
    A disk table generates each row when first read, from (seed, id), so its init_fn is read, not
    run: ``functools.partial(torch.nn.init.uniform_ or normal_, ...)`` (TorchRec's default is the
    uniform one over weight_init_min/max) is honoured; any other init_fn cannot run there, and is
    reported."""
    init_fn = getattr(config, "init_fn", None)
    if isinstance(init_fn, functools.partial) and init_fn.func in _INIT_FNS:
        kind, first, second = _INIT_FNS[init_fn.func]
        try:
            bound = inspect.signature(init_fn.func).bind(torch.empty(0), *init_fn.args, **init_fn.keywords)
        except TypeError:
            bound = None
        if bound is not None:
            bound.apply_defaults()
            return kind, float(bound.arguments[first]), float(bound.arguments[second])
    if init_fn is not None:
        warnings.warn(f"table {config.name!r}: its init_fn is not applied on disk (only functools.partial of "
                      f"torch.nn.init.uniform_ or normal_ can be); its rows start uniform in "
                      f"[weight_init_min, weight_init_max] = [{config.get_weight_init_min():g}, "
                      f"{config.get_weight_init_max():g}] (set those, or write rows with import_rows)", stacklevel=3)
    return "uniform", float(config.get_weight_init_min()), float(config.get_weight_init_max())


def table_seed(seed: int, table_name: str) -> int:
    """The seed of a table's initial rows: the collection's seed mixed with the table's name."""
    return (seed * 1_000_003 + zlib.crc32(table_name.encode())) & 0x7FFFFFFF


def disk_table_spec(config: BaseEmbeddingConfig, path: str, seed: int, optimizer: optim_lib.SparseOptimizer, *,
                    seed_drawn: bool = False, embedding_dim: Optional[int] = None, first_column: int = 0,
                    num_embeddings: Optional[int] = None, first_row: int = 0,
                    lookups_per_sample: Optional[float] = None, pooled: bool = True,
                    id_policy: Optional[IdPolicy] = None) -> TableSpec:
    """A TorchRec table, or a rank's shard of one (`num_embeddings` rows from `first_row`,
    `embedding_dim` columns from `first_column`), as a disk table at `path`; ValueError names a
    pooling or data type the disk kernel does not have. Its traffic is `lookups_per_sample`, by
    default one per feature. A table that does not pool (`pooled` False: an EmbeddingCollection's,
    one embedding per id) is looked up as bags of one id, summed. A virtual table
    (``use_virtual_table``) follows `id_policy` (`virtual_tables.id_policy_of` its user's config)."""
    if pooled and config.pooling not in POOLING_MODES:
        raise ValueError(f"table {config.name!r}: pooling {config.pooling} is not supported on disk (SUM or MEAN)")
    if config.data_type not in DATA_TYPES:
        raise ValueError(f"table {config.name!r}: data_type {config.data_type} is not supported on disk "
                         f"(FP32, FP16, BF16)")
    table = DiskTable(config.name, config.num_embeddings if num_embeddings is None else num_embeddings, path, seed,
                      first_column, init=initial_distribution_of(config), seed_drawn=seed_drawn, first_row=first_row,
                      id_policy=id_policy)
    layout = RowLayout(config.embedding_dim if embedding_dim is None else embedding_dim, DATA_TYPES[config.data_type],
                       optimizer)
    return TableSpec(table, layout, POOLING_MODES[config.pooling] if pooled else "sum",
                     len(config.feature_names) if lookups_per_sample is None else lookups_per_sample)


class OpenDiskTables(NamedTuple):
    """A collection's (or a rank's) tables, opened by `open_disk_tables`."""
    batches: List[DiskTableBatch]
    bags: List[DiskEmbeddingBag]  # each table viewed as a DiskEmbeddingBag, in the tables' order
    routing: KernelRouting        # how their features, in the tables' order, reach the batches


def open_disk_tables(configs: Sequence[BaseEmbeddingConfig], specs: Sequence[TableSpec], *, memory_budget_bytes: int,
                     settings: BatchSettings, device: Union[str, torch.device], cut_dir: str, reopen: bool,
                     cut: Optional[Dict[str, Any]] = None, cache_rows: Optional[int] = None,
                     read_ahead_into_slots: Optional[bool] = None) -> OpenDiskTables:
    """Opens the tables `specs` describes (`opening.open_tables`, the cut reconciled with the one
    `cut_dir` records), views each as a DiskEmbeddingBag, and routes the features of `configs` (the
    same tables, in the same order) to the batches that pool them."""
    opened = open_tables(specs, memory_budget_bytes=memory_budget_bytes, cache_rows=cache_rows, settings=settings,
                         device=device, reopen=reopen, cut=cut, cut_dir=cut_dir,
                         read_ahead_into_slots=read_ahead_into_slots)
    bags = [DiskEmbeddingBag.of_batch(opened.batches[b], k) for b, k in opened.places]
    routing = KernelRouting([opened.places[i] for i, config in enumerate(configs) for _ in config.feature_names])
    return OpenDiskTables(opened.batches, bags, routing)
