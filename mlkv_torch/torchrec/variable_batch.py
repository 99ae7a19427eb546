"""How a sharded collection takes TorchRec's variable batch per feature (VBE) from replicas of hot
rows (`replicas.py`) on every kind of kernel of a plan: `accept_variable_batches` hooks the
collection so that fbgemm's kernels, TorchRec's data-parallel lookups and its output
distribution, built for a fixed batch, take variable ones too (the disk kernel takes them itself);
`variable_batch_input` builds one."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .routing import variable_batch_layout
from .sharded_collection import unwrapped_lookups

__all__ = ["accept_variable_batches", "variable_batch_input"]


def _lookups(sharded: nn.Module) -> List[Tuple[nn.Module, str]]:
    """The collection's lookups and their sharding types."""
    return list(zip(unwrapped_lookups(sharded), sharded._sharding_types))


def accept_variable_batches(sharded: nn.Module, dims: Dict[str, int]) -> List[Any]:
    """Hooks `sharded` (a ShardedEmbeddingBagCollection) to take variable batches beside fixed
    ones, `dims` being each feature's columns; returns the hooks' handles."""
    _build_variable_output_dists(sharded)
    return _data_parallel_outputs_by_feature(sharded, dims) + _fixed_batches_for_cpu_kernels(sharded)


def _build_variable_output_dists(sharded: nn.Module) -> None:
    """Builds the variable-batch output all-to-alls TorchRec builds only when a collection's first
    batch is a variable one (this one's first batches may not be)."""
    for output_dist in getattr(sharded, "_output_dists", []):
        if getattr(output_dist, "_variable_dist", False) is None and hasattr(output_dist, "_create_output_dist_module"):
            output_dist._create_output_dist_module(SimpleNamespace(variable_batch_per_feature=True))


def _data_parallel_outputs_by_feature(sharded: nn.Module, dims: Dict[str, int]) -> List[Any]:
    """Hooks the data-parallel lookups so that, given a variable batch, they return what the
    variable-batch output expects of every sharding: 1-D, feature after feature (TorchRec's dense
    kernel returns [batch, columns] whatever the batch)."""
    def by_feature(module: nn.Module, args: Tuple[Any, ...], output: torch.Tensor) -> Optional[torch.Tensor]:
        features = args[0]
        if not (isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key()) or output.dim() != 2:
            return None
        columns = output.split([dims[k] for k in features.keys()], dim=1)
        return torch.cat([c.reshape(-1) for c in columns]) if columns else output.reshape(-1)

    handles = []
    for lookup, sharding_type in _lookups(sharded):
        if sharding_type != ShardingType.DATA_PARALLEL.value:
            continue
        handles.append(lookup.register_forward_hook(by_feature))
    return handles


def _fixed_batches_for_cpu_kernels(sharded: nn.Module) -> List[Any]:
    """Hooks fbgemm's in-memory kernels on the CPU so that a variable batch reaches them as a fixed
    one (each feature's bags, then empty ones up to the most any feature has) and leaves them in
    the variable layout: fbgemm's CPU kernel runs a variable batch 8-10x slower (docs/benchmarks.md)."""
    def to_fixed(module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        features = args[0]
        if not (isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key()):
            return None
        bags = features.stride_per_key()
        most = max(max(bags, default=0), 1)
        lengths = features.lengths()
        padded = torch.zeros(len(bags), most, dtype=lengths.dtype)
        padded[torch.arange(most).expand(len(bags), most) < torch.tensor(bags).unsqueeze(1)] = lengths
        module._mlkv_variable_batch = features.stride_per_key_per_rank()  # type: ignore[assignment]
        fixed = KeyedJaggedTensor(keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
                                  lengths=padded.reshape(-1), stride=most)
        return (fixed,) + tuple(args[1:])

    def to_variable(module: nn.Module, args: Tuple[Any, ...], output: torch.Tensor) -> Optional[torch.Tensor]:
        per_rank = getattr(module, "_mlkv_variable_batch", None)
        if per_rank is None:
            return None
        module._mlkv_variable_batch = None  # type: ignore[assignment]
        dims = module.config.embedding_dims()
        columns = output.split(dims, dim=1)
        return variable_batch_layout([c[: sum(counts)] for c, counts in zip(columns, per_rank)], per_rank)

    handles = []
    for lookup, _ in _lookups(sharded):
        for kernel in getattr(lookup, "_emb_modules", []):
            emb_module = getattr(kernel, "_emb_module", None)
            if emb_module is not None and hasattr(emb_module, "optimizer") and getattr(emb_module, "use_cpu", False):
                handles += [kernel.register_forward_pre_hook(to_fixed), kernel.register_forward_hook(to_variable)]
    return handles


def variable_batch_input(sharded: nn.Module, keys: List[str], values: torch.Tensor, lengths: torch.Tensor,
                         weights: Optional[torch.Tensor], bags: List[int], inverse: torch.Tensor
                         ) -> KeyedJaggedTensor:
    """A variable batch for `sharded`: feature f has `bags[f]` bags (lengths, then values, feature
    after feature); the output's row b of feature f is its bag ``inverse[f, b]``."""
    permuted_for = getattr(sharded, "_mlkv_permuted_for", None)
    if permuted_for != keys:  # TorchRec sets it up only when the collection's first batch is a variable one
        sharded._create_inverse_indices_permute_indices((keys, inverse))
        sharded._mlkv_permuted_for = list(keys)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights,
                             stride_per_key_per_rank=[[n] for n in bags], inverse_indices=(keys, inverse))
