"""Column-wise sharding of disk tables: TorchRec's, with the disk lookup."""
from __future__ import annotations

from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from .lookup import DiskLookupMixin


class DiskCwSharding(DiskLookupMixin, CwPooledEmbeddingSharding):
    """TorchRec's column-wise sharding whose disk groups look up through DiskEmbeddingKernel."""

    lookup_sharding_type = ShardingType.COLUMN_WISE
