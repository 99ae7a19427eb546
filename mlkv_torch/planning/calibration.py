"""This machine's costs, measured once per host, disk and device and kept beside the tables.

`calibrate(path)` measures (`measurements`): the disk under `path` (4 KiB random reads at queue
depth 1 and 16, sequential 1 MiB reads and writes), the store's disk-bound read rate through
`KVStore`, the disk table's seconds per cached lookup, per missed lookup and per updated row (at
two widths: a cost grows with the row's bytes), the host's memory bandwidth and, under
torch.distributed, the all-to-all rate. `calibration_for(path)` returns the one recorded in
``path/.mlkv_calibration.json`` when it was measured on this machine (same host, same block
device under `path`, same cores, device and versions) and measures again otherwise: a record from
another disk or host is never used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import tempfile
import time
from typing import Any, Dict, Optional, Union

import torch

from . import measurements

__all__ = ["Calibration", "CalibrationError", "calibrate", "calibration_for", "machine_identity",
           "record", "recorded_calibration", "CALIBRATION_FILE"]

CALIBRATION_FILE = ".mlkv_calibration.json"
_FORMAT = 1
_WIDTHS = (16, 128)  # the row widths the table's costs are measured at


class CalibrationError(OSError):
    """The calibration cannot run where it was asked to (the message names the path and why)."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one machine's measurements say (rates in units a second, times in seconds)."""
    machine: Dict[str, str]
    disk: Dict[str, float]          # measurements.disk
    store_reads_per_s: float        # KVStore's disk-bound gets of random rows
    table: Dict[str, Dict[str, float]]  # by width ("16", "128"): hit_s, miss_s, update_s
    memory_bytes_per_s: float
    all_to_all_bytes_per_s: Optional[float]  # None: measured outside torch.distributed
    seconds: float                  # how long the calibration took

    def table_cost(self, name: str, dim: int) -> float:
        """Seconds of `name` (hit_s, miss_s or update_s) for rows of `dim` elements: linear in the
        width between (and beyond) the two measured, never below zero."""
        low, high = (self.table[str(w)][name] for w in _WIDTHS)
        slope = (high - low) / (_WIDTHS[1] - _WIDTHS[0])
        return max(0.0, low + slope * (dim - _WIDTHS[0]))

    def to_json(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), format=_FORMAT)

    @classmethod
    def from_json(cls, record: Dict[str, Any]) -> "Calibration":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})


def _block_device(path: str) -> str:
    """The block device (and its model, where the kernel names it) under `path`'s file system."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sysfs = f"/sys/dev/block/{major}:{minor}"
    name = os.path.basename(os.path.realpath(sysfs)) if os.path.exists(sysfs) else ""
    model = ""
    for candidate in (f"{sysfs}/device/model", f"{sysfs}/../device/model"):
        if os.path.exists(candidate):
            with open(candidate) as f:
                model = f.read().strip()
            break
    return f"{major}:{minor} {name} {model}".strip()


def machine_identity(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu") -> Dict[str, str]:
    """What a calibration holds for: host, block device under `path`, cores, processor, the device
    the tables train on and the versions of torch and this package."""
    from .. import __version__

    device = torch.device(device)
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"host": socket.gethostname(), "disk": _block_device(os.fspath(path)), "cores": str(os.cpu_count()),
            "processor": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": accelerator,
            "torch": torch.__version__, "mlkv_torch": __version__}


def _writable_directory(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".calibration-probe-"):
            pass
    except OSError as e:
        raise CalibrationError(e.errno, f"calibration needs a directory it can write, on the disk the tables use: "
                                        f"{path!r} is not ({e.strerror or e})") from e
    return path


def calibrate(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
              group: Optional[object] = None) -> Calibration:
    """Measures this machine under `path` (a directory on the tables' disk; at most ~330 MB are
    written there and removed) and returns the calibration; under torch.distributed every rank of
    `group` must call it (the all-to-all is a collective). Takes about ten seconds."""
    path = _writable_directory(os.fspath(path))
    device = torch.device(device)
    start = time.perf_counter()
    work = tempfile.mkdtemp(prefix=".calibrating-", dir=path)
    try:
        disk = measurements.disk(work)
        store = measurements.store_reads(work)
        table = {str(w): measurements.table_costs(work, w, device) for w in _WIDTHS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wire = measurements.all_to_all(group)
    return Calibration(machine=machine_identity(path, device), disk=disk, store_reads_per_s=store["store_reads_per_s"],
                       table=table, memory_bytes_per_s=measurements.memory_bandwidth()["memory_bytes_per_s"],
                       all_to_all_bytes_per_s=wire.get("all_to_all_bytes_per_s"),
                       seconds=time.perf_counter() - start)


def recorded_calibration(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu"
                         ) -> Optional[Calibration]:
    """The calibration recorded under `path` when it holds for this machine (None: none, another
    format, or measured elsewhere: another host, disk, device or version)."""
    file = os.path.join(os.fspath(path), CALIBRATION_FILE)
    try:
        with open(file) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        return None
    if record.get("machine") != machine_identity(path, device):
        return None
    return Calibration.from_json(record)


def calibration_for(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
                    group: Optional[object] = None, needs_wire: bool = False) -> Calibration:
    """The calibration of this machine under `path`: the recorded one when it holds here (and has
    the all-to-all rate, when `needs_wire`), else a new one, recorded for next time."""
    path = os.fspath(path)
    recorded = recorded_calibration(path, device) if os.path.isdir(path) else None
    usable = recorded is not None and (recorded.all_to_all_bytes_per_s is not None or not needs_wire)
    if _any_rank(not usable, group):  # the ranks measure together: the all-to-all is a collective
        recorded = calibrate(path, device, group)
        record(path, recorded)
    return recorded


def record(path: Union[str, os.PathLike], calibration: Calibration) -> None:
    """Writes `calibration` as the record under `path` (atomically: a reader sees the old or the new)."""
    file = os.path.join(os.fspath(path), CALIBRATION_FILE)
    temporary = f"{file}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(calibration.to_json(), f, indent=1)
    os.replace(temporary, file)


def _any_rank(flag: bool, group: Optional[object]) -> bool:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return flag
    from ..ranks import collective_device

    value = torch.tensor([int(flag)], device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
