"""The synthetic CTR generator: deterministic, Zipf-skewed ids in range, labels from a planted
model whose AUC is known, and no batch produced twice across DataLoader workers and ranks."""
import itertools

import pytest
import torch

from mlkv_torch.data import SyntheticCTR, SyntheticCTRDataset, binary_auc

torchrec = pytest.importorskip("torchrec")


def test_batches_are_a_function_of_seed_and_number():
    g = SyntheticCTR(cardinalities=(50, 10_000, 7), seed=3)
    a, b = g.batch(5, 64), SyntheticCTR(cardinalities=(50, 10_000, 7), seed=3).batch(5, 64)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(g.batch(6, 64)[1], a[1])
    assert not torch.equal(SyntheticCTR(cardinalities=(50, 10_000, 7), seed=4).batch(5, 64)[1], a[1])
    # Far-apart numbers are different batches too (a torch CPU generator would keep only a seed's
    # low 32 bits, making batch 2**40 + 5 batch 5: evaluation batches would be training batches).
    assert not torch.equal(g.batch(5 + (1 << 40), 64)[1], a[1])


def test_ids_are_in_range_and_skewed():
    g = SyntheticCTR(cardinalities=(100, 1_000_000), num_dense=2)
    _, ids, _, _ = g.batch(0, 100_000)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0
    assert int(ids[:, 0].max()) < 100 and int(ids[:, 1].max()) < 1_000_000
    counts = torch.bincount(ids[:, 1], minlength=1_000_000).sort(descending=True).values
    assert counts[:1000].sum() > 0.3 * ids.shape[0]  # the hottest 0.1% of ids take a large share
    hottest = torch.bincount(ids[:, 1]).argmax()
    assert int(hottest) != 0, "hot ranks are scattered over the id space"


def test_binary_auc_equals_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=g).float()  # many ties
    labels = (torch.rand(300, generator=g) < 0.4).float()
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    pairwise = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert binary_auc(scores, labels) == pytest.approx(float(pairwise), abs=1e-12)
    with pytest.raises(ValueError, match="both positive and negative"):
        binary_auc(scores, torch.ones(300))


def test_the_planted_model_has_a_known_auc_well_above_chance():
    g = SyntheticCTR()  # Criteo Kaggle's cardinalities
    auc = g.oracle_auc(samples=20_000)
    assert 0.8 < auc < 0.99
    _, _, labels, probability = g.batch(1, 20_000)
    assert 0.2 < float(labels.mean()) < 0.5  # clicks rarer than non-clicks
    torch.testing.assert_close(labels.mean(), probability.mean(), atol=0.02, rtol=0)


def test_no_batch_is_produced_twice_across_workers_and_ranks():
    g = SyntheticCTR(cardinalities=(100, 100), num_dense=1)
    seen = []
    for rank in range(2):
        dataset = SyntheticCTRDataset(g, batch_size=4, num_batches=23, rank=rank, world_size=2)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
        for batch in loader:
            seen.append(tuple(batch.sparse_features.values().tolist()) + tuple(batch.dense_features.flatten().tolist()))
    assert len(seen) == 23 and len(set(seen)) == 23
    numbers = sorted(itertools.chain.from_iterable(
        SyntheticCTRDataset(g, 4, 23, rank=r, world_size=2).batch_numbers() for r in range(2)))
    assert numbers == list(range(23))


def test_dataset_yields_torchrec_batches():
    g = SyntheticCTR(cardinalities=(10, 20, 30), num_dense=5)
    batch = next(iter(SyntheticCTRDataset(g, batch_size=8, num_batches=1)))
    assert batch.dense_features.shape == (8, 5) and batch.labels.shape == (8,)
    assert batch.sparse_features.keys() == ["cat_0", "cat_1", "cat_2"]
    dense, ids, labels, _ = g.batch(0, 8)
    torch.testing.assert_close(batch.sparse_features["cat_1"].values(), ids[:, 1])
    torch.testing.assert_close(batch.labels, labels)
