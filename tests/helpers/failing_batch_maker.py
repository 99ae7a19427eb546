"""A batch maker for Ray's actors whose first process fails to start, as a maker whose files or
transform one node lacks would (tests/data/test_ray_data.py imports it by name on Ray's workers:
PYTHONPATH holds tests/helpers/)."""
import os


class FailsToStartOnce:
    """`make()`'s batches, but the first process to build one raises instead (the file `marker`
    says one did)."""

    def __init__(self, marker: str, make) -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            self._batches = make()
            return
        raise FileNotFoundError("no such file on this node")

    def arrays(self, number: int):
        return self._batches.arrays(number)

    def decode_row_groups(self, number: int) -> None:
        self._batches.decode_row_groups(number)
