"""TorchRec Batches of click logs: dense features, one id per sparse feature, labels."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["one_id_per_feature_batch"]


def one_id_per_feature_batch(feature_names: Sequence[str], dense: torch.Tensor, ids: torch.Tensor,
                             labels: torch.Tensor):
    """A torchrec ``Batch`` whose KeyedJaggedTensor holds ``ids[:, f]`` as the one id of feature f
    in each sample.

    Args:
        feature_names: the sparse features' names, in the column order of `ids`.
        dense: [batch, dense features] float32.
        ids: [batch, len(feature_names)] int64.
        labels: [batch].
    """
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch_size, features = ids.shape
    if features != len(feature_names):
        raise ValueError(f"ids has {features} columns for {len(feature_names)} features")
    # Offsets and per-key lengths are known here: building them spares the KJT a sync and a cumsum.
    sparse = KeyedJaggedTensor(
        keys=list(feature_names), values=ids.t().reshape(-1),
        lengths=torch.ones(features * batch_size, dtype=torch.int64),
        offsets=torch.arange(features * batch_size + 1, dtype=torch.int64),
        stride=batch_size, length_per_key=[batch_size] * features,
        offset_per_key=[batch_size * f for f in range(features + 1)])
    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)
