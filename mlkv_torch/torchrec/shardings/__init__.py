"""The sharding types disk tables take, each TorchRec's own with the disk lookup."""
from __future__ import annotations

from torchrec.distributed.types import ShardingType

from .column_wise import DiskCwSharding
from .row_wise import DiskRwSharding
from .table_column_wise import DiskTwCwSharding
from .table_row_wise import DiskTwRwSharding
from .table_wise import DiskTwSharding

DISK_SHARDINGS = {ShardingType.TABLE_WISE.value: DiskTwSharding, ShardingType.COLUMN_WISE.value: DiskCwSharding,
                  ShardingType.TABLE_COLUMN_WISE.value: DiskTwCwSharding, ShardingType.ROW_WISE.value: DiskRwSharding,
                  ShardingType.TABLE_ROW_WISE.value: DiskTwRwSharding}
