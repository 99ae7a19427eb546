"""What the planner knows: this machine's measured costs (`calibration`) and each table's hit rate
at any cache size, from a sample of the training input (`hit_rates`)."""
from .calibration import Calibration, CalibrationError, calibrate, calibration_for
from .hit_rates import TableAccess, access_from_batches, shared_cache_hit_rates

__all__ = ["Calibration", "CalibrationError", "calibrate", "calibration_for", "TableAccess", "access_from_batches",
           "shared_cache_hit_rates"]
