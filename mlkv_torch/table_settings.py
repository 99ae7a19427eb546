"""How disk tables train and are stored, whatever opens them: `DiskTableSettings`, which the
one-process collections and the sharders take (as an object or by keyword) and hand down to their
kernels, and the part of it every table batch of a collection shares (`BatchSettings`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from . import optim as optim_lib
from .checks import is_int
from .disk_table import draw_seed
from .virtual_tables import VirtualTableOptions

__all__ = ["BatchSettings", "DiskTableSettings", "BACKENDS", "CACHE_POLICIES"]

BACKENDS = ("mlkv", "rocksdb")  # the stores a table can sit on
CACHE_POLICIES = ("lfu", "lru")


@dataclass(frozen=True)
class BatchSettings:
    """What the table batches of a collection share beside their row layout.

    Args:
        staleness: updates a forward may miss per row (0: exact).
        cache_policy: "lfu" (frequency-based admission) or "lru".
        backend: "mlkv" (KVStore) or "rocksdb" (RocksDBStore).
    """

    staleness: int = 0
    cache_policy: str = "lfu"
    backend: str = "mlkv"

    def __post_init__(self) -> None:
        if not is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {self.staleness!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {CACHE_POLICIES}, got {self.cache_policy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True)
class DiskTableSettings:
    """How a set of disk tables trains and is stored: one frozen object, checked when made, that
    DiskEmbeddingBagCollection, DiskEmbeddingCollection and the sharders take (``settings=``, or
    these fields by keyword) and hand down to every table they open.

    Args:
        optimizer: the fused sparse optimizer of the tables (an `mlkv_torch.optim` rule). None:
            the front door's default (the collections: SGD(lr=0.01) with a warning; the sharders:
            TorchRec's fused parameters, read as FBGEMM reads them).
        staleness: updates a forward may miss per row (0: exact read-your-writes).
        cache_policy: "lfu" (frequency-based admission) or "lru".
        backend: the store under every table: "mlkv" (KVStore) or "rocksdb" (the baseline).
        seed: seed of the initial rows (each table mixes in its name); None: read from torch's
            default generator when the tables are built (`draw_seed`), so ``torch.manual_seed``
            makes runs reproducible. A reopened table keeps the seed recorded in its directory.
        reopen: continue from the rows and optimizer state the tables' directories hold from an
            earlier run, at their last cut; without it, tables holding rows are refused
            (FileExistsError).
        virtual_tables: for tables with ``use_virtual_table``: the frequency filter, the clock of
            their eviction policy and the cap after a round (`VirtualTableOptions`).
        read_ahead_into_slots: rows read ahead go straight into cache slots, and the batch's
            forward pools from its read-ahead (no second deduplication; on CUDA no host
            synchronisation); None: on CUDA only (`DiskTableBatch`'s).
    """

    optimizer: Optional[optim_lib.SparseOptimizer] = None
    staleness: int = 0
    cache_policy: str = "lfu"
    backend: str = "mlkv"
    seed: Optional[int] = None
    reopen: bool = False
    virtual_tables: Optional[VirtualTableOptions] = None
    read_ahead_into_slots: Optional[bool] = None
    # The seed was drawn (`with_seed`), not chosen: a reopened table then keeps its recorded one.
    seed_drawn: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        BatchSettings(self.staleness, self.cache_policy, self.backend)  # checks them
        if self.optimizer is not None and not isinstance(self.optimizer, optim_lib.SparseOptimizer):
            raise TypeError(f"optimizer must be an mlkv_torch.optim rule (e.g. mlkv_torch.optim.Adagrad(lr=0.1)), "
                            f"got {type(self.optimizer).__name__}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.reopen, bool):
            raise TypeError(f"reopen must be a bool, got {self.reopen!r}")
        if self.read_ahead_into_slots is not None and not isinstance(self.read_ahead_into_slots, bool):
            raise TypeError(f"read_ahead_into_slots must be a bool or None, got {self.read_ahead_into_slots!r}")
        if self.virtual_tables is not None and not isinstance(self.virtual_tables, VirtualTableOptions):
            raise TypeError(f"virtual_tables must be a VirtualTableOptions, got {type(self.virtual_tables).__name__}")

    @property
    def batch(self) -> BatchSettings:
        """What the table batches share (staleness, cache policy, backend)."""
        return BatchSettings(self.staleness, self.cache_policy, self.backend)

    def with_seed(self) -> "DiskTableSettings":
        """These settings with a seed: the one given, else drawn now (`draw_seed`)."""
        if self.seed is not None:
            return self
        return replace(self, seed=draw_seed(), seed_drawn=True)

    @classmethod
    def keywords(cls) -> Tuple[str, ...]:
        """The fields a front door takes by keyword."""
        return tuple(f.name for f in fields(cls) if f.name != "seed_drawn")

    @classmethod
    def of(cls, settings: Optional["DiskTableSettings"], keywords: Mapping[str, Any], owner: str
           ) -> "DiskTableSettings":
        """`settings` (default: the defaults) with the fields `keywords` names replaced; TypeError
        names a keyword that is not a field, as Python names an unexpected argument of `owner`."""
        unknown = sorted(set(keywords) - set(cls.keywords()))
        if unknown:
            raise TypeError(f"{owner} got unexpected keyword arguments {unknown}; the disk tables' settings are "
                            f"{list(cls.keywords())} (DiskTableSettings)")
        if settings is not None and not isinstance(settings, DiskTableSettings):
            raise TypeError(f"settings must be a DiskTableSettings, got {type(settings).__name__}")
        chosen = dict(keywords)
        if "seed" in chosen:  # a seed given is chosen, not drawn
            chosen["seed_drawn"] = False
        return replace(settings if settings is not None else cls(), **chosen)

    @classmethod
    def split_keywords(cls, keywords: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """`keywords` as (the settings' fields, the rest) for a front door that passes the rest on."""
        ours = set(cls.keywords())
        return ({k: v for k, v in keywords.items() if k in ours}, {k: v for k, v in keywords.items() if k not in ours})
