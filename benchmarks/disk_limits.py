"""This machine's storage limits, the ceiling of the store's disk path: fio's 4 KiB random reads at
queue depths 64 and 1, and 1 MiB sequential reads and writes at depth 16, direct I/O through
io_uring (libaio where io_uring is refused). One line per pattern: name, IOPS, MiB/s, mean
latency in microseconds, tab-separated (what bench_store.py and bench_kernel.py's --iops read).

    python benchmarks/disk_limits.py [DIR] [--seconds 10]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

PATTERNS = [("randread-4k-qd64", "randread", "4k", 64), ("randread-4k-qd1", "randread", "4k", 1),
            ("read-1m-qd16", "read", "1m", 16), ("write-1m-qd16", "write", "1m", 16)]


def _engine(path: str) -> str:
    probe = subprocess.run(["fio", "--name=probe", f"--filename={path}", "--size=64M", "--rw=read",
                            "--ioengine=io_uring", "--runtime=1"], capture_output=True, text=True)
    return "io_uring" if probe.returncode == 0 else "libaio"


def measure(directory: str, seconds: int = 10) -> str:
    """Runs the patterns on a 4 GiB file in `directory` (removed after); raises RuntimeError
    where fio is missing or fails."""
    if shutil.which("fio") is None:
        raise RuntimeError("fio is not installed (Debian: apt-get install fio)")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "fio.dat")
    lines = []
    try:
        engine = _engine(path)
        for name, rw, block, depth in PATTERNS:
            run = subprocess.run(["fio", f"--name={name}", f"--filename={path}", "--size=4G", f"--rw={rw}",
                                  f"--bs={block}", "--direct=1", f"--ioengine={engine}", f"--iodepth={depth}",
                                  f"--runtime={seconds}", "--time_based", "--output-format=json"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"fio {name} failed: {run.stderr.strip()[-500:]}")
            job = json.loads(run.stdout)["jobs"][0]
            side = job["read"] if job["read"]["io_bytes"] else job["write"]
            lines.append(f"{name}\tIOPS={side['iops']:.0f}\tMiB/s={side['bw'] / 1024:.0f}\t"
                         f"lat_us={side['lat_ns']['mean'] / 1000:.0f}")
    finally:
        if os.path.exists(path):
            os.remove(path)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", default=os.path.join(tempfile.gettempdir(), "mlkv-fio"))
    ap.add_argument("--seconds", type=int, default=10)
    args = ap.parse_args(argv)
    try:
        sys.stdout.write(measure(args.dir, args.seconds))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
