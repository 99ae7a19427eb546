"""The layout of a stored row: the weights packed into 32-bit words (a 16-bit dtype two to a word,
the last word padded), then the optimizer's float32 state. One definition for Python; the C++
cache's own (`EmbeddingCache.weight_words`, `row_words`) is checked against it in the tests."""
import torch

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
