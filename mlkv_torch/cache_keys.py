"""The cache key of a row: the table's index in its kernel in the high bits, the row's id in the
low ones, as the C++ cache keys rows (`EmbeddingCache::TableKey`), so every table of a kernel
shares one index, one policy and one slot tensor. The one place Python builds and splits keys."""
from __future__ import annotations

from typing import Union

import torch

from . import _C

__all__ = ["TABLE_SHIFT", "ROW_MASK", "cache_key", "table_of", "row_of"]

TABLE_SHIFT: int = _C.EmbeddingCache.table_shift
ROW_MASK: int = (1 << TABLE_SHIFT) - 1


def cache_key(table: Union[int, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The keys of rows `ids` (int64) of table `table` (an index, or a tensor of them beside `ids`)."""
    return ids | (table << TABLE_SHIFT)


def table_of(keys: torch.Tensor) -> torch.Tensor:
    """The table index of each key."""
    return keys >> TABLE_SHIFT


def row_of(keys: torch.Tensor) -> torch.Tensor:
    """The row id of each key within its table."""
    return keys & ROW_MASK
