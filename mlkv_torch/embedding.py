"""DiskEmbeddingBag: an embedding bag whose table lives in a KVStore.

Forward reads the distinct ids of the batch from the store (rows never written
read as `initial_rows`), pools them as torch.nn.EmbeddingBag does, and
backward applies a row-wise sparse optimizer to the touched rows and writes
them back: no dense weight gradient exists. Each store row holds the weights
followed by the optimizer state, so one read brings both.

This is the exact (staleness 0), CPU form of the op. The hot cache in device
memory, asynchronous writes within a staleness bound, and the CUDA kernels of
issue 3 build on it.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import optim as optim_lib
from .store import KVStore, initial_rows

__all__ = ["DiskEmbeddingBag"]

_MODES = ("sum", "mean")


class _DiskEmbeddingBagFunction(torch.autograd.Function):
    """Autograd glue: `anchor` (an empty parameter) makes backward run even
    when no other input needs a gradient; under no_grad no graph exists and
    nothing is updated."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, table: "DiskEmbeddingBag", ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        weights = table._read_rows(unique)[:, : table.embedding_dim]
        out = F.embedding_bag(inverse, weights, offsets, mode=table.mode, per_sample_weights=per_sample_weights,
                              include_last_offset=True)
        ctx.table = table
        ctx.save_for_backward(unique, inverse, offsets, weights, per_sample_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        table: DiskEmbeddingBag = ctx.table
        unique, inverse, offsets, weights, per_sample_weights = ctx.saved_tensors
        leaf = weights.detach().requires_grad_(True)
        psw = None
        if per_sample_weights is not None:
            psw = per_sample_weights.detach().requires_grad_(ctx.needs_input_grad[4])
        with torch.enable_grad():
            out = F.embedding_bag(inverse, leaf, offsets, mode=table.mode, per_sample_weights=psw, include_last_offset=True)
            wanted = [leaf] + ([psw] if psw is not None and psw.requires_grad else [])
            grads = torch.autograd.grad(out, wanted, grad_out)
        # Rows of distinct ids: duplicates in the batch are already summed, as in a coalesced sparse gradient.
        table._apply_gradients(unique, grads[0])
        grad_psw = grads[1] if len(grads) > 1 else None
        return None, None, None, None, grad_psw


class DiskEmbeddingBag(nn.Module):
    """An embedding bag over a table larger than memory, trained by a fused sparse optimizer.

    Computes what ``torch.nn.EmbeddingBag`` computes (1-D input with offsets,
    2-D fixed-length bags, sum and mean, per_sample_weights with sum, empty
    bags, repeated ids); ``backward`` updates every touched row with
    `optimizer`, exactly as the matching torch optimizer would on a sparse
    gradient.

    Args:
        num_embeddings: rows in the table; ids must lie in [0, num_embeddings).
        embedding_dim: elements per row.
        path: the store's directory (created, or reopened with its rows).
        mode: "sum" or "mean".
        optimizer: a `mlkv_torch.optim` rule (SGD, Adagrad, RowWiseAdagrad, Adam).
        memory_budget_bytes: memory of the store's log (rows beyond live on disk).
        seed: seed of the initial values of rows never written.
        include_last_offset: as in nn.EmbeddingBag.
        expected_rows: sizes the store's index; default min(num_embeddings, 4M).

    Example::

        emb = DiskEmbeddingBag(10_000_000, 64, path="/data/t0", optimizer=optim.SGD(lr=0.1))
        out = emb(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
        out.sum().backward()   # rows 1-4 are updated in the store
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, path: Union[str, os.PathLike], mode: str = "sum",
                 optimizer: Optional[optim_lib.SparseOptimizer] = None, memory_budget_bytes: int = 64 << 20,
                 seed: int = 0, include_last_offset: bool = False, expected_rows: Optional[int] = None) -> None:
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        optimizer = optimizer if optimizer is not None else optim_lib.SGD()
        if not isinstance(optimizer, optim_lib.SparseOptimizer):
            raise TypeError(f"optimizer must be a mlkv_torch.optim rule, got {type(optimizer).__name__}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.optimizer = optimizer
        self.seed = seed
        self.include_last_offset = include_last_offset
        self._state_dim = optimizer.state_dim(embedding_dim)
        self._step = 0
        self._anchor = nn.Parameter(torch.empty(0))
        self._store = KVStore(path, embedding_dim + self._state_dim, torch.float32, memory_budget_bytes,
                              expected_rows=expected_rows or min(num_embeddings, 1 << 22))

    # ---- rows -------------------------------------------------------------------------------------
    def _read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, dim + state_dim]: stored rows, and initial rows for ids never written."""
        rows, found = self._store.lookup(ids)
        if not bool(found.all()):
            fresh = ~found
            rows[fresh, : self.embedding_dim] = initial_rows(ids[fresh], self.embedding_dim, seed=self.seed,
                                                             num_embeddings=self.num_embeddings)
            if self._state_dim:
                rows[fresh, self.embedding_dim:] = self.optimizer.initial_state(int(fresh.sum()), self.embedding_dim)
        return rows

    def _apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self._step += 1
        # Read again: another call on this table in the same step may have updated these rows.
        rows = self._read_rows(ids)
        weights, state = rows[:, : self.embedding_dim], rows[:, self.embedding_dim:]
        self.optimizer.update(weights, state, grads, self._step)
        self._store.put(ids, rows)

    def export_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Current weights [n, dim] of these rows."""
        return self._read_rows(self._check_ids(ids))[:, : self.embedding_dim].clone()

    def import_rows(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Sets these rows' weights; their optimizer state starts afresh."""
        ids = self._check_ids(ids)
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (ids.numel(), self.embedding_dim):
            raise ValueError(f"weights must be a tensor of shape [{ids.numel()}, {self.embedding_dim}]")
        state = self.optimizer.initial_state(ids.numel(), self.embedding_dim)
        self._store.put(ids, torch.cat([weights.detach().to(torch.float32).cpu(), state], dim=1))

    def flush(self) -> None:
        """Waits until every write is in the store."""
        self._store.flush()

    def stats(self) -> Dict[str, Any]:
        """The store's counters and the optimizer step count."""
        return dict(self._store.stats(), step=self._step)

    def close(self) -> None:
        """Checkpoints the table and releases its directory."""
        self._store.close()

    # ---- forward ----------------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids must be an int64 or int32 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
        ids = ids.to(torch.int64)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise ValueError(f"id {bad} is out of range [0, {self.num_embeddings})")
        return ids

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pools rows per bag, with torch.nn.EmbeddingBag's conventions; returns [bags, dim]."""
        ids = self._check_ids(input)
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (fixed-length bags)")
            bags, length = ids.shape
            offsets = torch.arange(bags + 1, dtype=torch.int64) * length
            ids = ids.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("offsets are required when input is 1-D")
            if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) or offsets.dim() != 1:
                raise TypeError("offsets must be a 1-D int64 or int32 tensor")
            offsets = offsets.to(torch.int64)
            if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                                    or int(offsets[-1]) > ids.numel()):
                raise ValueError(f"offsets must start at 0, not decrease, and not exceed the input length {ids.numel()}")
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([ids.numel()], dtype=torch.int64)])
            elif offsets.numel() == 0 or int(offsets[-1]) != ids.numel():
                raise ValueError("with include_last_offset, the last offset must equal the input length")
        else:
            raise ValueError(f"input must be 1-D or 2-D, got shape {tuple(ids.shape)}")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError("per_sample_weights are only supported with mode='sum'")
            if tuple(per_sample_weights.shape) != (ids.numel(),):
                raise ValueError(f"per_sample_weights must have the input's shape, got {tuple(per_sample_weights.shape)}")
            per_sample_weights = per_sample_weights.to(torch.float32)
        return _DiskEmbeddingBagFunction.apply(self._anchor, self, ids, offsets, per_sample_weights)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer}, "
                f"path={self._store.path!r}")
