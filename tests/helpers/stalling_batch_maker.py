"""A batch maker for Ray's actors that keeps one batch's caller waiting, as a result lost between
Ray's nodes would (tests/data/test_ray_data.py imports it by name on Ray's workers: PYTHONPATH holds tests/helpers/)."""
import os
import time


class StallsOnce:
    """`make()`'s batches, but the first process asked for batch `number` sleeps `seconds` first
    (the file `marker` says one did)."""

    def __init__(self, marker: str, number: int, seconds: float, make) -> None:
        self.marker, self.number, self.seconds = marker, number, seconds
        self._batches = make()

    def arrays(self, number: int):
        if number == self.number:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                time.sleep(self.seconds)
            except FileExistsError:
                pass
        return self._batches.arrays(number)

    def decode_row_groups(self, number: int) -> None:
        self._batches.decode_row_groups(number)
