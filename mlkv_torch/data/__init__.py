"""Training data: a synthetic click-through generator with a planted model (Criteo-shaped), Criteo's
logs converted once into torchrec's npy layout (`criteo`), batches by number (`criteo_batches`,
`synthetic`) and the loader that makes them ahead of training (`loader`, `tuning`); docs/data.md."""
from .synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCTR, SyntheticCTRDataset, binary_auc

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SyntheticCTR", "SyntheticCTRDataset", "binary_auc"]
