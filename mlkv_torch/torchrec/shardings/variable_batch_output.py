"""The output distributions of row-wise shardings, for fixed and variable batches in one run.

Replicas of hot rows (`replicas/`) send a collection fixed batches until they first choose rows
and variable batches per feature after. TorchRec makes a row-wise output dist's modules on its
first call, for that call's kind of batch only; and it sums the bags' partial poolings of a
variable batch with a reduce-scatter-v, whose backward (an all-gather of unequal parts) NCCL has
and gloo refuses. Here both kinds are made as needed, and on gloo the sum is an all-to-all (rank r
receives every rank's part for r) and a local sum, its backward the reverse all-to-all, divided by
the ranks where TorchRec divides its own (`get_gradient_division`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable, NoWait

__all__ = ["EitherBatchOutputDistMixin", "RwPooledDistOfEitherBatch", "TwRwPooledDistOfEitherBatch",
           "VariableBatchReduceScatterByAllToAll"]


def _has_reduce_scatter_v(pg: dist.ProcessGroup) -> bool:
    return dist.get_backend(pg) == "nccl"


def _is_variable(sharding_ctx: Optional[EmbeddingShardingContext]) -> bool:
    return bool(sharding_ctx is not None and sharding_ctx.variable_batch_per_feature)


class EitherBatchOutputDistMixin:
    """For a TorchRec sharding: its output dist becomes `output_dist_class`, a subclass of TorchRec's
    that adds no state (the same object, another forward)."""

    output_dist_class: type

    def create_output_dist(self, device: Optional[torch.device] = None
                           ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        output_dist = super().create_output_dist(device)  # type: ignore[misc]
        output_dist.__class__ = self.output_dist_class
        return output_dist


class RwPooledDistOfEitherBatch(RwPooledEmbeddingDist):
    """TorchRec's row-wise reduce-scatter, for fixed and variable batches in one run."""

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
                ) -> Awaitable[torch.Tensor]:
        # Made here only: the class is swapped in before TorchRec's first call made one.
        variable = _is_variable(sharding_ctx)
        made: Dict[bool, nn.Module] = self.__dict__.setdefault("_dist_by_batch_kind", {})
        if variable not in made:
            if variable and not _has_reduce_scatter_v(self._pg):
                made[variable] = VariableBatchReduceScatterByAllToAll(self._pg)
            else:
                self._dist = None
                self._create_output_dist_module(sharding_ctx)
                made[variable] = self._dist
        self._dist = made[variable]
        return super().forward(local_embs, sharding_ctx)


class TwRwPooledDistOfEitherBatch(TwRwPooledEmbeddingDist):
    """TorchRec's table-row-wise output dist (a reduce-scatter within the node, then an all-to-all
    across nodes), for fixed and variable batches in one run."""

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
                ) -> Awaitable[torch.Tensor]:
        if _is_variable(sharding_ctx) and self._variable_intra_dist is None:
            self._create_output_dist_modules(sharding_ctx)  # makes both kinds
            if not _has_reduce_scatter_v(self._intra_pg):
                self._variable_intra_dist = VariableBatchReduceScatterByAllToAll(self._intra_pg)
        return super().forward(local_embs, sharding_ctx)


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single of a 1-D tensor; its backward is the reverse one, times `scale`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.scale = (output_splits, input_splits), group, scale
        output = input.new_empty(sum(output_splits))
        dist.all_to_all_single(output, input.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None]:
        output_splits, input_splits = ctx.splits
        grad_input = grad.new_empty(sum(input_splits))
        dist.all_to_all_single(grad_input, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return (grad_input * ctx.scale if ctx.scale != 1.0 else grad_input), None, None, None, None


class VariableBatchReduceScatterByAllToAll(nn.Module):
    """TorchRec's VariableBatchPooledEmbeddingsReduceScatter, same call and result, through an all-to-all."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        super().__init__()
        self._pg = pg

    def forward(self, local_embs: torch.Tensor, batch_size_per_rank_per_feature: List[List[int]],
                embedding_dims: List[int]) -> PooledEmbeddingsAwaitable:
        world, rank = self._pg.size(), self._pg.rank()
        if world <= 1:
            return PooledEmbeddingsAwaitable(tensor_awaitable=NoWait(local_embs))
        # Rank r's part: its bags of every feature, in feature order (TorchRec's input splits).
        parts = [sum(b * d for b, d in zip(batch_size_per_rank_per_feature[r], embedding_dims)) for r in range(world)]
        scale = 1.0 / world if get_gradient_division() else 1.0  # a step's gradient as on one rank
        received = _AllToAll.apply(local_embs.reshape(-1), [parts[rank]] * world, parts, self._pg, scale)
        return PooledEmbeddingsAwaitable(tensor_awaitable=NoWait(received.view(world, parts[rank]).sum(0)))
