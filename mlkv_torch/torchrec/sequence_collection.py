"""DiskEmbeddingCollection: TorchRec's EmbeddingCollection (one embedding per id, for sequence
models) with every table on disk."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from .table_collection import DiskTableCollection

__all__ = ["DiskEmbeddingCollection"]


class DiskEmbeddingCollection(DiskTableCollection):
    """An EmbeddingCollection whose tables live on disk, behind one table-batched kernel.

    ``forward(KeyedJaggedTensor) -> Dict[str, JaggedTensor]`` as EmbeddingCollection: for each
    embedding name (a feature, ``feature@table`` when several tables read it), in the tables'
    order, the embedding of every id of the feature, float32, with the feature's lengths (and its
    ids as weights with ``need_indices``). Per-id weights of the input are ignored, as there.
    Tables of one row layout (dim and data type) share one DiskTableBatch: one hot cache, one
    lookup over every id of the batch, one fused optimizer step per backward, each row's gradient
    summed over its ids. ``embeddings[name]`` views each table as a DiskEmbeddingBag (rows,
    snapshots, stats; its own forward pools).

    The arguments start as EmbeddingCollection's (``tables, device, need_indices``); the disk's own
    are keyword-only, as `DiskTableCollection` takes them (see DiskEmbeddingBagCollection);
    ``lookups_per_sample`` is the ids per sample of a table, its traffic: a sequence feature has
    many.
    """

    tables_attribute = "embeddings"
    pooled = False
    counterpart = "EmbeddingCollection"
    sharder = "DiskEmbeddingCollectionSharder"

    def __init__(self, tables: List[EmbeddingConfig], device: Optional[Union[str, torch.device]] = None,
                 need_indices: bool = False, **disk: Any) -> None:
        dims = {t.embedding_dim for t in tables}
        if len(dims) > 1:  # as EmbeddingCollection: its sharded outputs are [ids, dim]
            raise ValueError(f"the tables of an EmbeddingCollection share one embedding_dim, got "
                             f"{ {t.name: t.embedding_dim for t in tables} }")
        self._need_indices = need_indices
        self._embedding_dim = dims.pop() if dims else -1
        super().__init__(tables, device, **disk)

    # ---- EmbeddingCollection's interface ----------------------------------------------------------
    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> List[List[str]]:
        return self._embedding_names_by_table

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """The embedding of every id of every feature, by embedding name."""
        if isinstance(features, torch.fx.Proxy):
            return self._traced_call(features, self._look_up)
        return self._look_up(features)

    def _look_up(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if self._device.type == "meta" and isinstance(features, KeyedJaggedTensor):
            # shapes alone, as EmbeddingCollection gives there: nothing is read
            in_order = self._in_table_order(features)
            per_feature = [torch.empty(n, self._embedding_dim, device="meta") for n in in_order.length_per_key()]
        else:
            in_order = self._features_of_tables(features)
            if not self._batches:
                return {}
            per_feature = self._routing.look_up(self._batches, in_order, self.training,
                                                self._read_aheads.take(self.training))
        lengths = in_order.lengths().view(len(self._feature_order), -1)
        ids = in_order.values().split(in_order.length_per_key())
        return {name: JaggedTensor(values=embeddings, lengths=lengths[i],
                                   weights=ids[i] if self._need_indices else None)
                for i, (name, embeddings) in enumerate(zip(self._embedding_names, per_feature))}
