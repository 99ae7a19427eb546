"""Training data: a synthetic click-through generator with a planted model (Criteo-shaped), Criteo's
logs converted once into torchrec's npy layout (`criteo_convert`; its command line `criteo`),
Parquet files with a declared schema (`parquet`), batches by number (`criteo_batches`, `synthetic`),
made on Ray (`ray_batches`) or by the loader ahead of training (`loader`, `tuning`); docs/data.md."""
from .synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCTR, SyntheticCTRDataset, binary_auc

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SyntheticCTR", "SyntheticCTRDataset", "binary_auc"]
