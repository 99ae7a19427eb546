"""EmbeddingCollection's disk tables under DistributedModelParallel: `DiskEmbeddingCollectionSharder`
offers the disk kernel (``customized_kernel``) for table-wise, row-wise and column-wise sharding
beside TorchRec's own kernels; the planner (`DiskAwarePlanner`) decides which tables take it. A
table planned on it becomes, on each rank that holds a shard, a disk table in
``storage_dir/rank<r>/<table>_rows<r0>_cols<c0>``, looked up one embedding per id after TorchRec's
input distribution, with the same fused optimizer, look-ahead, cuts and state dicts
(``embeddings.<table>.weight``) as ShardedDiskEmbeddingBagCollection's."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection

from .kernel import DISK_KERNEL, DiskTableOptions
from .sharded_tables import DiskSharder, DiskShardedTables, refuse_unfit_disk_shardings
from .shardings.sequence import DISK_SEQUENCE_SHARDINGS

__all__ = ["DiskEmbeddingCollectionSharder", "ShardedDiskEmbeddingCollection"]


class ShardedDiskEmbeddingCollection(DiskShardedTables, ShardedEmbeddingCollection):
    """TorchRec's ShardedEmbeddingCollection whose ``customized_kernel`` tables live on disk."""

    tables_attribute = "embeddings"

    def __init__(self, module: EmbeddingCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, options: DiskTableOptions, **kwargs: Any) -> None:
        self._init_disk_tables(table_name_to_parameter_sharding, options, module.embedding_configs())
        super().__init__(module, table_name_to_parameter_sharding, env, **kwargs)
        self._register_disk_state_dict_hooks()

    def create_embedding_sharding(self, sharding_type: str, sharding_infos: List[EmbeddingShardingInfo],
                                  env: ShardingEnv, device: Optional[torch.device] = None,
                                  qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> EmbeddingSharding:
        if not any(i.param_sharding.compute_kernel == DISK_KERNEL for i in sharding_infos):
            return ShardedEmbeddingCollection.create_embedding_sharding(
                sharding_type, sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        refuse_unfit_disk_shardings(sharding_infos, sharding_type, list(DISK_SEQUENCE_SHARDINGS))
        sharding = DISK_SEQUENCE_SHARDINGS[sharding_type](sharding_infos=sharding_infos, env=env, device=device,
                                                          qcomm_codecs_registry=qcomm_codecs_registry)
        sharding.disk_options = self._disk_options
        return sharding


class DiskEmbeddingCollectionSharder(DiskSharder, EmbeddingCollectionSharder):
    """EmbeddingCollectionSharder that can put tables on disk (compute kernel ``customized_kernel``),
    table-wise, row-wise or column-wise; the arguments are DiskEmbeddingBagCollectionSharder's.

    Pass it to DistributedModelParallel (and to the planner) in place of TorchRec's sharder,
    beside DiskEmbeddingBagCollectionSharder when the model has both kinds of collection.
    """

    disk_sharding_types = tuple(DISK_SEQUENCE_SHARDINGS)

    def sharded_module_arguments(self) -> Dict[str, Any]:
        return {"use_index_dedup": self._use_index_dedup}

    @property
    def sharded_module_type(self) -> Type[ShardedDiskEmbeddingCollection]:
        return ShardedDiskEmbeddingCollection
