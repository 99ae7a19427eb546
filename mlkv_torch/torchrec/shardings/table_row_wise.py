"""Table-row-wise sharding of disk tables: TorchRec's, with the disk lookup. A table's rows are
split by blocks across the ranks of one node, its partial sums reduced within the node."""
from __future__ import annotations

from typing import List

from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from .lookup import DiskLookupMixin
from .variable_batch_output import EitherBatchOutputDistMixin, TwRwPooledDistOfEitherBatch


class DiskTwRwSharding(DiskLookupMixin, EitherBatchOutputDistMixin, TwRwPooledEmbeddingSharding):
    """TorchRec's table-row-wise sharding whose disk groups look up through DiskEmbeddingKernel."""

    lookup_sharding_type = ShardingType.TABLE_ROW_WISE
    output_dist_class = TwRwPooledDistOfEitherBatch

    def lookup_configs(self) -> List[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs_per_rank[self._rank]
