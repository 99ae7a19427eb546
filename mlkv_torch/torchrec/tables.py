"""How a TorchRec table becomes a disk table: its pooling, dtype, initial distribution, seed and
the least memory it is given."""
from __future__ import annotations

import functools
import inspect
import warnings
import zlib
from typing import Any, Tuple

import torch
from torchrec.modules.embedding_configs import DataType, PoolingType

POOLING_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


DATA_TYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


MIN_TABLE_BUDGET = 64 << 10  # a table's share never drops below the store's few pages


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
