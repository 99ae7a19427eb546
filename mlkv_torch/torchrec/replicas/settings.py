"""What a user sets of the replicas (`ReplicaSettings`) and what a table's replica costs in host
memory (`replica_memory_bytes`)."""
from __future__ import annotations

import dataclasses

from ...checks import is_int


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """How hot rows are replicated (the runner's ``storage.replicas``).

    Args:
        fraction: the rows chosen for replicas, a share of the sharded tables' rows (together, the
            hottest of any table), in [0, 1); 0: none. A rank keeps those of the tables it replicates.
        pull_bound: a replica serves a row at most this many of the owner's updates stale.
        push_bound: a rank's gradient of a replicated row reaches its owner at most this many steps late.
        refresh_every: steps between choices of the hot rows (after the first).
        warmup_steps: steps whose lookups are counted before the first choice.
    """

    fraction: float = 0.0
    pull_bound: int = 0
    push_bound: int = 0
    refresh_every: int = 25
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1), got {self.fraction!r}")
        for key in ("pull_bound", "push_bound"):
            value = getattr(self, key)
            if not is_int(value) or value < 0:
                raise ValueError(f"{key} must be a non-negative int, got {value!r}")
        for key in ("refresh_every", "warmup_steps"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")


def replica_memory_bytes(rows: int, dim: int, fraction: float) -> int:
    """Host bytes of one table's replica: its rows and their unpushed gradients (float32), and per
    row its id, the step of its value and of its oldest unpushed gradient."""
    hot = int(fraction * rows)
    return hot * (2 * dim * 4 + 3 * 8 + 1)
