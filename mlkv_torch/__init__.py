"""mlkv-torch: embedding tables larger than memory, on a log-structured disk store.

The core (KVStore) needs only torch; TorchRec integration lives in
``mlkv_torch.torchrec``.
"""
from . import optim
from .embedding import DiskEmbeddingBag
from .memory_budget import MemoryBudgetError
from .pipeline import LookaheadPipeline
from .store import CorruptionError, KVStore, RocksDBStore, initial_rows
from .table_files import remove_tables
from .table_settings import DiskTableSettings

__all__ = ["KVStore", "RocksDBStore", "CorruptionError", "DiskEmbeddingBag", "DiskTableSettings", "MemoryBudgetError",
           "remove_tables",
           "LookaheadPipeline", "initial_rows", "optim"]
__version__ = "0.1.0"
