"""How a batch's features reach the table-batched kernels: `KernelRouting` groups a collection's
tables by kernel and `select_features` picks a group's features out of a KeyedJaggedTensor."""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..table_batch import DiskTableBatch
from .read_aheads import Tickets


def select_features(features: KeyedJaggedTensor, positions: List[int]) -> KeyedJaggedTensor:
    """The features at `positions` of a KeyedJaggedTensor, in that order (a feature may be left out
    or repeated); with TorchRec's variable batch per feature, each keeps its bags per rank.

    Not `KeyedJaggedTensor.permute`: fbgemm's CPU backward of that op reads outside the weights'
    gradient when features are left out or repeated (a segfault or wrong gradients for learnable
    per-sample weights, such as TorchRec's position weights). Values and weights are gathered
    here with one `index_select` each, whose backward is torch's own."""
    keys = features.keys()
    if positions == list(range(len(keys))):
        return features
    lengths = features.lengths()
    starts = features.offset_per_key()  # where each feature's values begin, and the end
    device = features.values().device
    index = torch.cat([torch.arange(starts[p], starts[p + 1], device=device) for p in positions]
                      + [torch.empty(0, dtype=torch.int64, device=device)])
    weights = features.weights_or_none()
    if features.variable_stride_per_key():
        bag_starts = [0] + list(itertools.accumulate(features.stride_per_key()))  # each feature's bags
        bags = torch.cat([torch.arange(bag_starts[p], bag_starts[p + 1], device=lengths.device) for p in positions]
                         + [torch.empty(0, dtype=torch.int64, device=lengths.device)])
        per_rank = features.stride_per_key_per_rank()
        return KeyedJaggedTensor(
            keys=[keys[p] for p in positions], values=features.values().index_select(0, index),
            weights=None if weights is None else weights.index_select(0, index),
            lengths=lengths.index_select(0, bags), stride_per_key_per_rank=[per_rank[p] for p in positions])
    stride = features.stride()
    return KeyedJaggedTensor(
        keys=[keys[p] for p in positions], values=features.values().index_select(0, index),
        weights=None if weights is None else weights.index_select(0, index),
        lengths=lengths.view(len(keys), stride).index_select(
            0, torch.tensor(positions, dtype=torch.int64, device=lengths.device)).reshape(-1),
        stride=stride)


def variable_batch_layout(per_feature: Sequence[torch.Tensor], bags_per_rank: Sequence[Sequence[int]]
                          ) -> torch.Tensor:
    """The pooled bags of a variable batch per feature in the 1-D layout TorchRec's output
    distribution expects of a kernel (fbgemm's): rank after rank, in each the features in order,
    in each its bags from that rank. `per_feature[f]` holds feature f's bags [bags, dim], rank
    after rank, `bags_per_rank[f][r]` of them from rank r."""
    ranks = len(bags_per_rank[0]) if bags_per_rank else 0
    chunks = [out.split(list(counts)) for out, counts in zip(per_feature, bags_per_rank)]
    parts = [chunks[f][r].reshape(-1) for r in range(ranks) for f in range(len(per_feature))]
    if not parts:
        return per_feature[0].new_empty(0) if per_feature else torch.empty(0)
    return torch.cat(parts)


def _waiting(batch: DiskTableBatch, read_aheads: Optional[Tickets], k: int) -> Optional[int]:
    """Kernel `k`'s ticket of the batch's read-ahead while it still waits; else None (a lookup
    without a ticket, an evaluation's, let it go meanwhile): the batch is then looked up by key."""
    ticket = read_aheads[k] if read_aheads else None
    return ticket if ticket is not None and batch.read_ahead_waiting(ticket) else None


