"""Synthetic click-through data with a planted model: Criteo-shaped, deterministic, any size.

Each sample has `num_dense` dense features (standard normal) and one id per sparse feature,
drawn Zipf(`zipf`) over the feature's cardinality; hot ranks are scattered over the id space
by a fixed bijection, so hot ids are not the small ones. The label is Bernoulli(sigmoid(
logit)), with

    logit = bias + sum over features of effect(feature, id) + dense . dense_weights

where effect(feature, id) is a hidden per-id value, uniform in [-effect_scale, effect_scale),
derived from (seed, feature, id) alone (no table is stored, so 100M-row features cost
nothing). A model that learns the effects reaches `oracle_auc()`, the AUC of the true
probabilities, well above 0.5.

Raw ids (`id_space`, a power of two such as 2**40): each feature's ids are spread over the whole
space, as real users' and items' ids are, rather than numbered 0..cardinality-1; the cardinality is
then the live vocabulary, the items drawable at any one time. With `new_ids_per_batch`, that many
new items enter each feature's vocabulary a batch as its hottest, the others each slide one rank
colder and the coldest leaves it, so the distinct ids of a run grow with its length (about
cardinality + batches x new_ids_per_batch) while its hot set stays the same size.

Batches are numbered; batch b is a function of (seed, b) alone. `SyntheticCTRDataset` hands
batch numbers to workers and ranks round-robin, so none is produced twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..store import initial_rows
from .batch import one_id_per_feature_batch

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SyntheticCTR", "SyntheticCTRDataset", "synthetic_batch"]

CRITEO_KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
    5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
"""Rows of the 26 categorical features of Criteo Kaggle (torchrec's preprocessing)."""

_SCATTER = 2654435761  # a prime above every cardinality: rank -> (rank * _SCATTER + c) % n is a bijection
_MAX_ID_SPACE_BITS = 62
_EFFECT_SEED_STRIDE = 7919


def raw_ids_problem(id_space: Optional[int], new_ids_per_batch: float, cardinalities: Sequence[int]) -> Optional[str]:
    """What is wrong with these raw-id settings (SyntheticCTR's `id_space`, `new_ids_per_batch`), or None."""
    if id_space is not None and (id_space < 2 or id_space & (id_space - 1) or id_space > 1 << _MAX_ID_SPACE_BITS):
        return f"id_space must be a power of two from 2 to 2**{_MAX_ID_SPACE_BITS}, got {id_space}"
    if id_space is not None and max(cardinalities) > id_space:
        return f"a vocabulary of {max(cardinalities)} ids does not fit id_space {id_space}"
    if not new_ids_per_batch >= 0 or (new_ids_per_batch and id_space is None):
        return (f"new_ids_per_batch must be >= 0, and is for raw ids (id_space), got {new_ids_per_batch} with "
                f"id_space {id_space}")
    return None


@dataclass(frozen=True)
class SyntheticCTR:
    """The generator's parameters; `batch(b, batch_size)` draws batch b.

    Args:
        cardinalities: ids per sparse feature (default Criteo Kaggle's).
        num_dense: dense features per sample.
        zipf: the Zipf exponent of every feature's ids (> 1).
        effect_scale: the range of the hidden per-id effects.
        dense_scale: the range of the hidden dense weights.
        bias: the logit's constant (negative: clicks are rarer than non-clicks).
        seed: everything follows from it.
        id_space: raw ids: every feature's ids spread over [0, id_space), a power of two up to 2**62
            (None: ids in [0, cardinality)).
        new_ids_per_batch: with `id_space`, the new items entering each feature's vocabulary a batch.
        hash_rows: with `id_space`, the raw ids hashed into this many rows a table (the raw id modulo
            it), collisions and all: the fixed-size table a virtual table replaces. The labels
            still follow the raw ids' effects.
    """

    cardinalities: Tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    num_dense: int = 13
    zipf: float = 1.05
    effect_scale: float = 1.0
    dense_scale: float = 0.3
    bias: float = -1.0
    seed: int = 0
    id_space: Optional[int] = None
    new_ids_per_batch: float = 0.0
    hash_rows: Optional[int] = None
    dense_weights: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cardinalities", tuple(int(c) for c in self.cardinalities))
        if not self.cardinalities or min(self.cardinalities) < 1 or max(self.cardinalities) >= _SCATTER:
            raise ValueError(f"cardinalities must be between 1 and {_SCATTER - 1}, got {self.cardinalities}")
        if not self.zipf > 1.0:
            raise ValueError(f"zipf must be above 1, got {self.zipf}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")
        problem = raw_ids_problem(self.id_space, self.new_ids_per_batch, self.cardinalities)
        if problem:
            raise ValueError(problem)
        if self.hash_rows is not None and (self.id_space is None or not 1 <= self.hash_rows <= self.id_space):
            raise ValueError(f"hash_rows hashes raw ids (id_space) into 1 to id_space rows, got {self.hash_rows} with "
                             f"id_space {self.id_space}")
        weights = np.random.default_rng([self.seed, -1 & 0xFFFFFFFF]).random(self.num_dense)
        object.__setattr__(self, "dense_weights", torch.from_numpy((weights * 2 - 1) * self.dense_scale).float())

    @property
    def feature_names(self) -> List[str]:
        return [f"cat_{i}" for i in range(len(self.cardinalities))]

    @property
    def table_sizes(self) -> Tuple[int, ...]:
        """Rows each feature's table needs to give every id its own: its cardinality, or the id space
        (or the rows raw ids are hashed into)."""
        if self.id_space is None:
            return self.cardinalities
        return (self.hash_rows or self.id_space,) * len(self.cardinalities)

    def ids(self, feature: int, uniforms: torch.Tensor, batch: int = 0) -> torch.Tensor:
        """Ids of `feature` for uniforms in [0, 1) in batch `batch`: bounded Zipf ranks by the inverse
        of the continuous power law's CDF, scattered over the id space."""
        n = self.cardinalities[feature]
        a = 1.0 - self.zipf
        top = math.pow(n + 1.0, a)
        ranks = ((top - 1.0) * uniforms.double() + 1.0).pow(1.0 / a).floor().long().sub_(1).clamp_(0, n - 1)
        if self.id_space is not None:
            # The vocabulary at batch b: items from the ones that entered last (hottest) back n items.
            newest = int(batch * self.new_ids_per_batch) + n - 1
            return self._raw_id(feature, newest - ranks)
        offset = ((self.seed + 1) * 0x9E3779B1 + feature * 0x85EBCA6B) % n  # the hottest id is not 0
        return (ranks * _SCATTER + offset) % n

    def _raw_id(self, feature: int, items: torch.Tensor) -> torch.Tensor:
        """Item numbers to ids in [0, id_space): a bijection of the space (odd multiplications and
        xor-shifts mod 2**bits are invertible), so distinct items keep distinct ids, spread over it."""
        bits = self.id_space.bit_length() - 1
        mask = np.uint64(self.id_space - 1)
        key = np.uint64(((self.seed + 1) * 0x9E3779B97F4A7C15 + (feature + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1))
        x = (items.numpy().astype(np.uint64) + key) & mask
        with np.errstate(over="ignore"):  # uint64 products wrap mod 2**64, then the mask takes them mod 2**bits
            for multiplier in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
                x ^= x >> np.uint64(max(1, bits // 2))
                x = (x * np.uint64(multiplier)) & mask
        return torch.from_numpy(x.astype(np.int64))

    def effects(self, feature: int, ids: torch.Tensor) -> torch.Tensor:
        """The hidden per-id effects of `feature`."""
        seed = (self.seed * 1_000_003 + feature * _EFFECT_SEED_STRIDE + 1) & 0x7FFFFFFF
        return initial_rows(ids, 1, seed=seed, low=-self.effect_scale, high=self.effect_scale).squeeze(1)

    def batch(self, index: int, batch_size: int, vocabulary: Optional[int] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch `index`: (dense [B, num_dense], ids [B, features], labels [B], true click probabilities [B]);
        with new ids entering, its ids come from the vocabulary of batch `vocabulary` (default its own)."""
        rng, dense, ids = self._draw(index, batch_size, vocabulary)
        logit = self.bias + dense @ self.dense_weights
        for f in range(len(self.cardinalities)):
            logit = logit + self.effects(f, ids[:, f])
        probability = torch.sigmoid(logit)
        labels = (torch.from_numpy(rng.random(batch_size, dtype=np.float32)) < probability).float()
        if self.hash_rows is not None:  # the model sees the hashed ids; the labels followed the raw ones
            ids = ids % self.hash_rows
        return dense, ids, labels, probability

    def batch_ids(self, index: int, batch_size: int) -> torch.Tensor:
        """The raw ids [B, features] of batch `index` alone (unhashed), without its labels' work."""
        return self._draw(index, batch_size, None)[2]

    def _draw(self, index: int, batch_size: int, vocabulary: Optional[int]
              ) -> Tuple[np.random.Generator, torch.Tensor, torch.Tensor]:
        """Batch `index`'s generator (left where its labels draw next), dense features and ids."""
        # numpy's SeedSequence keeps (seed, index) whole; torch's CPU generator would keep only the low
        # 32 bits of a seed, so batches 2**40 + k and k would be the same batch.
        rng = np.random.default_rng([self.seed, index])
        dense = torch.from_numpy(rng.standard_normal((batch_size, self.num_dense), dtype=np.float32))
        uniforms = torch.from_numpy(rng.random((batch_size, len(self.cardinalities))))
        at = index if vocabulary is None else vocabulary
        ids = torch.stack([self.ids(f, uniforms[:, f], at) for f in range(len(self.cardinalities))], dim=1)
        return rng, dense, ids

    def oracle_auc(self, samples: int = 65536, first_batch: int = 1 << 40) -> float:
        """The AUC of the true probabilities on fresh samples: what a perfect model reaches."""
        _, _, labels, probability = self.batch(first_batch, samples)
        return binary_auc(probability, labels)


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank statistic (ties get their mean rank)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    sorted_scores = scores[order]
    # Mean rank over runs of equal scores.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = (ends - (counts.double() - 1) / 2)[inverse]
    ranks[order] = mean_rank
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class SyntheticCTRDataset(IterableDataset):
    """Batches of a SyntheticCTR as torchrec `Batch`es (dense, KJT with one id per feature, labels).

    Batch numbers `first_batch`, `first_batch + 1`, ... go round-robin to ranks and, within a
    rank, to DataLoader workers: no batch is produced twice. Use with ``DataLoader(dataset,
    batch_size=None, num_workers=...)``.

    Args:
        generator: the SyntheticCTR.
        batch_size: samples per batch.
        num_batches: batches over all ranks (one epoch); None: endless.
        rank, world_size: this process's share (default: torch.distributed's, else 0 of 1).
        first_batch: the number of the first batch (a resumed run starts after its last).
    """

    def __init__(self, generator: SyntheticCTR, batch_size: int, num_batches: Optional[int] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None, first_batch: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if rank is None or world_size is None:
            import torch.distributed as dist
            initialized = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if initialized else 0
            world_size = dist.get_world_size() if initialized else 1
        self.generator, self.batch_size, self.num_batches = generator, batch_size, num_batches
        self.rank, self.world_size, self.first_batch = rank, world_size, first_batch

    def batch_numbers(self) -> Iterator[int]:
        """The batch numbers this rank and DataLoader worker produce, in order."""
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        step = self.world_size * workers
        b = self.first_batch + self.rank + self.world_size * worker_id
        end = None if self.num_batches is None else self.first_batch + self.num_batches
        while end is None or b < end:
            yield b
            b += step

    def __iter__(self):
        for b in self.batch_numbers():
            yield synthetic_batch(self.generator, b, self.batch_size)


def synthetic_batch(generator: SyntheticCTR, index: int, batch_size: int, vocabulary: Optional[int] = None):
    """Batch `index` of `generator` as a torchrec ``Batch`` (one id per feature)."""
    dense, ids, labels, _ = generator.batch(index, batch_size, vocabulary)
    return one_id_per_feature_batch(generator.feature_names, dense, ids, labels)
