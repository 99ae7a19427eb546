"""Table-column-wise sharding of disk tables: TorchRec's, with the disk lookup."""
from __future__ import annotations

from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from .lookup import DiskLookupMixin


class DiskTwCwSharding(DiskLookupMixin, TwCwPooledEmbeddingSharding):
    """TorchRec's table-column-wise sharding whose disk groups look up through DiskEmbeddingKernel."""

    lookup_sharding_type = ShardingType.TABLE_COLUMN_WISE
