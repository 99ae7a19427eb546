"""Runs commands beside the suite's other tests for the tests that check them (the benchmarks'
smoke runs, the sanitizers; tests/helpers/background_runs.py starts it): one at a time at the
lowest priority (SCHED_IDLE) while the other tests run (most of them leave the second core idle),
two at a time once OUT_DIR/wide exists (the suite has reached the tests that wait for them).

    python tests/workers/background_runner.py OUT_DIR

OUT_DIR/runs.json lists the runs in the order they start: [{"argv": [...], "env": {...}}, ...]
(env: variables set on top of this process's; "{scratch}" in either stands for OUT_DIR/<i>.tmp, a
directory of the run's own). Each run writes its stdout and stderr to
OUT_DIR/<i>.stdout and .stderr, then OUT_DIR/<i>.json (its return code: -9 if it ran TIMEOUT_S
past the suite's wait and was killed) when it ends; i is its position. It ends its runs and
itself when the suite's process is gone.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a run's wall time once the suite waits for it (the longest takes about 70 s alone)


def main() -> int:
    out_dir = Path(sys.argv[1])
    runs = json.loads((out_dir / "runs.json").read_text())
    # The suite's own tests first: the runs take the CPU time they leave (the runs' children inherit this).
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        os.nice(19)
    # And the disk they leave (the stress programs write and sync stores, as the suite's store tests do).
    if shutil.which("ionice"):
        subprocess.run(["ionice", "-c", "3", "-p", str(os.getpid())], check=False, capture_output=True)
    parent = os.getppid()
    pending = list(enumerate(runs))
    running = {}  # process: (i, when it started, when its TIMEOUT_S began)
    wide = False
    while pending or running:
        if not wide and (out_dir / "wide").exists():
            wide = True  # the suite waits: from now on, the runs have the machine, and TIMEOUT_S counts
            running = {process: (i, began, time.monotonic()) for process, (i, began, _) in running.items()}
        while pending and len(running) < (2 if wide else 1):
            i, run = pending.pop(0)
            scratch = out_dir / f"{i}.tmp"
            scratch.mkdir()
            argv = [a.replace("{scratch}", str(scratch)) for a in run["argv"]]
            env = {name: value.replace("{scratch}", str(scratch)) for name, value in run.get("env", {}).items()}
            with open(out_dir / f"{i}.stdout", "w") as stdout, open(out_dir / f"{i}.stderr", "w") as stderr:
                process = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=REPO, env={**os.environ, **env})
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
