"""How a sharded collection takes TorchRec's variable batch per feature (VBE) from replicas of hot
rows (`replicas/`) on every kind of kernel of a plan: `accept_variable_batches` hooks the
collection so that fbgemm's kernels, TorchRec's data-parallel lookups and its output
distribution, built for a fixed batch, take variable ones too (the disk kernel takes them itself);
`variable_batch_input` builds one."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .routing import variable_batch_layout
from .sharded_tables import unwrapped_lookups

__all__ = ["accept_variable_batches", "variable_batch_input", "VariableOutputLayout"]


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


class VariableOutputLayout:
    """Where TorchRec's variable-batch output all-to-all leaves a collection's pooled bags, so that
    its output can be gathered from them in one row gather, with rows from elsewhere (replicas'
    hits) put in the same gather.

    TorchRec's own wait concatenates the all-to-alls' outputs, selects each sample's bag per
    feature (its inverse indices), then permutes the column shards into the features' order: three
    copies of the whole output, and three more in backward. Here the output is seen in *units*
    (the largest width dividing every shard's and feature's): each shard block u of the outputs
    holds `bags_u` bags of `units[u]` units, and the output is [samples, output units]."""

    def __init__(self, sharded: nn.Module) -> None:
        names: List[str] = list(sharded._uncombined_embedding_names)
        dims: List[int] = list(sharded._uncombined_embedding_dims)
        shard_columns = [meta.shard_offsets[1] if meta is not None else 0
                         for sharding in sharded._embedding_shardings for meta in sharding.embedding_shard_metadata()]
        first = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        # TorchRec's order of the blocks in the output: by feature (first seen), then by column.
        order = sorted(range(len(names)), key=lambda i: (first[names[i]], shard_columns[i]))
        self.keys: List[str] = list(sharded._embedding_names)
        self.dims: List[int] = list(sharded._embedding_dims)
        self.unit = math.gcd(*dims, *self.dims)
        self.block_features = [name.split("@")[0] for name in names]  # each block's input feature
        self.block_units = torch.tensor([d // self.unit for d in dims])
        unit_block, unit_within = [], []  # per output unit: its block and its unit within it
        feature_blocks: Dict[str, List[int]] = {}
        for u in order:
            unit_block += [u] * (dims[u] // self.unit)
            unit_within += range(dims[u] // self.unit)
            feature_blocks.setdefault(names[u], []).append(u)
        if list(feature_blocks) != self.keys or [sum(dims[u] for u in blocks) for blocks in
                                                 feature_blocks.values()] != self.dims:
            raise ValueError(f"the output's features {self.keys} are not its shards' {list(feature_blocks)}")
        self.feature_blocks = feature_blocks
        self.unit_block = torch.tensor(unit_block, dtype=torch.int64)
        self.unit_within = torch.tensor(unit_within, dtype=torch.int64)
        self.unit_block_units = self.block_units[self.unit_block]  # per output unit: its block's units
        starts = [0]
        for d in self.dims:
            starts.append(starts[-1] + d // self.unit)
        self.feature_start = dict(zip(self.keys, starts))  # in units
        self.output_units = starts[-1]

    def block_start(self, output: Any) -> torch.Tensor:
        """Where each block's rows will begin among the rows of `output` (TorchRec's VBE awaitable),
        known before its all-to-alls end; the last entry is their count."""
        if getattr(output, "callbacks", None):
            raise ValueError("replicas do not take outputs TorchRec changes after its wait (mean pooling of a "
                             "row-wise table) yet")
        bags = torch.tensor(output._batch_size_per_feature_pre_a2a, dtype=torch.int64)
        return torch.ops.fbgemm.asynchronous_complete_cumsum(bags * self.block_units)

    def rows(self, output: Any) -> torch.Tensor:
        """Waits for the all-to-alls of `output`: their bags as rows of one unit."""
        parts = [w.wait() for w in output._awaitables]
        for resize in getattr(output, "_resize_awaitables", None) or []:
            resize.wait()
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(-1, self.unit)

    def gather_index(self, block_start: torch.Tensor, block_bags: torch.Tensor) -> torch.Tensor:
        """[samples, output units]: each unit's row; `block_bags` [blocks, samples] is the bag of
        each sample in each block."""
        block = self.unit_block
        return (block_start[block] + block_bags[block].T * self.unit_block_units + self.unit_within).contiguous()

    def feature_rows(self, block_start: torch.Tensor, feature: str, bags: torch.Tensor) -> torch.Tensor:
        """[bags, feature's units]: the rows of bags `bags` of `feature` (the same in each of its blocks)."""
        parts = [block_start[u] + bags.unsqueeze(1) * self.block_units[u] + torch.arange(int(self.block_units[u]))
                 for u in self.feature_blocks[feature]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
