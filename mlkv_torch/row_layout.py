"""The layout of a stored row: the weights packed into 32-bit words (a 16-bit dtype two to a word,
the last word padded), then the optimizer's float32 state. One definition for Python; the C++
cache's own (`EmbeddingCache.weight_words`, `row_words`) is checked against it in the tests."""
from dataclasses import dataclass

import torch

from .checks import is_int
from .optim import SparseOptimizer


def weight_words(embedding_dim: int, dtype: torch.dtype) -> int:
    """32-bit words of a row's weights."""
    return -(-embedding_dim * dtype.itemsize // 4)


def row_words(embedding_dim: int, dtype: torch.dtype, optimizer: SparseOptimizer) -> int:
    """32-bit words of a stored row: its weights and its optimizer state."""
    return weight_words(embedding_dim, dtype) + optimizer.state_dim(embedding_dim)


def row_bytes(embedding_dim: int, dtype: torch.dtype, optimizer: SparseOptimizer) -> int:
    """Bytes of one stored row."""
    return 4 * row_words(embedding_dim, dtype, optimizer)


WEIGHT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # the weights a row may hold


@dataclass(frozen=True)
class RowLayout:
    """What the rows of the tables of one batch share: elements per row, the weights' data type,
    and the optimizer whose state follows them (the rule and its hyperparameters)."""

    embedding_dim: int
    dtype: torch.dtype
    optimizer: SparseOptimizer

    def __post_init__(self) -> None:
        if not is_int(self.embedding_dim) or self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a positive int, got {self.embedding_dim!r}")
        if self.dtype not in WEIGHT_TYPES:
            raise TypeError(f"dtype must be one of {list(WEIGHT_TYPES)}, got {self.dtype}")
        if not isinstance(self.optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be a mlkv_torch.optim rule, got {type(self.optimizer).__name__}")

    @property
    def state_dim(self) -> int:
        """Optimizer state floats per row."""
        return self.optimizer.state_dim(self.embedding_dim)

    @property
    def weight_words(self) -> int:
        return weight_words(self.embedding_dim, self.dtype)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.embedding_dim, self.dtype, self.optimizer)

    def weights_of(self, words: torch.Tensor) -> torch.Tensor:
        """[n, embedding_dim] weights of `dtype`, from rows of 32-bit words (a stored row's first
        `weight_words`, or the whole row)."""
        if self.dtype == torch.float32:
            return words[:, : self.embedding_dim]
        return words.contiguous().view(self.dtype)[:, : self.embedding_dim]
