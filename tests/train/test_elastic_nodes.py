"""TorchElastic with a changing world (`torchrun --nnodes 1:2`): two nodes in network namespaces,
node 1 killed, the job going on with node 0 alone from its last checkpoint (resharded for one
process), node 1 back and the job growing to two nodes again at its next restart (resharded for 2
ranks), to its last step (tests/workers/elastic_nodes.py runs the job, beside the other tests:
tests/helpers/background_runs.py)."""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from background_runs import Run, results

REPO = Path(__file__).resolve().parents[2]
_RUN = Run("elastic nodes", [sys.executable, str(REPO / "tests" / "workers" / "elastic_nodes.py"), "{scratch}/job"])


def _can_run() -> bool:
    return importlib.util.find_spec("torchrec") is not None and os.geteuid() == 0 and shutil.which("ip") is not None


def background_runs(items) -> list:
    """The job, started when the collection ends (tests/conftest.py)."""
    return [_RUN] if _can_run() else []


def test_a_node_killed_and_brought_back_continues_the_job_from_its_checkpoints_on_each_world():
    if not _can_run():
        pytest.skip("needs torchrec, root and ip (network namespaces)")
    done = results([_RUN])[_RUN.name]
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    job = json.loads(done.stdout.strip().splitlines()[-1])
    assert job["codes"] == [0, 0], job["node0_log_tail"]
    # Node 1 died after the second checkpoint: node 0 went on alone from the last one before the
    # kill, then both from one of node 0's alone.
    (alone_from, written_by_two), (together_from, written_by_one) = job["resumed"]
    assert written_by_two == "2 ranks" and written_by_one == "one process", job["resumed"]
    assert 2 * 25 <= alone_from <= job["killed_at"] and alone_from % 25 == 0, job
    assert together_from > alone_from and together_from % 25 == 0, job
    # Every step once, in order: the steps after a checkpoint that a restart trained again replaced
    # the ones the failed attempt logged.
    assert job["steps"] == list(range(1, 1001)), job["steps"][:5]
    # The data went on where each world left it: 2 batches a step on two nodes, 1 on one.
    assert job["batches"] == 2 * alone_from + (together_from - alone_from) + 2 * (1000 - together_from), job
