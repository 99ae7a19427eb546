"""The shardings an EmbeddingCollection's disk tables take: TorchRec's sequence shardings (table-wise,
row-wise, column-wise) with a lookup that puts the groups planned on disk in DiskEmbeddingKernel.
Each id is looked up on the rank that holds its row (its block's rank, row-wise), and TorchRec's
all-to-all sends every embedding back; nothing is summed across ranks."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType

from ..kernel import DiskEmbeddingKernel, DiskTableOptions
from .lookup import DiskGroupLookahead


class DiskSequenceEmbeddingsLookup(DiskGroupLookahead, GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup, with DiskEmbeddingKernel for groups planned on disk."""

    def __init__(self, options: DiskTableOptions, sharding_type: ShardingType, **kwargs: Any) -> None:
        # read by _create_embedding_kernel, which the base __init__ calls
        self._disk_options, self._disk_sharding_type = options, sharding_type
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                                 device: Optional[torch.device], env: Optional[ShardingEnv] = None) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DiskEmbeddingKernel(config, self._disk_options, pg=pg, device=device,
                                       sharding_type=self._disk_sharding_type)
        return super()._create_embedding_kernel(config, pg, device, env)


class DiskSequenceLookupMixin:
    """Makes a TorchRec sequence sharding build DiskSequenceEmbeddingsLookup."""

    disk_options: DiskTableOptions
    lookup_sharding_type: ShardingType

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> GroupedEmbeddingsLookup:
        return DiskSequenceEmbeddingsLookup(
            self.disk_options, self.lookup_sharding_type, grouped_configs=self._grouped_embedding_configs,  # type: ignore
            pg=self._pg, device=device if device is not None else self._device, env=self._env)  # type: ignore


class DiskTwSequenceSharding(DiskSequenceLookupMixin, TwSequenceEmbeddingSharding):
    lookup_sharding_type = ShardingType.TABLE_WISE


class DiskRwSequenceSharding(DiskSequenceLookupMixin, RwSequenceEmbeddingSharding):
    lookup_sharding_type = ShardingType.ROW_WISE


class DiskCwSequenceSharding(DiskSequenceLookupMixin, CwSequenceEmbeddingSharding):
    lookup_sharding_type = ShardingType.COLUMN_WISE


DISK_SEQUENCE_SHARDINGS = {ShardingType.TABLE_WISE.value: DiskTwSequenceSharding,
                           ShardingType.ROW_WISE.value: DiskRwSequenceSharding,
                           ShardingType.COLUMN_WISE.value: DiskCwSequenceSharding}
