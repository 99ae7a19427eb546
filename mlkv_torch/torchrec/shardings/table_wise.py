"""Table-wise sharding of disk tables: TorchRec's, with the disk lookup."""
from __future__ import annotations

from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from .lookup import DiskLookupMixin


class DiskTwSharding(DiskLookupMixin, TwPooledEmbeddingSharding):
    """TorchRec's table-wise sharding whose disk groups look up through DiskEmbeddingKernel."""

    lookup_sharding_type = ShardingType.TABLE_WISE
