"""The autograd glue of a step with replicas: the hits' ids pooled from the replica rows
(`ServedHits`) or from the rows push bags refreshed (`PushedHits`), and what the rank owes for
pushed rows (`Owed`)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .groups import GroupStep, ReplicaGroup


@dataclasses.dataclass
class HitIds:
    """Some ids of a group's hit bags, pooled together: `rows` into the table they are read from,
    `offsets` (one per hit bag, and their count) into `rows`, `weights` per id or None."""

    rows: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]

    def pooled(self, table: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(self.rows, table, self.offsets, mode="sum", per_sample_weights=self.weights,
                               include_last_offset=True)

    def per_id(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of each id, from that of the pooled bags."""
        per_id = grad.repeat_interleave(self.offsets.diff(), dim=0)
        return per_id * self.weights.unsqueeze(1) if self.weights is not None else per_id

    @staticmethod
    def of(step: "GroupStep", bag_of_id: torch.Tensor, take: torch.Tensor, rows: torch.Tensor,
           even_none: bool = False) -> Optional["HitIds"]:
        """The hit ids `take` (a mask over them; `bag_of_id` the hit bag of each), read at `rows`;
        None if no id is taken, unless `even_none`."""
        taken = take.nonzero().squeeze(1)
        if taken.numel() == 0 and not even_none:
            return None
        bags = step.hit_offsets.numel() - 1
        per_bag = torch.bincount(bag_of_id[taken], minlength=bags)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(per_bag)
        weights = step.hit_weights[taken] if step.hit_weights is not None else None
        return HitIds(rows[taken], offsets, weights)


class ServedHits(torch.autograd.Function):
    """The hits' ids served from the replica rows, pooled. Backward adds their gradients to what the
    rank owes. Nothing in the graph needs its backward, so autograd runs it while the gradients' all-to-all
    is in flight: created after TorchRec's request and before its wait, it comes after the wait's
    backward (which sends) and before the request's (which waits). `anchor`, a leaf, puts it in the graph."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, group: "ReplicaGroup", served: HitIds) -> torch.Tensor:
        ctx.group, ctx.served = group, served
        return served.pooled(group.values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None]:
        served = ctx.served
        ctx.group.pending.index_add_(0, served.rows, served.per_id(grad))
        return None, None, None


class PushedHits(torch.autograd.Function):
    """The hits' ids of rows sent as push bags, pooled from the rows the push bags refreshed
    (`fresh`). Backward: each push bag's gradient is its ids' plus what the rank owed for its row."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, pushed: HitIds, owed: torch.Tensor) -> torch.Tensor:
        ctx.pushed, ctx.owed = pushed, owed
        return pushed.pooled(fresh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        pushed = ctx.pushed
        return ctx.owed.clone().index_add_(0, pushed.rows, pushed.per_id(grad)), None, None


class Owed(torch.autograd.Function):
    """Identity forward; backward gives the push bags' rows what the rank owed for them (a group
    with no hit in the step)."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, owed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(owed)
        return fresh.view_as(fresh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (owed,) = ctx.saved_tensors
        return grad + owed, None
