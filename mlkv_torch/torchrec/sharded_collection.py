"""Disk tables under DistributedModelParallel: a sharder whose tables may live on disk.

TorchRec's plug-in point for a third-party kernel is the compute kernel
``customized_kernel``. `DiskEmbeddingBagCollectionSharder` offers it beside
TorchRec's own kernels for table-wise, column-wise and table-column-wise
sharding; the planner (`DiskAwarePlanner`) decides which tables take it. A
table planned on it becomes, on each rank that holds a shard, a
DiskEmbeddingBag in ``storage_dir/rank<r>/<table>_rows<r0>_cols<c0>``.

- Forward: `DiskEmbeddingKernel` pools the shard's features after TorchRec's
  input distribution, exactly as TorchRec's fused kernel would.
- Lookahead: ``ShardedDiskEmbeddingBagCollection.lookahead(features)`` runs the
  input distribution of a future batch (a collective) and starts reading, on each
  rank, the rows of its shards that the batch will look up (LookaheadPipeline).
- Training: the fused optimizer comes from ``apply_optimizer_in_backward`` or
  the sharder's ``fused_params`` (TorchRec's way) or its ``optimizer`` (an
  mlkv_torch.optim rule, which the in-memory tables of the plan then share).
  ``dmp.fused_optimizer`` holds the disk tables: its ``param_groups`` set their
  learning rate, and its ``state_dict()`` holds their optimizer state.
- Checkpoints: ``dmp.state_dict()`` holds every disk table as a ShardedTensor
  under EmbeddingBagCollection's key (``embedding_bags.<table>.weight``),
  read from the stores; a shard larger than its memory budget is file-backed,
  so torch.distributed.checkpoint saves it without materialising it.
  ``load_state_dict`` writes the rows back, from ShardedTensors or from an
  unsharded collection's full tensors.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from .kernel import DISK_KERNEL, DiskTableOptions
from .sharded_tables import DiskSharder, DiskShardedTables, planning_with_disk, refuse_unfit_disk_shardings
from .shardings import DISK_SHARDINGS

__all__ = ["DiskEmbeddingBagCollectionSharder", "ShardedDiskEmbeddingBagCollection", "planning_with_disk"]


def _check_mean_pooling(module: EmbeddingBagCollection, plan: Dict[str, ParameterSharding]) -> None:
    """Refuses a collection that mixes row-wise tables pooled by mean with tables sharded another
    way: TorchRec's callback that divides the row-wise sums (ShardedEmbeddingBagCollection's mean
    pooling divisor, torchrec 1.8) divides every table's output by its bag lengths, so the others'
    would be divided too, silently."""
    row_wise = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value}
    configs = module.embedding_bag_configs()
    mean = [c.name for c in configs if c.pooling == PoolingType.MEAN and plan[c.name].sharding_type in row_wise]
    others = [c.name for c in configs if plan[c.name].sharding_type not in row_wise]
    if mean and others:
        raise ValueError(f"tables {mean} pool by mean and are sharded by rows, beside tables {others} sharded "
                         f"otherwise: TorchRec divides the row-wise sums after their reduce-scatter by a callback "
                         f"that divides every table of the collection, so {others} would be divided too. Shard "
                         f"{mean} table-wise or column-wise, pool them by sum, or put them in a collection of "
                         f"their own")


class ShardedDiskEmbeddingBagCollection(DiskShardedTables, ShardedEmbeddingBagCollection):
    """TorchRec's ShardedEmbeddingBagCollection whose ``customized_kernel`` tables live on disk."""

    tables_attribute = "embedding_bags"

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, options: DiskTableOptions, **kwargs: Any) -> None:
        _check_mean_pooling(module, table_name_to_parameter_sharding)
        self._init_disk_tables(table_name_to_parameter_sharding, options, module.embedding_bag_configs())
        super().__init__(module, table_name_to_parameter_sharding, env, **kwargs)
        self._register_disk_state_dict_hooks()

    def create_embedding_bag_sharding(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                                      device: Optional[torch.device] = None, permute_embeddings: bool = False,
                                      qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        on_disk = [i.param_sharding.compute_kernel == DISK_KERNEL for i in sharding_infos]
        if not any(on_disk):
            return ShardedEmbeddingBagCollection.create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings=permute_embeddings,
                qcomm_codecs_registry=qcomm_codecs_registry)
        refuse_unfit_disk_shardings(sharding_infos, sharding_type, list(DISK_SHARDINGS))
        kwargs: Dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            kwargs["permute_embeddings"] = permute_embeddings
        sharding = DISK_SHARDINGS[sharding_type](sharding_infos, env, device, **kwargs)
        sharding.disk_options = self._disk_options
        return sharding


class DiskEmbeddingBagCollectionSharder(DiskSharder, EmbeddingBagCollectionSharder):
    """EmbeddingBagCollectionSharder that can put tables on disk (compute kernel ``customized_kernel``).

    Pass it to DistributedModelParallel (and to the planner) in place of TorchRec's sharder;
    the plan says which tables go to disk (`DiskAwarePlanner` decides by memory).

    Args:
        storage_dir: where disk tables live; rank r uses ``storage_dir/rank<r>``.
        memory_fraction: host memory of a disk shard (cache, store log, buffers), as a fraction of
            its bytes on disk (weights and optimizer state), but at least what one table opens with
            (`memory_budget.shard_memory_budget`); the planner charges the shard the same bytes.
        cuts: reopen each rank's tables at the cut given for it ({rank: record}, the records a
            training checkpoint holds) instead of the last one its directory records.
        live_ids: the ids a table is expected to hold, by table name, where far fewer than its rows:
            a table of raw ids as large as their id space (2**40 rows) holds only the ids trained on,
            and the planner and each shard's memory budget count those (a row shard its share).
        settings: how the disk tables train and are stored (`DiskTableSettings`), or its fields by
            keyword (``optimizer``, ``staleness``, ``cache_policy``, ``backend``, ``seed``,
            ``reopen``, ``virtual_tables``):

            - optimizer: the fused rule of every table without an in-backward optimizer
              (`apply_optimizer_in_backward` takes precedence); the in-memory tables of the plan get
              the same rule through TorchRec's fused parameters. Default: ``fused_params`` read as
              FBGEMM reads them (what they leave out takes FBGEMM's default: exact SGD at 0.01).
            - seed: default read from the state of torch's generator when the sharder is built
              (every rank must build it at the same point after the same ``torch.manual_seed``, or
              pass one). A reopened table keeps its recorded seed.
            - reopen: continue from the rows and optimizer state `storage_dir` holds, each rank's
              tables at the last cut its directory records; without it, disk tables holding rows
              are refused (FileExistsError).
            - virtual_tables: each rank's shard of a ``use_virtual_table`` table keeps at most its
              policy's training_id_eviction_trigger_count ids (the policy read from the table's
              config, whatever the sharding), and the planner sizes it by that. Row-wise, its
              total_num_buckets must be a multiple of the ranks.
        fused_params: TorchRec's fused parameters, as for EmbeddingBagCollectionSharder.
        **kwargs: EmbeddingBagCollectionSharder's other arguments (``qcomm_codecs_registry``).
    """

    disk_sharding_types = tuple(DISK_SHARDINGS)

    def sharded_module_arguments(self) -> Dict[str, Any]:
        return {"sharded_module_order_overwrite": self._sharded_module_order_overwrite}

    @property
    def sharded_module_type(self) -> Type[ShardedDiskEmbeddingBagCollection]:
        return ShardedDiskEmbeddingBagCollection
