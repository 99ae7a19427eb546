"""The runner killed (SIGKILL) at chosen points of its steps and checkpoints and at random moments, and
resumed each time, ends exactly where the uninterrupted run ends: the same losses, the same tables
and the same evaluation. Real processes, real stores. MLKV_CRASH_KILLS sets how many kills (3)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

from mlkv_torch.cut import read_cut  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 36
OVERRIDES = ["data.synthetic.scale=1000", "train.batch_size=256", "eval.batches=2", "eval.every=1000",
             "storage.memory_budget_bytes=1048576", f"train.steps={STEPS}", "train.log_every=1",
             "train.checkpoint_every=3", "pipeline.depth=2"]


def _command(out: Path, resume: bool):
    return [sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}", *OVERRIDES,
            "--no-progress", *(["--resume"] if resume else [])]


def _logged_lines(out: Path) -> int:
    try:
        return (out / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _losses(out: Path):
    """The loss logged for each step (a resumed run drops what its killed predecessor logged past
    the checkpoint, then logs those steps again); a line a kill cut short is skipped."""
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def _tables(out: Path):
    """Every row and optimizer state of the run's tables, at their recorded cut."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from mlkv_torch import optim
    from mlkv_torch.config import load_config
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection
    from mlkv_torch.train.sources import SyntheticSource

    config = load_config(QUICKSTART, [f"output_dir={out}", *OVERRIDES])
    source = SyntheticSource(config)
    tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=config.model.embedding_dim, num_embeddings=n,
                                 feature_names=[name]) for name, n in zip(source.feature_names, source.cardinalities)]
    ebc = DiskEmbeddingBagCollection(tables, path=out / "tables", optimizer=optim.RowWiseAdagrad(lr=config.train.lr),
                                     memory_budget_bytes=1 << 20, reopen=True)
    try:
        return {name: bag.snapshot(include_state=True) for name, bag in ebc.embedding_bags.items()}
    finally:
        ebc.close()


def _next_command(out: Path):
    """The command that goes on with a killed run: --resume from its checkpoint, or from scratch
    (its output removed) when it was killed before its first."""
    resume = (out / "checkpoint.pt").exists()
    if not resume and out.exists():
        shutil.rmtree(out)
    return _command(out, resume)


