"""TorchRec integration: DiskEmbeddingBagCollection, a drop-in for EmbeddingBagCollection.

Importing this module needs torchrec; the core package (`mlkv_torch`) does not.
"""
from .collection import DiskEmbeddingBagCollection

__all__ = ["DiskEmbeddingBagCollection"]
