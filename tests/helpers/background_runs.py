"""Commands that tests check, run beside the suite's other tests: a test module that has them
defines ``background_runs(items) -> [Run, ...]`` for its selected tests; tests/conftest.py starts
them all when the collection ends (`start`) and moves those tests last, where they wait for them
(`results`). tests/workers/background_runner.py runs them: one at a time at the lowest priority
while the other tests run, two at a time once a test waits.

Why: most of the suite is one process at a time, and the second core sits idle for much of it;
the benchmarks' smoke runs and the sanitizers' builds are minutes of CPU that fit there."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    """A command (`argv`, run in the repository, `env` set on top of the suite's; "{scratch}" in
    either stands for a directory of the run's own, removed with the runs), named `name`."""

    name: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)


class BackgroundRuns:
    """The runs, by tests/workers/background_runner.py in a process group of its own."""

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = list(runs)
        self.dir = Path(tempfile.mkdtemp(prefix="mlkv-background-"))
        (self.dir / "runs.json").write_text(json.dumps([{"argv": r.argv, "env": r.env} for r in self.runs]))
        with open(self.dir / "runner.log", "w") as log:
            self.runner = subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "background_runner.py"),
                                            str(self.dir)], stdout=log, stderr=log, cwd=REPO, start_new_session=True)

    def results(self) -> Dict[str, subprocess.CompletedProcess]:
        """Each run, by name, once every run has ended (what has not started runs two at a time)."""
        (self.dir / "wide").touch()
        self.runner.wait()
        results = {}
        for i, run in enumerate(self.runs):
            ended = self.dir / f"{i}.json"
            assert ended.exists(), (self.dir / "runner.log").read_text()[-4000:]
            results[run.name] = subprocess.CompletedProcess(run.argv, json.loads(ended.read_text())["returncode"],
                                                            (self.dir / f"{i}.stdout").read_text(),
                                                            (self.dir / f"{i}.stderr").read_text())
        return results

    def stop(self) -> None:
        """Ends the runs (a session that ended first) and removes their files."""
        if self.runner.poll() is None:
            os.killpg(self.runner.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while self.runner.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.runner.poll() is None:
                os.killpg(self.runner.pid, signal.SIGKILL)
                self.runner.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_session: List[BackgroundRuns] = []  # the session's runs, started once
_results: Dict[str, subprocess.CompletedProcess] = {}


def start(runs: Sequence[Run]) -> None:
    """Starts `runs` (tests/conftest.py, when the collection ends), once a session."""
    if _session:
        raise RuntimeError("the background runs have started already")
    _session.append(BackgroundRuns(runs))


def results(runs: Sequence[Run]) -> Dict[str, subprocess.CompletedProcess]:
    """Each run by name, waiting for them all; `runs` are started now if the session did not start
    any (a test run in another way than by the suite's collection)."""
    if not _results:
        if not _session:
            start(runs)
        _results.update(_session[0].results())
    return _results


def stop() -> None:
    while _session:
        _session.pop().stop()
    _results.clear()
