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


def test_raw_ids_spread_over_the_id_space_one_per_item_and_new_ones_keep_coming():
    gen = SyntheticCTR(cardinalities=(1000, 50), id_space=2**40, new_ids_per_batch=20, seed=3)
    # Item numbers to ids is a bijection of the space (checked whole on a small one).
    small = SyntheticCTR(cardinalities=(64,), id_space=2**12)
    assert sorted(small._raw_id(0, torch.arange(2**12)).tolist()) == list(range(2**12))
    assert torch.equal(gen.batch(7, 64)[1], gen.batch(7, 64)[1])  # still a function of (seed, number)
    seen, hot = [], []
    for b in range(0, 200, 50):
        ids = gen.batch(b, 4096)[1]
        assert int(ids.min()) >= 0 and int(ids.max()) < 2**40
        seen.append(set(ids[:, 0].tolist()))
        hot.append(int(ids[:, 0].mode().values))
    assert max(max(s) for s in seen) > 2**32  # spread over the space, not numbered from 0
    # The vocabulary moves: 50 batches later, 1000 new items, and the hottest id is another one.
    assert len(seen[0] & seen[-1]) < len(seen[0]) / 2 and len(set(hot)) == len(hot)
    fixed = SyntheticCTR(cardinalities=(1000, 50), id_space=2**40, seed=3)
    assert len(set(fixed.batch(0, 4096)[1][:, 0].tolist()) | set(fixed.batch(150, 4096)[1][:, 0].tolist())) <= 1000
    assert gen.table_sizes == (2**40, 2**40) and fixed.oracle_auc() > 0.6


def test_raw_ids_hashed_into_fixed_tables_collide_and_keep_the_raw_ids_labels():
    raw = SyntheticCTR(cardinalities=(5000, 50), id_space=2**40, new_ids_per_batch=20, seed=3)
    hashed = SyntheticCTR(cardinalities=(5000, 50), id_space=2**40, new_ids_per_batch=20, seed=3, hash_rows=1000)
    dense, ids, labels, probability = raw.batch(9, 4096)
    got = hashed.batch(9, 4096)
    assert torch.equal(got[1], ids % 1000) and hashed.table_sizes == (1000, 1000)
    assert torch.equal(got[0], dense) and torch.equal(got[2], labels) and torch.equal(got[3], probability)
    # Collisions: distinct raw ids share a row.
    column = ids[:, 0]
    assert torch.unique(column).numel() > torch.unique(column % 1000).numel()
    # Evaluation draws from where training is: a batch of another number, with batch 9's vocabulary.
    later = raw.batch(2**40, 4096, vocabulary=9)[1][:, 0]
    assert len(set(later.tolist()) & set(column.tolist())) > 0.3 * torch.unique(later).numel()


@pytest.mark.parametrize("kwargs, message", [
    ({"id_space": 1000}, "id_space must be a power of two"),
    ({"hash_rows": 10}, "hash_rows hashes raw ids"),
    ({"id_space": 2**10, "hash_rows": 2**11}, "hash_rows hashes raw ids"),
    ({"id_space": 2**63}, "id_space must be a power of two"),
    ({"id_space": 2**8}, "a vocabulary of 1000 ids does not fit id_space 256"),
    ({"new_ids_per_batch": 5}, "is for raw ids"),
    ({"id_space": 2**20, "new_ids_per_batch": -1}, "new_ids_per_batch must be >= 0"),
])
def test_bad_raw_id_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticCTR(cardinalities=(1000,), **kwargs)


def test_a_raw_id_runs_ceiling_lies_between_its_dense_features_and_the_planted_model():
    """benchmarks/raw_ids_ceiling.py: knowing only the ids training has seen, the planted model's
    AUC falls from oracle_auc toward the dense features' alone, the more so the more often an id
    must have been seen."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "benchmarks/raw_ids_ceiling.py", "configs/raw_ids.yaml", "--steps", "30",
                           "--eval-batches", "2"], capture_output=True, text=True, timeout=300, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    aucs = [float(x) for x in re.findall(r": (0\.\d+)$", done.stdout, re.M)]
    oracle, *seen, dense = aucs
    assert len(seen) == 4 and oracle > seen[0] >= seen[1] >= seen[2] >= seen[3] > dense and seen[0] > seen[3], aucs
