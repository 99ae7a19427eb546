"""What a caller may ask of a module that holds disk tables (`DiskTableModule`): the one-process
collections and a rank's sharded collections alike, so the runner and the look-ahead pipeline call
methods instead of probing for them."""
from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .cut import PendingCut

__all__ = ["DiskTableModule"]


class DiskTableModule(abc.ABC):
    """A module holding disk tables: DiskEmbeddingBagCollection and DiskEmbeddingCollection (one
    process, every table on disk), and ShardedDiskEmbeddingBagCollection and
    ShardedDiskEmbeddingCollection (this rank's shards of the tables a plan put on disk; possibly
    none)."""

    @property
    @abc.abstractmethod
    def disk_table_names(self) -> List[str]:
        """The tables on disk (under a plan, those planned on the disk kernel, on every rank alike)."""

    @property
    @abc.abstractmethod
    def lookahead_process_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that must call `lookahead` together, batch for batch; None when a rank's call
        is its own (one process, or no disk table)."""

    @abc.abstractmethod
    def lookahead(self, features: Any) -> Optional[int]:
        """Starts reading the rows a future batch's KeyedJaggedTensor will look up; returns at once,
        with the read-ahead's token (None: nothing to read)."""

    @abc.abstractmethod
    def read_ahead_next(self, token: Optional[int]) -> None:
        """The next training forward is the batch read ahead as `token` (None: one not read ahead):
        its lookup pools from that read-ahead instead of finding the batch among them by its ids."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Applies queued updates and writes changed rows to the stores."""

    @abc.abstractmethod
    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Each table's (or shard's) DiskEmbeddingBag.stats(), by name."""

    @abc.abstractmethod
    def local_disk_shards(self) -> List[Tuple[str, int, int, Any]]:
        """(table, first row, first column, DiskEmbeddingBag) of each disk table block held here:
        a whole table in one process, this rank's shards under a plan."""

    @abc.abstractmethod
    def populate(self) -> int:
        """Writes every row to its store and takes a cut; returns the rows."""

    @abc.abstractmethod
    def begin_checkpoint(self, label: Optional[int] = None) -> Optional[PendingCut]:
        """Begins a cut of the tables at this step boundary (None where this rank holds none)."""

    @abc.abstractmethod
    def checkpoint(self, label: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Takes a cut and commits it; its record (None where this rank holds no tables)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Takes a last cut, then closes the tables."""
