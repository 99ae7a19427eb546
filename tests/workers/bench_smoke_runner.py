"""Runs the benchmark scripts' --smoke modes for tests/test_bench_smoke.py, beside the suite's other
tests: one at a time at the lowest priority (SCHED_IDLE) while they run (most of them leave the
second core idle), two at a time once OUT_DIR/wide exists (the suite has reached the tests that wait for them).

    python tests/workers/bench_smoke_runner.py OUT_DIR SCRIPT [SCRIPT ...]

A SCRIPT is a file of benchmarks/ and its arguments, in one string ("bench_checkpoint.py --runner").
Each run writes its stdout and stderr to OUT_DIR/<i>.stdout and .stderr, then OUT_DIR/<i>.json (its
return code: -9 if it ran TIMEOUT_S past the suite's wait and was killed) when it ends; i is the
SCRIPT's position. It ends its runs and itself when the suite's process is gone.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a run's wall time once the suite waits for it (the longest takes about 70 s alone)


def main() -> int:
    out_dir, scripts = Path(sys.argv[1]), sys.argv[2:]
    # The suite's own tests first: the runs take the CPU time they leave (the runs' children inherit this).
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        os.nice(19)
    parent = os.getppid()
    pending = list(enumerate(scripts))
    running = {}  # process: (i, when it started, when its TIMEOUT_S began)
    wide = False
    while pending or running:
        if not wide and (out_dir / "wide").exists():
            wide = True  # the suite waits: from now on, the runs have the machine, and TIMEOUT_S counts
            running = {process: (i, began, time.monotonic()) for process, (i, began, _) in running.items()}
        while pending and len(running) < (2 if wide else 1):
            i, script = pending.pop(0)
            name, *extra = script.split()
            output = "--json" if name == "bench_embedding.py" else "--out"
            with open(out_dir / f"{i}.stdout", "w") as stdout, open(out_dir / f"{i}.stderr", "w") as stderr:
                process = subprocess.Popen(
                    [sys.executable, str(REPO / "benchmarks" / name), "--smoke", *extra, output,
                     str(out_dir / f"{i}.out.json")], stdout=stdout, stderr=stderr, cwd=REPO)
            running[process] = (i, time.monotonic(), time.monotonic() if wide else float("inf"))
        time.sleep(0.1)
        if os.getppid() != parent:  # the suite is gone (killed): so are its runs
            for process in running:
                process.kill()
            return 1
        for process, (i, began, timed_from) in list(running.items()):
            if process.poll() is None and time.monotonic() - timed_from > TIMEOUT_S:
                process.kill()
            if process.poll() is not None:
                del running[process]
                (out_dir / f"{i}.json").write_text(json.dumps({"returncode": process.returncode,
                                                                "seconds": time.monotonic() - began}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
