"""Whether state dicts hold the disk tables' rows: `disk_tables_left_out` leaves them out for a
checkpoint that keeps them in cuts of their own."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_disk_tables_in_state_dict: contextvars.ContextVar[bool] = contextvars.ContextVar("disk_tables_in_state_dict",
                                                                                 default=True)


@contextlib.contextmanager
def disk_tables_left_out() -> Iterator[None]:
    """Within it, ``state_dict()`` of a sharded model and of its optimizer leaves the disk tables'
    rows and optimizer state out (only their step counts stay), and ``load_state_dict()`` does
    not miss them: a training checkpoint that holds them in cuts of their own
    (`ShardedDiskEmbeddingBagCollection.checkpoint`) saves the rest with
    torch.distributed.checkpoint, and copies no row."""
    token = _disk_tables_in_state_dict.set(False)
    try:
        yield
    finally:
        _disk_tables_in_state_dict.reset(token)


def disk_tables_in_state_dict() -> bool:
    """False within `disk_tables_left_out`."""
    return _disk_tables_in_state_dict.get()
