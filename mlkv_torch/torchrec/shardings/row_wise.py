"""Row-wise sharding of disk tables: TorchRec's, with the disk lookup. Each rank holds a block of
every table's rows (TorchRec's bucketization sends it the ids of its block, local to it) and the
ranks' pooled partial sums are reduced to each bag's rank (a reduce-scatter)."""
from __future__ import annotations

from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from .lookup import DiskLookupMixin
from .variable_batch_output import EitherBatchOutputDistMixin, RwPooledDistOfEitherBatch


class DiskRwSharding(DiskLookupMixin, EitherBatchOutputDistMixin, RwPooledEmbeddingSharding):
    """TorchRec's row-wise sharding whose disk groups look up through DiskEmbeddingKernel."""

    lookup_sharding_type = ShardingType.ROW_WISE
    output_dist_class = RwPooledDistOfEitherBatch
