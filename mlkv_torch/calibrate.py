"""Measures this machine for the planner and records it beside the tables (`planning.calibration`).

    python -m mlkv_torch.calibrate --path DIR [--device cpu|cuda] [--again]

Prints the figures; the record (``DIR/.mlkv_calibration.json``) is what a planner planning tables
under DIR uses, measured again when the host, the disk under DIR, the device or a version differs.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .planning.calibration import CalibrationError, calibrate, calibration_for, record


def describe(calibration) -> str:
    """The calibration in lines a person reads."""
    disk, wire = calibration.disk, calibration.all_to_all_bytes_per_s
    lines = [f"machine: {', '.join(f'{k} {v}' for k, v in calibration.machine.items())}",
             f"disk ({'direct I/O' if disk['direct_io'] else 'page cache: no direct I/O here'}): 4 KiB random reads "
             f"{disk['random_reads_per_s']:,.0f}/s at depth {disk['random_read_depth']:.0f}, "
             f"{disk['random_read_latency_s'] * 1e6:.0f} us at depth 1; sequential reads "
             f"{disk['sequential_read_bytes_per_s'] / 2**20:,.0f} MiB/s, writes "
             f"{disk['sequential_write_bytes_per_s'] / 2**20:,.0f} MiB/s",
             f"store: {calibration.store_reads_per_s:,.0f} rows/s read from disk through KVStore",
             f"memory: {calibration.memory_bytes_per_s / 2**30:,.1f} GiB/s"]
    for width, costs in calibration.table.items():
        lines.append(f"disk table, rows of {width}: {costs['hit_s'] * 1e9:,.0f} ns a cached lookup, "
                     f"{costs['miss_s'] * 1e9:,.0f} ns more a missed one, {costs['update_s'] * 1e9:,.0f} ns "
                     f"an updated row")
    lines.append("all-to-all: " + (f"{wire / 2**20:,.0f} MiB/s a rank" if wire else "not measured (one process)"))
    lines.append(f"measured in {calibration.seconds:.1f} s")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlkv_torch.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, help="a directory on the disk the tables will use")
    ap.add_argument("--device", default="cpu", help="where the tables' caches live: cpu or cuda")
    ap.add_argument("--again", action="store_true", help="measure even when a record holds for this machine")
    args = ap.parse_args(argv)
    try:
        if args.again:
            calibration = calibrate(args.path, args.device)
            record(args.path, calibration)
        else:
            calibration = calibration_for(args.path, args.device)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(calibration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
