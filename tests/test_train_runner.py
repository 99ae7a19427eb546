"""python -m mlkv_torch.train: the quickstart for a few steps, resume, and config errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

from mlkv_torch.config import ConfigError, load_config  # noqa: E402
from mlkv_torch.train import run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SMALL = ["data.synthetic.scale=1000", "train.batch_size=256", "eval.batches=2", "storage.memory_budget_bytes=1048576"]


def test_quickstart_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}", "train.steps=12",
           "train.log_every=4", "eval.every=6", *SMALL, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("samples_per_s", "auc", "logloss", "steps", "peak_rss_bytes", "disk_bytes"):
        assert key in summary, key
    assert summary["steps"] == 12 and summary["samples_per_s"] > 0 and summary["disk_bytes"] > 0
    assert 0.5 < summary["auc"] <= summary["oracle_auc"] + 0.02  # no model beats the planted one
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [4, 8, 12]
    assert [r["step"] for r in lines if "eval_auc" in r] == [6, 12]
    assert all("hit_rate" in r for r in lines if "loss" in r)


def _losses(out: Path):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_resume_continues_as_the_uninterrupted_run(tmp_path):
    common = [*SMALL, "train.log_every=1", "eval.every=1000", "train.checkpoint_every=5", "pipeline.depth=2"]
    whole = load_config(QUICKSTART, [f"output_dir={tmp_path / 'whole'}", "train.steps=14", *common])
    run(whole, progress=False)
    first = load_config(QUICKSTART, [f"output_dir={tmp_path / 'split'}", "train.steps=10", *common])
    run(first, progress=False)
    second = load_config(QUICKSTART, [f"output_dir={tmp_path / 'split'}", "train.steps=14", *common])
    summary = run(second, resume=True, progress=False)
    assert summary["steps"] == 14
    expected, got = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    assert sorted(got) == list(range(1, 15))
    assert [got[s] for s in range(11, 15)] == pytest.approx([expected[s] for s in range(11, 15)], rel=0, abs=0)


@pytest.mark.parametrize("overrides, message", [
    (["train.lernrate=0.1"], r"train\.lernrate: unknown key"),
    (["train.lr=fast"], r"train\.lr: Input should be a valid number"),
    (["storage.kind=tape"], r"storage\.kind: Input should be 'memory' or 'disk'"),
    (["model.embedding_dim=8"], r"model\.dense_arch must end with model\.embedding_dim"),
    (["pipeline.depth=-2"], r"pipeline\.depth"),
    (["train.steps"], r"not of the form dotted\.key=value"),
])
def test_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", *overrides])


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path / 'r'}", *SMALL])
    with pytest.raises(ConfigError, match="--resume: no checkpoint at"):
        run(cfg, resume=True, progress=False)
    done = subprocess.run([sys.executable, "-m", "mlkv_torch.train", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "config error" in done.stderr and "nope.yaml" in done.stderr


def _torchrun(out: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}", f"train.steps={steps}", "--no-progress",
           "data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2", "eval.every=100",
           "storage.memory_budget_bytes=1048576", "train.log_every=1", "train.checkpoint_every=4",
           "pipeline.depth=2", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    return done


def test_torchrun_two_processes_with_disk_tables_and_resume(tmp_path):
    _torchrun(tmp_path / "whole", 12)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12 and summary["samples"] == 12 * 2 * 256
    assert summary["hit_rate"] is not None and summary["disk_bytes"] > 0, "the planner must put tables on disk"
    _torchrun(tmp_path / "split", 8)
    _torchrun(tmp_path / "split", 12, "--resume")
    expected, got = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    assert [got[s] for s in range(9, 13)] == pytest.approx([expected[s] for s in range(9, 13)], rel=0, abs=0)
