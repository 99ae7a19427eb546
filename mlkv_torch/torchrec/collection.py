"""DiskEmbeddingBagCollection: TorchRec's EmbeddingBagCollection with every table in a DiskEmbeddingBag."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from .. import optim as optim_lib
from ..virtual_tables import VirtualTableOptions
from .table_collection import DiskTableCollection

__all__ = ["DiskEmbeddingBagCollection"]


class DiskEmbeddingBagCollection(DiskTableCollection):
    """An EmbeddingBagCollection whose tables live on disk, behind one table-batched kernel.

    ``forward(KeyedJaggedTensor) -> KeyedTensor`` as EmbeddingBagCollection:
    the same keys (a feature shared by several tables reads ``feature@table``),
    the same order, float32 output; features no table names are ignored (one
    KeyedJaggedTensor may feed several collections); weighted features with
    ``is_weighted``; SUM and MEAN pooling. Tables of one row layout (dim, data type, pooling; in DLRM
    all of them) share one DiskTableBatch: one hot cache, one lookup over every
    feature of the batch, one fused optimizer step per backward, as TorchRec's
    fused table-batched kernel. ``embedding_bags[name]`` views each table as a
    DiskEmbeddingBag (rows, snapshots, stats).

    The arguments start as EmbeddingBagCollection's (``tables, is_weighted, device``); the disk's
    own are keyword-only.

    Args:
        tables: the tables, as for EmbeddingBagCollection (none: an empty collection).
        is_weighted: features carry per-id weights.
        device: where the caches, pooling and outputs live (default: torch's default device, the CPU
            unless set otherwise; meta inside ``with torch.device("meta"):``).
        path: a directory; table ``t`` lives in ``path/t``.
        optimizer: the fused sparse optimizer of every table (an `mlkv_torch.optim` rule; default
            SGD(lr=0.01), with a warning). The model's torch optimizer does not reach the tables;
            `fused_optimizer` carries their learning rate for schedules and CombinedOptimizer.
        memory_budget_bytes: host memory for rows, for the whole collection. Within a
            row layout the tables share one cache, whose frequency-aware policy
            gives the hot rows of every table their place (`split_host_memory`);
            several layouts share it by traffic and size (`memory_budget.plan_host_memory`).
        cache_rows: rows of hot cache for the whole collection, split the same
            way (default: what the budget holds).
        lookups_per_sample: expected ids per sample of each table (its traffic),
            by table name; default: one per feature of the table. Splits the
            budget between row layouts.
        staleness: the per-row staleness bound of every table.
        seed: seed of the initial rows (each table mixes in its name); default read from torch's
            default generator, so ``torch.manual_seed`` makes runs reproducible. A reopened table
            keeps the seed recorded in its directory.
        reopen: continue from the rows and optimizer state that `path` holds from an earlier run,
            at its last cut (`checkpoint()`; `close()` takes one), every table at the same one, even
            after a crash; without it, tables holding rows are refused (FileExistsError).
        cut: reopen at this cut (a record `checkpoint()` returned) rather than the last one
            recorded in `path`: what a training checkpoint that holds the record resumes from.
        cache_policy: "lfu" or "lru".
        backend: the store under every table: "mlkv" (KVStore) or "rocksdb" (the baseline).
        virtual_tables: for tables with ``use_virtual_table``: the frequency filter, the clock of
            their eviction policy and the cap after a round (`VirtualTableOptions`). A virtual
            table holds a row for any id in [0, num_embeddings) (up to 2**40) once looked up,
            each its own, and evicts ids by its ``virtual_table_eviction_policy``; its state dict
            holds its live ids (``weight_id``) and their rows (``weight``) (docs/torchrec.md).
    """

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[Union[str, torch.device]] = None, *, path: Union[str, os.PathLike],
                 optimizer: Optional[optim_lib.SparseOptimizer] = None, memory_budget_bytes: int = 256 << 20,
                 cache_rows: Optional[int] = None, staleness: int = 0, seed: Optional[int] = None,
                 cache_policy: str = "lfu", lookups_per_sample: Optional[Dict[str, float]] = None,
                 backend: str = "mlkv", reopen: bool = False, cut: Optional[Dict[str, Any]] = None,
                 virtual_tables: Optional[VirtualTableOptions] = None) -> None:
        if not isinstance(is_weighted, bool):
            raise TypeError(f"is_weighted must be a bool (EmbeddingBagCollection's second argument), got "
                            f"{type(is_weighted).__name__}")
        self._is_weighted = is_weighted
        super().__init__(tables, device, path=path, optimizer=optimizer, memory_budget_bytes=memory_budget_bytes,
                         cache_rows=cache_rows, staleness=staleness, seed=seed, cache_policy=cache_policy,
                         lookups_per_sample=lookups_per_sample, backend=backend, reopen=reopen, cut=cut,
                         virtual_tables=virtual_tables)
        self._lengths_per_embedding: List[int] = [t.embedding_dim for t in self._configs for _ in t.feature_names]

    tables_attribute = "embedding_bags"
    pooled = True
    counterpart = "EmbeddingBagCollection"
    sharder = "DiskEmbeddingBagCollectionSharder"

    # ---- EmbeddingBagCollection's interface -------------------------------------------------------
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pools every feature's ids with its table; returns a KeyedTensor keyed by embedding name."""
        if isinstance(features, torch.fx.Proxy):
            return self._traced_call(features, self._pool)
        return self._pool(features)

    def _pool(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self._device.type == "meta" and isinstance(features, KeyedJaggedTensor):
            # shapes alone, as EmbeddingBagCollection gives there: nothing is read
            return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                               values=torch.empty(features.stride(), sum(self._lengths_per_embedding), device="meta"))
        in_order = self._features_of_tables(features)
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError("the collection is weighted, but the KeyedJaggedTensor has no weights")
        if not self._batches:  # no tables: no embeddings
            return KeyedTensor(keys=[], values=torch.empty(features.stride(), 0, device=self._device),
                               length_per_key=[])
        values = self._routing.pool(self._batches, in_order, self._is_weighted)
        return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)
