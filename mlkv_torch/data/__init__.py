"""Training data: a synthetic click-through generator with a planted model (Criteo-shaped)."""
from .synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCTR, SyntheticCTRDataset, binary_auc

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SyntheticCTR", "SyntheticCTRDataset", "binary_auc"]
