"""DiskEmbeddingBagCollection: TorchRec's EmbeddingBagCollection with every table in a DiskEmbeddingBag."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Union

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from .. import optim as optim_lib
from ..embedding import DiskEmbeddingBag
from .tables import DATA_TYPES, MIN_TABLE_BUDGET, POOLING_MODES, pool_features, row_bytes, table_seed

__all__ = ["DiskEmbeddingBagCollection", "split_budget"]


def split_budget(budget: int, needs: List[int], traffic: List[float]) -> List[int]:
    """Splits `budget` bytes among tables in proportion to their `traffic`, giving no table more
    than it `needs` (water-filling: the budget a capped table leaves is split among the rest)."""
    shares = [0] * len(needs)
    active, left = list(range(len(needs))), float(budget)
    while active:
        weight = sum(traffic[i] for i in active)
        capped = [i for i in active if left * traffic[i] / weight >= needs[i]]
        if not capped:
            for i in active:
                shares[i] = int(left * traffic[i] / weight)
            break
        for i in capped:
            shares[i] = needs[i]
            left -= needs[i]
        active = [i for i in active if i not in capped]
    return shares


class DiskEmbeddingBagCollection(nn.Module):
    """An EmbeddingBagCollection whose tables live on disk, each a DiskEmbeddingBag.

    ``forward(KeyedJaggedTensor) -> KeyedTensor`` as EmbeddingBagCollection:
    the same keys (a feature shared by several tables reads ``feature@table``),
    the same order, float32 output; weighted features with ``is_weighted``; SUM
    and MEAN pooling. The features of one table are looked up in one call, so
    each table takes one optimizer step per backward, as a fused TorchRec
    optimizer does.

    Args:
        tables: the tables, as for EmbeddingBagCollection.
        device: where the caches, pooling and outputs live (default CPU).
        path: a directory; table ``t`` lives in ``path/t``.
        optimizer: the fused sparse optimizer of every table.
        memory_budget_bytes: host memory for rows, for the whole collection,
            split among tables by traffic and size (`split_budget`): in
            proportion to each table's lookups per sample, but never more than
            a table needs to hold all its rows; what small tables leave goes to
            the others.
        cache_rows: rows of hot cache for the whole collection, split the same
            way (default: each table's own default).
        lookups_per_sample: expected ids per sample of each table (its traffic),
            by table name; default: one per feature of the table.
        staleness: the per-row staleness bound of every table.
        is_weighted: features carry per-id weights.
        seed: seed of the initial rows (each table mixes in its name).
        cache_policy: "lfu" or "lru".
        backend: the store under every table: "mlkv" (KVStore) or "rocksdb" (the baseline).
    """

    def __init__(self, tables: List[EmbeddingBagConfig], device: Optional[Union[str, torch.device]] = None, *,
                 path: Union[str, os.PathLike], optimizer: Optional[optim_lib.SparseOptimizer] = None,
                 memory_budget_bytes: int = 256 << 20, cache_rows: Optional[int] = None, staleness: int = 0,
                 is_weighted: bool = False, seed: int = 0, cache_policy: str = "lfu",
                 lookups_per_sample: Optional[Dict[str, float]] = None, backend: str = "mlkv") -> None:
        super().__init__()
        if not tables:
            raise ValueError("tables must not be empty")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be distinct, got {names}")
        for t in tables:
            if t.pooling not in POOLING_MODES:
                raise ValueError(f"table {t.name!r}: pooling {t.pooling} is not supported (SUM or MEAN)")
            if t.data_type not in DATA_TYPES:
                raise ValueError(f"table {t.name!r}: data_type {t.data_type} is not supported (FP32, FP16, BF16)")
            if not t.feature_names:
                t.feature_names = [t.name]
        self._is_weighted = is_weighted
        self._device = torch.device(device if device is not None else "cpu")
        self._embedding_bag_configs = tables
        traffic = dict(lookups_per_sample or {})
        unknown = sorted(set(traffic) - set(names))
        if unknown:
            raise ValueError(f"lookups_per_sample names tables the collection does not have: {unknown}")
        if any(not v > 0 for v in traffic.values()):
            raise ValueError(f"lookups_per_sample must be positive, got {traffic}")
        rule = optimizer if optimizer is not None else optim_lib.SGD()
        # A table is whole in memory with twice its rows (the cache's half and the store log's half),
        # and never takes less than the store's minimum.
        needs = [max(MIN_TABLE_BUDGET, 2 * t.num_embeddings * row_bytes(t.embedding_dim, DATA_TYPES[t.data_type], rule))
                 for t in tables]
        budgets = split_budget(memory_budget_bytes, needs, [traffic.get(t.name, len(t.feature_names)) for t in tables])
        self.embedding_bags = nn.ModuleDict()
        for t, budget in zip(tables, budgets):
            share = budget / memory_budget_bytes
            self.embedding_bags[t.name] = DiskEmbeddingBag(
                t.num_embeddings, t.embedding_dim, path=os.path.join(os.fspath(path), t.name),
                mode=POOLING_MODES[t.pooling], optimizer=optimizer,
                cache_rows=None if cache_rows is None else min(t.num_embeddings, int(cache_rows * share)),
                memory_budget_bytes=max(MIN_TABLE_BUDGET, budget), staleness=staleness,
                dtype=DATA_TYPES[t.data_type], device=self._device,
                seed=table_seed(seed, t.name), include_last_offset=True,
                cache_policy=cache_policy, backend=backend)
        self._feature_names: List[List[str]] = [list(t.feature_names) for t in tables]
        self._embedding_names: List[str] = [n for names in get_embedding_names_by_table(tables) for n in names]
        self._lengths_per_embedding: List[int] = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._known_features = {f for names in self._feature_names for f in names}

    # ---- EmbeddingBagCollection's interface -------------------------------------------------------
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pools every feature's ids with its table; returns a KeyedTensor keyed by embedding name."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        keys = set(features.keys())
        unknown, missing = sorted(keys - self._known_features), sorted(self._known_features - keys)
        if unknown:
            raise ValueError(f"the KeyedJaggedTensor has features no table knows: {unknown}")
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks features of the tables: {missing}")
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError("the collection is weighted, but the KeyedJaggedTensor has no weights")
        by_name = features.to_dict()
        batch_size = features.stride()
        pooled: List[torch.Tensor] = []
        for bag, names in zip(self.embedding_bags.values(), self._feature_names):
            jts = [by_name[n] for n in names]
            for name, jt in zip(names, jts):
                if jt.lengths().numel() != batch_size:
                    raise ValueError(f"feature {name!r} has {jt.lengths().numel()} bags, the batch has {batch_size}")
            values = torch.cat([jt.values() for jt in jts]) if len(jts) > 1 else jts[0].values()
            lengths = torch.cat([jt.lengths() for jt in jts]) if len(jts) > 1 else jts[0].lengths()
            weights = None
            if self._is_weighted:
                weights = torch.cat([jt.weights() for jt in jts]) if len(jts) > 1 else jts[0].weights()
            pooled.append(pool_features(bag, values, lengths, weights, len(jts), batch_size))
        return KeyedTensor(keys=self._embedding_names, values=torch.cat(pooled, dim=1),
                           length_per_key=self._lengths_per_embedding)

    def lookahead(self, features: KeyedJaggedTensor) -> None:
        """Starts reading the rows of a future batch's features into memory; returns at once."""
        by_name = features.to_dict()
        for bag, names in zip(self.embedding_bags.values(), self._feature_names):
            ids = [by_name[n].values() for n in names if n in by_name]
            if ids:
                bag.lookahead(torch.cat(ids) if len(ids) > 1 else ids[0])

    # ---- tables -----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Applies queued updates of every table and writes changed rows to the stores."""
        for bag in self.embedding_bags.values():
            bag.flush()

    def populate(self) -> int:
        """Writes every row of every table to its store (`DiskEmbeddingBag.populate`); returns the rows."""
        return sum(bag.populate() for bag in self.embedding_bags.values())

    def close(self) -> None:
        """Closes every table (checkpointing its store)."""
        for bag in self.embedding_bags.values():
            bag.close()

    def stats(self) -> Dict[str, Dict[str, object]]:
        """Each table's DiskEmbeddingBag.stats(), by table name."""
        return {name: bag.stats() for name, bag in self.embedding_bags.items()}