class KernelRouting:
    """How the features of a batch reach the table-batched kernels that pool them.

    The features come in one fixed order (the collection's tables' features, or a TorchRec
    group's shards' features); feature i is pooled by kernel ``owners[i][0]`` as a row of its
    table ``owners[i][1]``. Each kernel pools all its features in one call; their outputs are put
    back in the features' order, as TorchRec lays out a KeyedTensor.
    """

    def __init__(self, owners: List[Tuple[int, int]]) -> None:
        kernels = 1 + max((k for k, _ in owners), default=-1)
        self.positions: List[List[int]] = [[] for _ in range(kernels)]  # the features of each kernel, in order
        self.tables: List[List[int]] = [[] for _ in range(kernels)]  # the table of each, within its kernel
        for i, (k, t) in enumerate(owners):
            self.positions[k].append(i)
            self.tables[k].append(t)
        pooled_order = [i for positions in self.positions for i in positions]
        # Where each feature's output columns are among the kernels' concatenated outputs (None: in order).
        self.output_permutation: Optional[List[int]] = (
            None if pooled_order == list(range(len(owners))) else [pooled_order.index(i) for i in range(len(owners))])

    def _kernel_input(self, features: KeyedJaggedTensor, kernel: int) -> KeyedJaggedTensor:
        return select_features(features, self.positions[kernel])

    def pool(self, batches: Sequence[DiskTableBatch], features: KeyedJaggedTensor, weighted: bool,
             training: bool = True, read_aheads: Optional[Tickets] = None) -> torch.Tensor:
        """[batch, sum of feature dims] float32, features in order; with TorchRec's variable batch
        per feature, the 1-D layout of fbgemm's kernel (`variable_batch_layout`). `training` as
        `DiskTableBatch.pool`'s (the module's mode); `read_aheads`: the batch's tickets, from
        `lookahead` of these features."""
        pooled = []  # each kernel's bags, feature after feature
        for k, batch in enumerate(batches):
            kjt = self._kernel_input(features, k)
            lengths = kjt.lengths()
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
            pooled.append(batch.pool(kjt.values(), kjt.length_per_key(), self.tables[k], offsets,
                                     kjt.weights() if weighted else None, training=training,
                                     read_ahead=_waiting(batch, read_aheads, k)).float())
        if features.variable_stride_per_key():
            bags = features.stride_per_key()
            per_feature: List[torch.Tensor] = [torch.empty(0)] * len(bags)
            for out, positions in zip(pooled, self.positions):
                for i, chunk in zip(positions, out.split([bags[i] for i in positions])):
                    per_feature[i] = chunk
            return variable_batch_layout(per_feature, features.stride_per_key_per_rank())
        batch_size = features.stride()
        for k, out in enumerate(pooled):
            num_features = len(self.positions[k])
            if num_features > 1:
                pooled[k] = out.view(num_features, batch_size, -1).transpose(0, 1).reshape(batch_size, -1)
        if self.output_permutation is None:
            return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
        per_feature = [chunk for out, positions in zip(pooled, self.positions)
                       for chunk in out.split(out.shape[1] // len(positions), dim=1)]
        return torch.cat([per_feature[i] for i in self.output_permutation], dim=1)

    def look_up(self, batches: Sequence[DiskTableBatch], features: KeyedJaggedTensor, training: bool = True,
                read_aheads: Optional[Tickets] = None) -> List[torch.Tensor]:
        """Each feature's embeddings, one per id: [ids of the feature, dim] float32, features in
        order (EmbeddingCollection's lookup). Each id is a bag of one, so a kernel's one call looks
        up every id of its features, and backward sums each row's gradients as a pooled lookup."""
        per_feature: List[torch.Tensor] = [torch.empty(0)] * sum(len(p) for p in self.positions)
        for k, batch in enumerate(batches):
            kjt = self._kernel_input(features, k)
            ids = kjt.values()
            one_per_bag = torch.arange(ids.numel() + 1, device=ids.device)
            out = batch.pool(ids, kjt.length_per_key(), self.tables[k], one_per_bag, training=training,
                             read_ahead=_waiting(batch, read_aheads, k)).float()
            for i, chunk in zip(self.positions[k], out.split(kjt.length_per_key())):
                per_feature[i] = chunk
        return per_feature

    def lookahead(self, batches: Sequence[DiskTableBatch], features: KeyedJaggedTensor) -> Tickets:
        """Starts each kernel's reads of the rows `features` (as `pool` takes them) will look up;
        returns their tickets (None for a kernel with no id in the batch)."""
        tickets: Tickets = []
        for k, batch in enumerate(batches):
            kjt = self._kernel_input(features, k)
            tickets.append(batch.lookahead(kjt.values(), kjt.length_per_key(), self.tables[k])
                           if kjt.values().numel() else None)
        return tickets
