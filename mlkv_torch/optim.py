"""Row-wise sparse optimizers for disk-backed embedding tables.

Each optimizer is a small frozen config with the update rule it stands for.
The rule works on the rows a batch touched: `weights` and `state` are the
current rows [n, dim] and their optimizer state [n, state_dim(dim)] (kept in
the same store row as the weights, so one read brings both), and `grads` the
coalesced gradient rows (duplicate ids already summed). It updates both in
place. The rule itself is written once, in C++ (csrc/row_ops.h): `update`
runs it on CPU tensors, and DiskEmbeddingBag's cache runs it fused over its
rows (and in cuda/ on a GPU), so these tests of `update` check the code that
trains.

- SGD: ``torch.optim.SGD`` on a sparse gradient.
- Adagrad: ``torch.optim.Adagrad`` (lr_decay 0, no weight decay).
- RowWiseAdagrad: FBGEMM's EXACT_ROWWISE_ADAGRAD (one accumulator per row).
- Adam: ``torch.optim.SparseAdam`` (its step count is per table, not per row).

Each rule does the reference's operations in its order and fuses a multiply-add
where the reference's CPU kernel does, so SGD's rows equal TorchRec's fused
kernel and ``torch.optim.SGD`` to the bit. The others agree to rounding:
torch's CPU ``sqrt`` is not correctly rounded, fbgemm adds Adagrad's eps in
double and sums row-wise squares in SIMD lanes (docs/testing.md, "How exact").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from . import _C

__all__ = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "SparseOptimizer"]


class SparseOptimizer:
    """Base of the row-wise optimizers: the state layout and the update rule."""

    kind: int = -1  # the rule's number in csrc/row_ops.h (OptimizerKind)
    name: str = ""  # as configs, checkpoints and exports name the rule
    lr: float

    def rule_constants(self) -> Tuple[float, float, float]:
        """(eps, beta1, beta2): what the fused rule keeps for the life of a table (the learning rate
        comes with each step, as a schedule sets it); 0 where the rule has none."""
        return 0.0, 0.0, 0.0

    def hyperparameters(self) -> Tuple[float, float, float, float]:
        """(lr, eps, beta1, beta2) as the fused rule takes them."""
        return (self.lr, *self.rule_constants())

    def state_dim(self, dim: int) -> int:
        """Optimizer state elements kept per row beside its `dim` weights."""
        raise NotImplementedError

    def initial_state(self, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The state of rows never updated: [rows, state_dim(dim)]."""
        return torch.zeros(rows, self.state_dim(dim), dtype=dtype)

    def joined_state(self, parts: Sequence[torch.Tensor], columns: Sequence[int]) -> torch.Tensor:
        """The state of whole rows from that of their column blocks (`parts[i]`: [n, state_dim(
        columns[i])], blocks in column order), as the rule keeps it for a row of sum(columns)
        elements: element-wise state side by side."""
        return torch.cat(list(parts), dim=1)

    def update(self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Applies one step to the touched rows, in place.

        Args:
            weights: [n, dim] current weights of the touched rows (float32, CPU).
            state: [n, state_dim(dim)] their optimizer state.
            grads: [n, dim] their gradients, one row per distinct id.
            step: the table's step count, from 1 (Adam's bias correction uses it).
        """
        _C.apply_optimizer(self.kind, *self.hyperparameters(), weights, state, grads, int(step))


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain SGD: w -= lr * g."""

    kind = 0
    name = "sgd"
    lr: float = 0.01

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)

    def state_dim(self, dim: int) -> int:
        return 0


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Adagrad with an accumulator per element, as torch.optim.Adagrad."""

    kind = 1
    name = "adagrad"
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)
        if self.initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}")

    def rule_constants(self) -> Tuple[float, float, float]:
        return self.eps, 0.0, 0.0

    def state_dim(self, dim: int) -> int:
        return dim

    def initial_state(self, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows, dim), self.initial_accumulator_value, dtype=dtype)


@dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, of the mean squared gradient."""

    kind = 2
    name = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)

    def rule_constants(self) -> Tuple[float, float, float]:
        return self.eps, 0.0, 0.0

    def state_dim(self, dim: int) -> int:
        return 1

    def joined_state(self, parts: Sequence[torch.Tensor], columns: Sequence[int]) -> torch.Tensor:
        """The blocks' means of squared gradients, weighted by their columns: the whole row's mean."""
        total = sum(part * width for part, width in zip(parts, columns))
        return total / sum(columns) if len(parts) > 1 else parts[0]


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Adam on the touched rows only, as torch.optim.SparseAdam."""

    kind = 3
    name = "adam"
    lr: float = 0.001
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")

    def rule_constants(self) -> Tuple[float, float, float]:
        return self.eps, self.betas[0], self.betas[1]

    def state_dim(self, dim: int) -> int:
        return 2 * dim  # first moment, then second moment

    def joined_state(self, parts: Sequence[torch.Tensor], columns: Sequence[int]) -> torch.Tensor:
        """Every block's first moments, then every block's second moments."""
        return torch.cat([part[:, :width] for part, width in zip(parts, columns)] +
                         [part[:, width:] for part, width in zip(parts, columns)], dim=1)
