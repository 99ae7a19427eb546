"""The grouped lookup every disk sharding uses: TorchRec's pooled lookup with `DiskEmbeddingKernel`
for the groups planned on the disk kernel."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..kernel import DiskEmbeddingKernel, DiskTableOptions


class DiskGroupLookahead:
    """A TorchRec lookup's look-ahead over its groups on the disk kernel (`_emb_modules`, one per
    group, fed `_feature_splits` features each)."""

    _emb_modules: nn.ModuleList
    _feature_splits: List[int]

    def lookahead(self, features: KeyedJaggedTensor, token: Optional[int] = None) -> None:
        """Starts reading the rows of the disk groups that `features` (as `forward` receives them) will
        look up, as the read-ahead `token` (`DiskEmbeddingKernel.lookahead`); the in-memory groups
        have nothing to read."""
        for kernel, group in zip(self._emb_modules, features.split(self._feature_splits)):
            if isinstance(kernel, DiskEmbeddingKernel):
                kernel.lookahead(group, token)

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream: Optional[torch.Stream] = None) -> None:
        """TorchRec's prefetch contract (its sharded module's ``prefetch``, which
        PrefetchTrainPipelineSparseDist calls one batch ahead): the disk groups start reading the
        batch's rows (`lookahead`; they stay staged until the batch's forward takes them, the next
        training forward in order), TorchRec's own caching groups prefetch as theirs do."""
        self.lookahead(sparse_features, token=None)
        super().prefetch(sparse_features, forward_stream)  # type: ignore[misc]


class DiskPooledEmbeddingsLookup(DiskGroupLookahead, GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, with DiskEmbeddingKernel for groups planned on disk."""

    def __init__(self, options: DiskTableOptions, **kwargs: Any) -> None:
        self._disk_options = options  # read by _create_embedding_kernel, which the base __init__ calls
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: Optional[torch.device],
                                 pg: Optional[dist.ProcessGroup], sharding_type: Optional[ShardingType],
                                 env: Optional[ShardingEnv]) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DiskEmbeddingKernel(config, self._disk_options, pg=pg, device=device, sharding_type=sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        # TorchRec merges several kernels' variable-batch outputs into one it allocates first, which
        # fbgemm's CPU kernel refuses: with one of those on the CPU, the outputs are concatenated.
        if (sparse_features.variable_stride_per_key() and len(self._emb_modules) > 1
                and sparse_features.device().type == "cpu"
                and not all(isinstance(m, DiskEmbeddingKernel) for m in self._emb_modules)):
            groups = sparse_features.split(self._feature_splits)
            return self._merge_variable_batch_embeddings(self._forward(groups), self._vbe_splits(groups))
        return super().forward(sparse_features)

class DiskLookupMixin:
    """Makes a TorchRec pooled sharding build DiskPooledEmbeddingsLookup."""

    disk_options: DiskTableOptions
    lookup_sharding_type: ShardingType  # what TorchRec's own lookup of this sharding is told

    def lookup_configs(self) -> List[GroupedEmbeddingConfig]:
        """The grouped tables this rank looks up (TorchRec's sharding keeps them in
        `_grouped_embedding_configs`, table-row-wise per rank)."""
        return self._grouped_embedding_configs  # type: ignore[attr-defined]

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> GroupedPooledEmbeddingsLookup:
        return DiskPooledEmbeddingsLookup(
            self.disk_options, grouped_configs=self.lookup_configs(), pg=self._pg,  # type: ignore
            device=device if device is not None else self._device, feature_processor=feature_processor,  # type: ignore
            sharding_type=self.lookup_sharding_type, env=self._env)  # type: ignore
