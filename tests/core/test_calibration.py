"""The machine's calibration (`mlkv_torch.planning.calibration`, `python -m mlkv_torch.calibrate`):
measured on a real disk, recorded beside the tables, reused on the same machine and measured again
when the record is another machine's."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mlkv_torch.planning.calibration import (CALIBRATION_FILE, CalibrationError, calibration_for,
                                             machine_identity, recorded_calibration)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables")
    return path, calibration_for(path)


def test_a_calibration_measures_the_disk_the_store_and_the_tables_costs(calibrated):
    path, calibration = calibrated
    disk = calibration.disk
    for rate in ("sequential_write_bytes_per_s", "sequential_read_bytes_per_s", "random_reads_per_s"):
        assert math.isfinite(disk[rate]) and disk[rate] > 0, rate
    assert 0 < disk["random_read_latency_s"] < 0.1
    assert calibration.store_reads_per_s > 0 and calibration.memory_bytes_per_s > 0
    assert calibration.all_to_all_bytes_per_s is None  # one process: no ranks to measure between
    for width in ("16", "128"):
        costs = calibration.table[width]
        assert costs["hit_s"] > 0 and costs["update_s"] > 0 and costs["miss_s"] >= 0
    # A miss costs a disk read on top of a hit: more than a cached lookup.
    assert calibration.table_cost("miss_s", 16) > calibration.table_cost("hit_s", 16)
    assert calibration.table_cost("hit_s", 64) >= 0
    assert sorted(os.listdir(path)) == [CALIBRATION_FILE]  # the probes' files are gone


def test_the_record_is_used_on_the_same_machine_and_measured_again_on_another(calibrated, tmp_path):
    tables, calibration = calibrated
    assert calibration_for(tables) == calibration  # the record, not a new measurement
    path, file = tmp_path, tmp_path / CALIBRATION_FILE
    record = json.loads((tables / CALIBRATION_FILE).read_text())
    assert record["machine"] == machine_identity(path)
    record["machine"]["disk"] = "259:0 nvme0n1 another disk"
    file.write_text(json.dumps(record))
    assert recorded_calibration(path) is None  # another disk's: never used
    again = calibration_for(path)
    assert again != calibration and again.machine == machine_identity(path)
    assert json.loads(file.read_text())["machine"] == machine_identity(path)
    file.write_text("{not json")
    assert recorded_calibration(path) is None


def test_a_path_that_cannot_be_written_is_refused_by_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CalibrationError, match=r"calibration needs a directory it can write.*a-file/tables"):
        calibration_for(blocker / "tables")
    run = subprocess.run([sys.executable, "-m", "mlkv_torch.calibrate", "--path", str(blocker / "tables")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "a-file/tables" in run.stderr and "Traceback" not in run.stderr


def test_the_command_prints_the_recorded_figures(calibrated):
    path, calibration = calibrated
    run = subprocess.run([sys.executable, "-m", "mlkv_torch.calibrate", "--path", str(path)],
                         capture_output=True, text=True, check=True)
    assert f"{calibration.store_reads_per_s:,.0f} rows/s read from disk through KVStore" in run.stdout
    assert f"measured in {calibration.seconds:.1f} s" in run.stdout  # the record's: not measured again