def _run_patched(program: str, out: Path) -> subprocess.CompletedProcess:
    """The runner's command line, run by `program` (which patches the runner, then calls its main)."""
    return subprocess.run([sys.executable, "-c", program, *_command(out, resume=False)[3:]], capture_output=True,
                          text=True, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("whole")
    done = subprocess.run(_command(out, resume=False), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_killed_at_random_moments_and_resumed_ends_as_the_uninterrupted_run(tmp_path, whole):

    crashed = tmp_path / "crashed"
    rng = random.Random(int(os.environ.get("MLKV_CRASH_SEED", "0")))
    kills = int(os.environ.get("MLKV_CRASH_KILLS", "3"))
    killed_at = []
    for _ in range(kills):
        child = subprocess.Popen(_next_command(crashed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        start = _logged_lines(crashed)
        wait_for = rng.randrange(0, 8)  # steps logged by this start before the kill, then a random instant
        deadline = time.monotonic() + 300
        while child.poll() is None and _logged_lines(crashed) < start + wait_for and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.random() * 0.15)
        if child.poll() is not None:  # it finished first: it must have finished cleanly
            assert child.returncode == 0, child.stderr.read().decode()[-3000:]
            break
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        killed_at.append(_logged_lines(crashed))
    assert killed_at, "no run was killed: the test exercised nothing"
    done = subprocess.run(_next_command(crashed), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]

    _assert_ends_as(crashed, whole, f"killed at logged lines {killed_at}")


def _assert_ends_as(crashed: Path, whole: Path, how: str) -> None:
    """Every step's loss (the whole sequence: a step lost after a resume fails), the summary, the
    tables' cut and every row and optimizer state equal the uninterrupted run's."""
    expected, got = _losses(whole), _losses(crashed)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert got == expected, how
    summary_whole = json.loads((whole / "summary.json").read_text())
    summary_crashed = json.loads((crashed / "summary.json").read_text())
    for key in ("steps", "auc", "logloss"):
        assert summary_crashed[key] == summary_whole[key], key
    assert read_cut(str(crashed / "tables"))["label"] == STEPS
    tables_whole, tables_crashed = _tables(whole), _tables(crashed)
    for name, (weight, state) in tables_whole.items():
        torch.testing.assert_close(tables_crashed[name][0], weight, rtol=0, atol=0, msg=f"{name} weights ({how})")
        torch.testing.assert_close(tables_crashed[name][1], state, rtol=0, atol=0, msg=f"{name} state ({how})")


# The runner SIGKILLs itself at the nth time it reaches a chosen point of a step or of a checkpoint
# (argv[1], argv[2]), so a kill lands where the seed says, whatever the machine's speed.
KILLED_AT_RUN = """
import os, signal, sys
from mlkv_torch import cut, train
from mlkv_torch.train import checkpoints
from mlkv_torch.pipeline import LookaheadPipeline
point, nth = sys.argv[1], int(sys.argv[2])
reached = 0

def reach(name):
    global reached
    if name == point:
        reached += 1
        if reached == nth:
            os.kill(os.getpid(), signal.SIGKILL)

def before(name, f):
    def patched(*args, **kwargs):
        reach(name)
        return f(*args, **kwargs)
    return patched

def after(name, f):
    def patched(*args, **kwargs):
        result = f(*args, **kwargs)
        reach(name)
        return result
    return patched

def partial_written(state, path):  # checkpoint.pt's new version written, not yet renamed into place
    checkpoints.torch.save(state, path + ".partial")
    reach("checkpoint written, not renamed")
    save_whole(state, path)

save_whole = checkpoints.save_whole
LookaheadPipeline.progress = before("step", LookaheadPipeline.progress)
train.Experiment._save_local = after("cut begun", train.Experiment._save_local)
cut.PendingCut.wait = after("cut synced", cut.PendingCut.wait)
checkpoints.save_whole = partial_written
cut.PendingCut.commit = before("checkpoint renamed, stores not told", cut.PendingCut.commit)
sys.exit(train.main(sys.argv[3:]))
"""
KILL_POINTS = ["step", "cut begun", "cut synced", "checkpoint written, not renamed",
               "checkpoint renamed, stores not told"]


def test_killed_at_chosen_points_and_resumed_ends_as_the_uninterrupted_run(tmp_path, whole):
    # Every kill point once, then MLKV_CRASH_EXTRA more drawn from the seed; each start is killed at
    # the nth time it reaches its point (steps: 1-8; a checkpoint's points: its 1st-3rd checkpoint).
    rng = random.Random(int(os.environ.get("MLKV_CRASH_SEED", "0")))
    points = KILL_POINTS + [rng.choice(KILL_POINTS) for _ in range(int(os.environ.get("MLKV_CRASH_EXTRA", "0")))]
    plan = [(point, rng.randrange(1, 9) if point == "step" else rng.randrange(1, 4)) for point in points]
    crashed = tmp_path / "crashed"
    for point, nth in plan:
        command = _next_command(crashed)
        done = subprocess.run([sys.executable, "-c", KILLED_AT_RUN, point, str(nth), *command[3:]], capture_output=True,
                              text=True, timeout=600, cwd=REPO)
        if done.returncode == 0:  # it finished before reaching its point: that is the end
            break
        assert done.returncode == -signal.SIGKILL, f"{point} #{nth}: {done.stderr[-3000:]}"
    done = subprocess.run(_next_command(crashed), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_ends_as(crashed, whole, f"killed at {plan}")


# The runner with its disk full from step 6 on (every file is capped at 8 KiB, RLIMIT_FSIZE, as a full
# disk refuses writes: the stores' files are past it, metrics.jsonl reaches it at about step 28),
# right after its checkpoint at step 6 was committed.
FULL_DISK_RUN = """
import resource, signal, sys
from mlkv_torch import train
save = train.Experiment.save

def save_then_fill_the_disk(self, step):
    save(self, step)
    if step == 6:
        self.finish_save()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

train.Experiment.save = save_then_fill_the_disk
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_full_disk_stops_the_run_and_resume_goes_back_to_its_last_checkpoint(tmp_path, whole):
    out = tmp_path / "full"
    done = _run_patched(FULL_DISK_RUN, out)
    assert done.returncode != 0, "the run went on with its disk full"
    # The store's OSError (mlkv_torch._C.StoreIOError), raised where training met it.
    raised = [line for line in done.stderr.splitlines() if re.match(r"[\w.]*(OSError|StoreIOError): ", line)]
    # A clear error: what failed, on which file of which table, and why.
    assert raised and "File too large" in raised[0] and str(out / "tables") in raised[0], done.stderr[-3000:]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 6
    done = subprocess.run(_command(out, resume=True), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(out) == _losses(whole)
    for key in ("steps", "auc", "logloss"):
        assert json.loads((out / "summary.json").read_text())[key] == json.loads(
            (whole / "summary.json").read_text())[key]


# The runner failing with an exception two steps after its checkpoint at step 6: the cut is written
# (or being written) in the background, checkpoint.pt does not name it yet, and the process closes
# its tables on the way out.
FAILED_STEP_RUN = """
import sys
from mlkv_torch import train
from mlkv_torch.pipeline import LookaheadPipeline
progress, calls = LookaheadPipeline.progress, []

def progress_then_fail(self, data):
    calls.append(1)
    if len(calls) == 8:
        raise RuntimeError("step 8 failed")
    return progress(self, data)

LookaheadPipeline.progress = progress_then_fail
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_step_that_raises_after_a_checkpoint_leaves_the_one_before_resumable(tmp_path, whole):
    out = tmp_path / "failed"
    done = _run_patched(FAILED_STEP_RUN, out)
    assert done.returncode != 0 and "step 8 failed" in done.stderr, done.stderr[-3000:]
    # checkpoint.pt names the cut at step 3; the stores were not told the cut at 6 was committed,
    # so closing them kept the one at 3.
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3
    done = subprocess.run(_command(out, resume=True), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(out) == _losses(whole)
