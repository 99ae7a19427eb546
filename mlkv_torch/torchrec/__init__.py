"""TorchRec integration.

- `DiskEmbeddingBagCollection`: a drop-in for EmbeddingBagCollection with every table on disk.
- `DiskEmbeddingCollection`: a drop-in for EmbeddingCollection (one embedding per id) with every table on disk.
- `DiskEmbeddingBagCollectionSharder`, `DiskEmbeddingCollectionSharder` and `DiskAwarePlanner`: under
  DistributedModelParallel, the planner puts the tables that do not fit memory on disk, the rest keep
  TorchRec's kernels.
- `PrefetchPipeline`: TorchRec's PrefetchTrainPipelineSparseDist, which reads the next batch's disk rows
  ahead through the sharded modules' ``prefetch``, also on the CPU.
- `replicate_hot_rows`: replicas of sharded tables' hot rows on every rank, within staleness bounds (HET).
- `load_export`: an export's tables (`python -m mlkv_torch.export`) into a model, on any world and plan.

Importing this module needs torchrec; the core package (`mlkv_torch`) does not.
"""
from .collection import DiskEmbeddingBagCollection
from .sequence_collection import DiskEmbeddingCollection
from .planner import DiskAwarePerfEstimator, DiskAwarePlanner, DiskAwareStorageEstimator
from .kernel import DISK_KERNEL
from .sharded_collection import DiskEmbeddingBagCollectionSharder, ShardedDiskEmbeddingBagCollection
from .sharded_sequence_collection import DiskEmbeddingCollectionSharder, ShardedDiskEmbeddingCollection
from .prefetch_pipeline import PrefetchPipeline
from .replicas import HotRowReplicas, ReplicaSettings, replica_memory_bytes, replicate_hot_rows
from .state_dicts import disk_tables_left_out
from .load_export import load_export

__all__ = ["HotRowReplicas", "ReplicaSettings", "replica_memory_bytes", "replicate_hot_rows",
           "DiskEmbeddingBagCollection", "DiskEmbeddingCollection",
           "DiskEmbeddingBagCollectionSharder", "ShardedDiskEmbeddingBagCollection",
           "DiskEmbeddingCollectionSharder", "ShardedDiskEmbeddingCollection",
           "DiskAwarePlanner", "DiskAwarePerfEstimator", "DiskAwareStorageEstimator", "DISK_KERNEL",
           "disk_tables_left_out", "PrefetchPipeline", "load_export"]
