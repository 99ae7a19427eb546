"""DiskEmbeddingBagCollection: TorchRec's EmbeddingBagCollection with every table in a DiskEmbeddingBag."""
from __future__ import annotations

from typing import Any, List, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

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
    own are keyword-only, as `DiskTableCollection` takes them: ``path`` (table ``t`` lives in
    ``path/t``), ``memory_budget_bytes``, ``cache_rows``, ``lookups_per_sample``, ``cut``, and how the
    tables train and are stored, as ``settings=DiskTableSettings(...)`` or its fields by keyword
    (``optimizer``, ``staleness``, ``cache_policy``, ``backend``, ``seed``, ``reopen``,
    ``virtual_tables``).

    Args:
        tables: the tables, as for EmbeddingBagCollection (none: an empty collection).
        is_weighted: features carry per-id weights.
        device: where the caches, pooling and outputs live (default: torch's default device, the CPU
            unless set otherwise; meta inside ``with torch.device("meta"):``).
        **disk: the disk's arguments (`DiskTableCollection`).

    Example::

        ebc = DiskEmbeddingBagCollection(tables, path="/data/tables", memory_budget_bytes=1 << 30,
                                         optimizer=mlkv_torch.optim.Adagrad(lr=0.05))
    """

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[Union[str, torch.device]] = None, **disk: Any) -> None:
        if not isinstance(is_weighted, bool):
            raise TypeError(f"is_weighted must be a bool (EmbeddingBagCollection's second argument), got "
                            f"{type(is_weighted).__name__}")
        self._is_weighted = is_weighted
        super().__init__(tables, device, **disk)
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
        values = self._routing.pool(self._batches, in_order, self._is_weighted, self.training,
                                    self._read_aheads.take(self.training))
        return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)
