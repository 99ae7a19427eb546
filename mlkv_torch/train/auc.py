"""The area under the ROC curve of held-out predictions, exact (every distinct score a threshold,
as torchmetrics' `BinaryAUROC` computes it), without importing torchmetrics: its import takes
about a second of each runner process's start."""
from __future__ import annotations

import torch

__all__ = ["binary_auc"]


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The ROC AUC of `scores` (higher: more likely positive) against 0/1 `labels`: the chance that
    a positive scores above a negative, ties counting one half; NaN unless both classes occur."""
    scores, labels = scores.reshape(-1).double(), labels.reshape(-1).double()
    if scores.numel() != labels.numel():
        raise ValueError(f"{scores.numel()} scores for {labels.numel()} labels")
    order = torch.argsort(scores, descending=True)
    scores, labels = scores[order], labels[order]
    # The last position of each run of equal scores: one point of the curve a distinct threshold.
    last = torch.cat([torch.nonzero(scores[1:] != scores[:-1]).flatten(),
                      torch.tensor([scores.numel() - 1])]) if scores.numel() else torch.zeros(0, dtype=torch.long)
    true_positives = torch.cumsum(labels, 0)[last]
    false_positives = (last + 1).double() - true_positives
    if true_positives.numel() == 0 or true_positives[-1] == 0 or false_positives[-1] == 0:
        return float("nan")
    zero = torch.zeros(1, dtype=torch.float64)
    tpr = torch.cat([zero, true_positives / true_positives[-1]])
    fpr = torch.cat([zero, false_positives / false_positives[-1]])
    return float(torch.trapezoid(tpr, fpr))
