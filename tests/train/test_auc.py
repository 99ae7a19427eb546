"""The runner's AUC (`binary_auc`) against its definition and against torchmetrics' BinaryAUROC."""
import math

import pytest
import torch

from mlkv_torch.train.auc import binary_auc


def pairwise_auc(scores, labels) -> float:
    """The definition: over every (positive, negative) pair, 1 where the positive scores higher, 1/2
    on a tie."""
    positives = [s for s, y in zip(scores, labels) if y == 1]
    negatives = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize("levels", [None, 3, 20])  # None: distinct scores; else that many, tied
def test_the_auc_is_the_chance_a_positive_scores_above_a_negative(levels):
    g = torch.Generator().manual_seed(levels or 0)
    scores = torch.rand(400, generator=g)
    if levels:
        scores = (scores * levels).floor() / levels
    labels = (torch.rand(400, generator=g) < 0.2 + 0.6 * scores).int()
    assert binary_auc(scores, labels) == pytest.approx(pairwise_auc(scores.tolist(), labels.tolist()), rel=0,
                                                       abs=1e-12)
    # The order of the batches (ranks gathered in any order) does not change it.
    order = torch.randperm(400, generator=g)
    assert binary_auc(scores[order], labels[order]) == pytest.approx(binary_auc(scores, labels), rel=0, abs=1e-12)


def test_the_auc_is_torchmetrics_binary_auroc_to_float32_precision():
    from torchmetrics.classification import BinaryAUROC

    g = torch.Generator().manual_seed(1)
    scores = torch.sigmoid(torch.randn(16384, generator=g))
    labels = (torch.rand(16384, generator=g) < scores).int()
    reference = BinaryAUROC()
    reference.update(scores, labels)
    assert binary_auc(scores, labels) == pytest.approx(float(reference.compute()), rel=0, abs=1e-6)


def test_one_class_gives_nan_and_sizes_must_match():
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1])))
    assert math.isnan(binary_auc(torch.zeros(0), torch.zeros(0)))
    with pytest.raises(ValueError, match="3 scores for 2 labels"):
        binary_auc(torch.rand(3), torch.tensor([0, 1]))
