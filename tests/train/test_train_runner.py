"""python -m mlkv_torch.train: the quickstart for a few steps, resume, and config errors."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch

pytest.importorskip("torchrec")

from mlkv_torch.config import ConfigError, cardinalities_of, load_config  # noqa: E402
from mlkv_torch.data.synthetic import SyntheticCTR  # noqa: E402
from mlkv_torch.train import run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SMALL = ["data.synthetic.scale=1000", "train.batch_size=256", "eval.batches=2", "storage.memory_budget_bytes=1048576"]


def test_quickstart_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}", "train.steps=12",
           "train.log_every=4", "eval.every=6", *SMALL, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(done.stdout) == summary  # stdout is the summary alone: diagnostics go to stderr
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


def test_loader_settings_do_not_change_training_and_the_input_wait_is_reported(tmp_path):
    common = [*SMALL, "train.steps=10", "train.log_every=2", "eval.every=1000", "train.tensorboard=true"]
    auto = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'auto'}", *common]), progress=False)
    fixed = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'fixed'}", "data.workers=3", "data.prefetch=1",
                                         *common]), progress=False)
    assert _losses(tmp_path / "auto") == _losses(tmp_path / "fixed")  # batches in order, whatever the threads
    assert fixed["input"]["workers"] == 3 and fixed["input"]["prefetch"] == 1 and fixed["input"]["decisions"] == 0
    assert auto["input"]["decisions"] == 1  # at the 8th batch
    assert auto["input"]["workers_needed"] >= 1 and auto["input"]["cpu_budget"] >= 1
    assert 0 < auto["input"]["input_cores"] <= auto["input"]["workers_needed"] / 1.5 + 1e-9  # the tuner's margin
    assert fixed["input"]["workers_needed"] >= 1 and fixed["input"]["input_cores"] > 0  # measured, nothing tuned
    for summary in (auto, fixed):
        assert 0 < summary["input_wait_share"] < 1  # the first batch is always waited for
        assert 0 < summary["input_wait_ms"] * summary["steps"] / 1e3 < summary["seconds"]
        assert summary["input"]["batch_bytes"] > 0 and summary["input"]["buffer_bytes"] > 0
    records = [json.loads(line) for line in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["input_workers"] == 3 and r["input_wait_ms"] >= 0 for r in records if "loss" in r)
    # Each log line's step_ms is its 2 steps' mean: together, the summary's training time.
    logged_ms = sum(2 * r["step_ms"] for r in records if "loss" in r)
    assert logged_ms == pytest.approx(fixed["train_seconds"] * 1e3, rel=1e-9)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "auto" / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss")}
    assert losses == pytest.approx(_losses(tmp_path / "auto"), rel=1e-6)  # TensorBoard keeps float32
    assert [e.step for e in events.Scalars("input_wait_ms")] == [2, 4, 6, 8, 10]


class _RunsCode:
    """Unpickling it runs a command: what a checkpoint from an untrusted place could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


def test_a_checkpoint_holding_code_is_refused(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "ran"
    out.mkdir()
    torch.save({"step": 3, "dense": {}, "cut": None, "payload": _RunsCode(marker)}, out / "checkpoint.pt")
    config = load_config(QUICKSTART, [f"output_dir={out}", *SMALL])
    with pytest.raises(ConfigError, match=r"checkpoint\.pt holds objects other than tensors and plain values"):
        run(config, resume=True, progress=False)
    assert not marker.exists()  # refused before anything in it ran


def test_a_torchrun_pointer_naming_another_directory_is_refused(tmp_path):
    from mlkv_torch.train import Experiment

    out = tmp_path / "run"
    out.mkdir()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("x")
    for directory in ("/", "../keep", str(keep), "checkpoint-8/../../keep", 8):
        (out / "checkpoint.latest").write_text(json.dumps({"directory": directory, "cuts": {}}))
        experiment = Experiment.__new__(Experiment)  # only the pointer's reading, not a whole run
        experiment.config = load_config(QUICKSTART, [f"output_dir={out}", *SMALL])
        experiment.distributed = True
        with pytest.raises(ConfigError, match=r"not a checkpoint-<step> directory of this run"):
            experiment._latest_sharded()
    assert (keep / "precious").exists()
    (out / "checkpoint.latest").write_text(json.dumps({"directory": "checkpoint-8", "cuts": {"0": None}}))
    assert experiment._latest_sharded() == (str(out / "checkpoint-8"), {})


def test_populated_tables_resume_twice_from_one_checkpoint(tmp_path):
    """Populating ends with a cut; a resumed run does not populate again, so a second resume from the
    same checkpoint (the first was killed before its next one) still finds the tables' cut."""
    common = [*SMALL, "train.log_every=1", "eval.every=1000", "train.checkpoint_every=4", "storage.populate=true"]
    whole = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'whole'}", "train.steps=8", *common]), progress=False)
    assert whole["populate_s"] > 0
    split = [f"output_dir={tmp_path / 'split'}", *common]
    run(load_config(QUICKSTART, [*split, "train.steps=6"]), progress=False)  # checkpoint at 4; closed at 6
    resumed = run(load_config(QUICKSTART, [*split, "train.steps=7"]), resume=True, progress=False)
    assert resumed["populate_s"] == 0
    run(load_config(QUICKSTART, [*split, "train.steps=8"]), resume=True, progress=False)  # from 4 again
    expected, got = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    assert [got[s] for s in range(5, 9)] == pytest.approx([expected[s] for s in range(5, 9)], rel=0, abs=0)
    # Each resume dropped the records its killed predecessor logged past the checkpoint: every step once.
    logged = [r["step"] for r in map(json.loads, (tmp_path / "split" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert logged == list(range(1, 9))


def test_resume_from_a_checkpoint_at_the_last_step_keeps_or_makes_the_summary(tmp_path):
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path / 'r'}", *SMALL, "train.steps=6", "train.checkpoint_every=3",
                                   "eval.every=1000"])
    finished = run(cfg, progress=False)
    assert finished["auc"] is not None
    again = run(cfg, resume=True, progress=False)  # the finished run's summary stays, untouched
    assert again == finished == json.loads((tmp_path / "r" / "summary.json").read_text())
    (tmp_path / "r" / "summary.json").unlink()  # killed after its last checkpoint, before the summary
    made = run(cfg, resume=True, progress=False)
    assert made["steps"] == 6 and made["auc"] == pytest.approx(finished["auc"], abs=1e-6)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["auc"] == made["auc"]
    fewer = load_config(QUICKSTART, [f"output_dir={tmp_path / 'r'}", *SMALL, "train.steps=3",
                                     "train.checkpoint_every=3", "eval.every=1000"])
    with pytest.raises(ConfigError, match=r"^train.steps=3 is below step 6, where the checkpoint is: set train.steps "
                                          r"to 6 or more \(6 only evaluates\)$"):
        run(fewer, resume=True, progress=False)
    # Neither resumed nor started over: refused in one line that names both ways on.
    with pytest.raises(ConfigError, match=r"^output_dir '.*' holds an earlier run's tables: continue it with --resume, "
                                          r"or start over with --overwrite$"):
        run(cfg, progress=False)
    # Also where this run would lay its tables out otherwise (in memory here; another world's ranks
    # likewise), so that opening them would not collide: the command looks at what the run left.
    refused = subprocess.run([sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={tmp_path / 'r'}",
                              "storage.kind=memory"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert refused.returncode == 2 and re.fullmatch(
        r"config error: output_dir '.*' holds an earlier run \(checkpoint\.pt, metrics\.jsonl, summary\.json, \d+ "
        r"tables\): continue it with --resume, or start over with --overwrite", refused.stderr.strip().splitlines()[-1])


def test_overwrite_starts_over_and_removes_only_what_a_run_made(tmp_path):
    out = tmp_path / "r"
    cfg = load_config(QUICKSTART, [f"output_dir={out}", *SMALL, "train.steps=6", "train.checkpoint_every=3",
                                   "train.log_every=1", "eval.every=1000"])
    first = run(cfg, progress=False)
    assert (out / "checkpoint.pt").exists() and (out / "tables" / "CUT.json").exists()
    (out / "notes.txt").write_text("the user's")
    (out / "tables" / "scratch").mkdir()  # not a table: no TABLE.json
    again = run(cfg, progress=False, overwrite=True)
    assert again["auc"] == pytest.approx(first["auc"], abs=1e-6)  # from the initial rows, as the first run
    logged = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged == list(range(1, 7))  # the first run's records gone, not appended to
    assert (out / "notes.txt").read_text() == "the user's" and (out / "tables" / "scratch").is_dir()
    done = subprocess.run([sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), "--resume", "--overwrite"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


def test_overwrite_under_torchrun_removes_each_ranks_tables_and_cut(tmp_path):
    from mlkv_torch.train import outputs

    storage = tmp_path / "nvme"  # storage.path given: the user's directory, which stays
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path / 'r'}", f"storage.path={storage}"])
    for rank in (0, 1):
        (storage / f"rank{rank}" / "t_cat_0").mkdir(parents=True)
        (storage / f"rank{rank}" / "t_cat_0" / "TABLE.json").write_text("{}")
        (storage / f"rank{rank}" / "CUT.json").write_text("{}")
    (storage / "other").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint-8").mkdir()
    (tmp_path / "r" / "checkpoint.latest").write_text("checkpoint-8")
    assert outputs.remove_earlier_run(cfg) == 6
    assert sorted(os.listdir(storage)) == ["other"] and os.listdir(tmp_path / "r") == []


@pytest.mark.parametrize("overrides, message", [
    (["train.lernrate=0.1"], r"^override 'train\.lernrate=0\.1': train\.lernrate: unknown key$"),  # not the file's
    (["train.lr=fast"], r"train\.lr: Input should be a valid number"),
    (["storage.kind=tape"], r"storage\.kind: Input should be 'memory', 'disk' or 'rocksdb'"),
    (["model.embedding_dim=8"], r"model\.dense_arch must end with model\.embedding_dim"),
    # One line for a union's members, without pydantic's names for them (literal['auto'], constrained-int).
    (["pipeline.depth=-2"], r"^override 'pipeline\.depth=-2': pipeline\.depth: Input should be 'auto' or Input should "
                            r"be greater than or equal to 0$"),
    (["train.steps"], r"not of the form dotted\.key=value"),
    (["storage.sharding_types=[by_hand]"], r"storage\.sharding_types\.0: Input should be 'table_wise', "),
    (["storage.comms.forward=fp8"], r"storage\.comms\.forward: Input should be 'fp32', 'fp16' or 'bf16'"),
    (["data.synthetic.id_space=1000"], r"data\.synthetic: id_space must be a power of two"),
    (["data.synthetic.new_ids_per_batch=5"], r"data\.synthetic: new_ids_per_batch .* is for raw ids"),
])
def test_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", *overrides])


def test_an_output_dir_or_storage_path_that_cannot_be_made_is_a_config_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    config = load_config(QUICKSTART, [f"output_dir={tmp_path / 'a-file' / 'run'}", *SMALL])
    with pytest.raises(ConfigError, match=r"output_dir '.*a-file/run' cannot be created: Not a directory"):
        run(config, progress=False)
    config = load_config(QUICKSTART, [f"output_dir={tmp_path / 'run'}", f"storage.path={tmp_path / 'a-file' / 't'}",
                                      *SMALL])
    with pytest.raises(ConfigError, match=r"^storage\.path '.*a-file/t' cannot be created: Not a directory$"):
        run(config, progress=False)


def test_a_budget_too_small_for_the_tables_is_a_config_error(tmp_path):
    small_budget = [o for o in SMALL if not o.startswith("storage.memory_budget_bytes")]
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", *small_budget, "storage.memory_budget_bytes=65536"])
    with pytest.raises(ConfigError,
                       match=r"storage\.memory_budget_bytes: memory_budget_bytes=65536 .* use at least \d+$"):
        run(config, progress=False)


def test_a_checkpoint_of_another_model_names_only_the_keys_that_differ():
    from mlkv_torch.train.checkpoints import restored as _restored

    target = {"model": {"dense.weight": torch.zeros(2), "tables.t_1.weight": torch.zeros(2)}, "step": 0}
    saved = {"model": {"dense.weight": torch.ones(2), "tables.t_2.weight": torch.ones(2)}, "step": 8}
    with pytest.raises(ConfigError, match=r"at model: the checkpoint lacks \['tables\.t_1\.weight'\]; the checkpoint "
                                          r"has \['tables\.t_2\.weight'\], which this model does not$"):
        _restored(target, saved)
    restored = _restored({"model": {"dense.weight": torch.zeros(2)}, "step": 0},
                         {"model": {"dense.weight": torch.ones(2)}, "step": 8})
    assert restored["step"] == 8 and torch.equal(restored["model"]["dense.weight"], torch.ones(2))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    cfg = load_config(QUICKSTART, [f"output_dir={tmp_path / 'r'}", *SMALL])
    with pytest.raises(ConfigError, match=r"--resume: output_dir '.*' holds no checkpoint to continue from "
                                          r"\(train\.checkpoint_every is not set\); start over with --overwrite$"):
        run(cfg, resume=True, progress=False)
    done = subprocess.run([sys.executable, "-m", "mlkv_torch.train", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "config error" in done.stderr and "nope.yaml" in done.stderr


def _runner_arguments(out: Path, steps: int, *extra: str) -> list:
    """The runner's command line after its module: the quickstart, small, for `steps` steps."""
    return [str(QUICKSTART), f"output_dir={out}", f"train.steps={steps}", "--no-progress",
            "data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2", "eval.every=100",
            "storage.memory_budget_bytes=1048576", "train.log_every=1", "train.checkpoint_every=4",
            "pipeline.depth=2", *extra]


def _torchrun(out: Path, steps: int, *extra: str, worker: Sequence[str] = ("-m", "mlkv_torch.train"),
              launcher: Sequence[str] = (), env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """The runner on 2 ranks under torchrun."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *launcher]
    done = subprocess.run([sys.executable, *torchrun, *worker, *_runner_arguments(out, steps, *extra)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-6000:]
    return done


def _run_here(runner_here, out: Path, steps: int, *extra: str) -> str:
    """The runner's command line as `_torchrun` gives it, for one process in this process; its stderr."""
    code, err = runner_here(_runner_arguments(out, steps, *extra))
    assert code == 0, err[-6000:]
    return err


# The runs under torchrun use TorchRec's quantized comms (tests/torchrec_integration/test_row_wise.py has them
# against float32).
COMMS = ["storage.comms.forward=fp16", "storage.comms.backward=bf16"]


@pytest.fixture(scope="module")
def whole_on_two_ranks(tmp_path_factory) -> Path:
    """12 steps under torchrun, uninterrupted."""
    out = tmp_path_factory.mktemp("torchrun") / "whole"
    done = _torchrun(out, 12, "storage.populate=true", *COMMS)  # populating changes no result
    # stdout is rank 0's summary alone; what the ranks say on the way goes to stderr.
    assert json.loads(done.stdout) == json.loads((out / "summary.json").read_text())
    assert "[train] wrote" in done.stderr
    # TorchRec's and torch's messages for every replicated table, harmless for these models (mlkv_torch/train/quiet.py).
    for noise in ("caching params will be ignored", "Sharding spec not found", "an autograd kernel was not registered"):
        assert noise not in done.stderr, noise
    assert "The topology was constructed directly" not in done.stderr  # made by TorchRec's TopologyFactory
    # Nothing else: besides torchrun's own banner (OMP_NUM_THREADS), only the runner's tagged lines.
    banner = ("*" * 8, "Setting OMP_NUM_THREADS")
    untagged = [line for line in done.stderr.splitlines()
                if line.strip() and not line.startswith(("[train]", "[data]", *banner))]
    assert not untagged, untagged
    return out


def test_torchrun_two_processes_with_disk_tables_and_resume(tmp_path, whole_on_two_ranks):
    comms = COMMS
    summary = json.loads((whole_on_two_ranks / "summary.json").read_text())
    assert summary["populate_s"] > 0
    assert summary["world_size"] == 2 and summary["steps"] == 12 and summary["samples"] == 12 * 2 * 256
    assert summary["hit_rate"] is not None and summary["disk_bytes"] > 100 << 10, "the planner must put tables on disk"
    # What the all-to-alls sent between the ranks: each pooled output's gradient comes back.
    by_kind = summary["embedding_bytes_per_step_by_kind"]
    assert by_kind["outputs"] == by_kind["gradients"] > 0 and by_kind["ids"] > 0
    assert summary["embedding_bytes_per_step"] == pytest.approx(sum(by_kind.values()))
    logged = [json.loads(line) for line in (whole_on_two_ranks / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["embedding_bytes_per_step"] for r in logged if "embedding_bytes_per_step" in r]
    assert len(per_step) == 12 and sum(per_step) == pytest.approx(12 * summary["embedding_bytes_per_step"])
    # The first run ends at step 10, two steps past its last checkpoint (8), and its close takes a cut
    # of every rank's tables at 10: the resumed run reopens them at the checkpoint's cuts, not those.
    _torchrun(tmp_path / "split", 10, *comms)
    pointer = json.loads((tmp_path / "split" / "checkpoint.latest").read_text())
    assert pointer["directory"] == "checkpoint-8" and {c["label"] for c in pointer["cuts"].values() if c} == {8}
    # other loader settings: the same batches
    _torchrun(tmp_path / "split", 12, "--resume", "data.workers=2", "data.prefetch=5", *comms)
    expected, got = _losses(whole_on_two_ranks), _losses(tmp_path / "split")
    assert [got[s] for s in range(9, 13)] == pytest.approx([expected[s] for s in range(9, 13)], rel=0, abs=0)


def test_raw_ids_under_torchrun_each_rank_holding_a_block_of_the_2_40_rows(tmp_path):
    # The planner sizes each table by the ids it will hold (not its 2**40 rows) and shards it by
    # rows: rank r owns ids [r * 2**39, (r + 1) * 2**39).
    out = tmp_path / "raw"
    _torchrun(out, 6, "data.synthetic.scale=1000", "data.synthetic.id_space=1099511627776",
              "data.synthetic.new_ids_per_batch=50", "storage.sharding_types=[row_wise]")
    summary = json.loads((out / "summary.json").read_text())
    generator = SyntheticCTR(cardinalities=cardinalities_of("criteo_kaggle", 1000), id_space=2**40,
                             new_ids_per_batch=50)
    trained = {(f, i) for b in range(6 * 2) for f, column in enumerate(generator.batch(b, 256)[1].T.tolist())
               for i in column}
    assert summary["live_ids"] == len(trained) and summary["steps"] == 6
    for rank, first_row in enumerate((0, 2**39)):
        assert (out / "tables" / f"rank{rank}" / f"t_cat_0_rows{first_row}_cols0").is_dir()


def test_a_rank_killed_under_torchrun_max_restarts_makes_the_job_go_on_from_its_last_checkpoint(
        tmp_path, whole_on_two_ranks):
    # Attempt 0: rank 1 dies at step 3, before the first checkpoint (4): the restarted job starts over.
    # Attempt 1: rank 0 dies at step 10: the job resumes from its last checkpoint. No --resume.
    out = tmp_path / "elastic"
    done = _torchrun(out, 12, *COMMS, worker=[str(REPO / "tests" / "workers" / "elastic_worker.py")],
                     launcher=["--max-restarts", "2"], env={"MLKV_TEST_KILLS": "0:1:3,1:0:10"})
    assert "restart 1): no checkpoint yet, starting over" in done.stderr, done.stderr[-4000:]
    assert "restart 2): resuming from the last checkpoint" in done.stderr, done.stderr[-4000:]
    expected, got = _losses(whole_on_two_ranks), _losses(out)
    assert sorted(got) == list(range(1, 13)) and got == expected
    summary, whole = (json.loads((d / "summary.json").read_text()) for d in (out, whole_on_two_ranks))
    assert (summary["steps"], summary["auc"], summary["logloss"]) == (whole["steps"], whole["auc"], whole["logloss"])
    # The summary's throughput is the last attempt's, from the checkpoint it resumed (8, or 4 where
    # 8's commit was still under way at the kill); `job` counts the whole job's.
    assert summary["start_step"] in (4, 8) and whole["start_step"] == 0
    assert summary["job"] == whole["job"] == {"batches": 24, "samples": whole["samples"]}
    assert summary["samples"] == whole["samples"] * (12 - summary["start_step"]) // 12


def test_torchrun_converts_each_criteo_file_once(tmp_path):
    train_txt = tmp_path / "train.txt"
    _write_criteo_tsv(train_txt, 3 * 450, 3)  # the evaluation day: 7 batches of 64, one more for rank 0 than 1
    criteo = ["data.kind=criteo", f"data.criteo.train=[{train_txt}]", "data.criteo.days=3",
              f"data.criteo.cache_dir={tmp_path / 'cache'}", "train.checkpoint_every=100", "eval.every=4",
              "data.criteo.cardinalities=[" + ",".join(["300"] * 26) + "]", "train.batch_size=64", "eval.batches=10"]
    first = _torchrun(tmp_path / "first", 4, *criteo)
    conversions = [line for line in first.stderr.splitlines() if line.startswith("[criteo] ") and "rows/s" in line]
    assert len(conversions) == 1, first.stderr[-3000:]  # one rank converted, the other waited for it
    second = _torchrun(tmp_path / "second", 4, *criteo)
    assert "[criteo] " not in second.stderr  # found converted: training starts at once
    assert _losses(tmp_path / "first") == _losses(tmp_path / "second")
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert summary["auc"] is not None  # as many evaluation batches on each rank: 3, not 4 and 3


def _write_criteo_tsv(path: Path, rows: int, seed: int) -> None:
    """Criteo's TSV layout: label, 13 integers (some missing), 26 hex categoricals (some missing)."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(rows):
        label = int(torch.randint(0, 2, (1,), generator=g))
        ints = [str(int(v)) if v >= 0 else "" for v in torch.randint(-1, 50, (13,), generator=g)]
        cats = [format(int(v), "08x") if v >= 0 else "" for v in torch.randint(-1, 5000, (26,), generator=g)]
        lines.append("\t".join([str(label), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


def test_criteo_tsv_and_npy_days(tmp_path):
    from mlkv_torch.data.criteo_convert import convert

    _write_criteo_tsv(tmp_path / "day_0.tsv", 600, 0)
    _write_criteo_tsv(tmp_path / "day_1.tsv", 300, 1)
    training = ["data.kind=criteo", "data.criteo.cardinalities=[" + ",".join(["1000"] * 26) + "]", "train.steps=12",
                "train.batch_size=64", "eval.every=6", "eval.batches=3", "storage.memory_budget_bytes=1048576",
                "train.log_every=1", f"data.criteo.cache_dir={tmp_path / 'cache'}"]
    tsv = [f"output_dir={tmp_path / 'tsv'}", f"data.criteo.train=[{tmp_path / 'day_0.tsv'}]",
           f"data.criteo.eval=[{tmp_path / 'day_1.tsv'}]", *training]
    summary = run(load_config(QUICKSTART, tsv), progress=False)
    assert summary["steps"] == 12 and summary["samples"] == 12 * 64  # 9 batches a pass: a second pass
    assert 0.0 <= summary["auc"] <= 1.0 and summary["oracle_auc"] is None
    # The converted days (found in the cache, not converted again), read as torchrec's npy layout, train the same.
    [[train_day], [eval_day]] = convert([str(tmp_path / "day_0.tsv"), str(tmp_path / "day_1.tsv")],
                                        str(tmp_path / "cache"))
    npy = [f"output_dir={tmp_path / 'npy'}", "data.criteo.format=npy", f"data.criteo.train=[{train_day}]",
           f"data.criteo.eval=[{eval_day}]", *training]
    again = run(load_config(QUICKSTART, npy), progress=False)
    assert _losses(tmp_path / "npy") == _losses(tmp_path / "tsv")
    assert again["auc"] == pytest.approx(summary["auc"])
    with pytest.raises(ConfigError, match=r"data\.criteo\.train\[0\]: file .*nope\.tsv' does not exist"):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", "data.kind=criteo",
                                 f"data.criteo.train=[{tmp_path / 'nope.tsv'}]"])
    with pytest.raises(ConfigError, match=r"data\.criteo\.train must list"):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", "data.kind=criteo"])


def test_raw_criteo_ids_each_train_their_own_row(tmp_path):
    import numpy as np

    from mlkv_torch.data.criteo_convert import convert

    _write_criteo_tsv(tmp_path / "day_0.tsv", 600, 0)
    overrides = [f"output_dir={tmp_path / 'raw'}", "data.kind=criteo", "data.criteo.cardinalities=raw",
                 f"data.criteo.train=[{tmp_path / 'day_0.tsv'}]", f"data.criteo.cache_dir={tmp_path / 'cache'}",
                 "train.steps=9", "train.batch_size=64", "eval.every=9", "eval.batches=1",
                 "storage.memory_budget_bytes=1048576", "train.log_every=3"]
    summary = run(load_config(QUICKSTART, overrides), progress=False)
    [[day]] = convert([str(tmp_path / "day_0.tsv")], str(tmp_path / "cache"))  # converted already: found
    rows = np.load(f"{day}_sparse.npy")[:9 * 64]  # the 9 batches trained, in the file's order
    trained = {(f, int(v)) for row in rows for f, v in enumerate(row)}
    assert summary["live_ids"] == len(trained)  # each value its own row: no two share one
    assert summary["steps"] == 9


def test_criteo_kaggle_train_txt_split_into_days_shuffled_and_resumed(tmp_path):
    """Kaggle's one train.txt: split into 7 days (the 7th evaluates), shuffled within windows, and a
    resumed run trains the steps after its checkpoint as the uninterrupted run does."""
    from mlkv_torch.data.criteo_convert import cache_entry

    train_txt = tmp_path / "train.txt"
    _write_criteo_tsv(train_txt, 7 * 130, 2)
    common = ["data.kind=criteo", f"data.criteo.train=[{train_txt}]", "data.criteo.days=7",
              f"data.criteo.cache_dir={tmp_path / 'cache'}", "data.criteo.shuffle_window=3", "data.criteo.seed=5",
              "data.criteo.cardinalities=[" + ",".join(["500"] * 26) + "]", "train.batch_size=32", "train.log_every=1",
              "eval.every=1000", "eval.batches=8", "storage.memory_budget_bytes=1048576", "train.checkpoint_every=10"]
    whole = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'whole'}", "train.steps=30", *common]),
                progress=False)
    assert whole["steps"] == 30 and whole["auc"] is not None  # 6 days of 130 rows: 24 batches an epoch
    manifest = json.loads((Path(cache_entry(str(train_txt), str(tmp_path / "cache"), days=7)) / "manifest.json")
                          .read_text())
    assert [part["rows"] for part in manifest["parts"]] == [130] * 7
    run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'split'}", "train.steps=20", *common]), progress=False)
    run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'split'}", "train.steps=30", "data.workers=2", *common]),
        resume=True, progress=False)
    expected, got = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    assert sorted(got) == list(range(1, 31)) and got == expected  # the second epoch's shuffle too
    unshuffled = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'plain'}", "train.steps=5", *common,
                                              "data.criteo.shuffle_window=0"]), progress=False)
    assert unshuffled["steps"] == 5 and _losses(tmp_path / "plain") != {s: expected[s] for s in range(1, 6)}


def test_raw_ids_train_each_in_its_own_row_of_a_2_40_row_table(tmp_path):
    # configs/raw_ids.yaml, shortened: every feature's ids spread over 2**40, new ones entering each
    # batch; the stores end holding exactly the ids trained on, each its own row.
    config = load_config(REPO / "configs" / "raw_ids.yaml",
                         [f"output_dir={tmp_path / 'run'}", "train.steps=6", "train.log_every=3", "eval.every=6",
                          "eval.batches=1", "train.batch_size=256", "data.synthetic.scale=1000"])
    summary = run(config, progress=False)
    generator = SyntheticCTR(cardinalities=cardinalities_of("criteo_kaggle", 1000), id_space=2**40,
                             new_ids_per_batch=50)
    trained = {(f, i) for b in range(6) for f, column in enumerate(generator.batch(b, 256)[1].T.tolist())
               for i in column}
    assert summary["live_ids"] == len(trained)
    assert max(i for _, i in trained) > 2**32  # raw: far beyond any table one would allocate
    assert summary["steps"] == 6 and summary["auc"] is not None
    assert summary["disk_bytes"] < 64 << 20  # 26 tables of 2**40 rows: only the live rows take space


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(tmp_path, name):
    overrides = [f"output_dir={tmp_path}"]
    if name.startswith("criteo"):
        day = tmp_path / "day_0"
        if name.startswith("criteo_kaggle"):
            _write_criteo_tsv(day.with_suffix(".tsv"), 4, 0)
            overrides.append(f"data.criteo.train=[{day.with_suffix('.tsv')}]")
        else:
            for part in ("dense", "sparse", "labels"):
                (tmp_path / f"day_0_{part}.npy").write_bytes(b"")
            overrides.append(f"data.criteo.train=[{day}]")
    config = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    assert config.train.steps > 0


def test_a_full_disk_under_the_log_is_named(tmp_path):
    # metrics.jsonl on a full device (/dev/full refuses every write): the error says which file.
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "storage.kind=memory", "train.steps=2",
                                      "train.log_every=1", "eval.every=1000", *SMALL])
    with pytest.raises(OSError, match=f"writing {tmp_path / 'metrics.jsonl'}: No space left on device"):
        run(config, progress=False)


def test_memory_storage_trains_with_torchrecs_fused_kernels(tmp_path):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "storage.kind=memory", "train.steps=8",
                                      "eval.every=8", *SMALL])
    summary = run(config, progress=False)
    assert summary["storage"] == "memory" and summary["steps"] == 8 and summary["disk_bytes"] == 0
    assert 0.5 < summary["auc"] <= summary["oracle_auc"] + 0.02
    assert summary["hit_rate"] is None  # no disk table
    # Only sharding types TorchRec's in-memory kernels do not take on the CPU: refused by name.
    config = load_config(QUICKSTART, [f"output_dir={tmp_path / 'row_wise'}", "storage.kind=memory", "train.steps=8",
                                      "storage.sharding_types=[row_wise]", *SMALL])
    with pytest.raises(ConfigError, match=r"storage kind memory keeps tables in TorchRec's kernels, which shard them "
                                          r"on the CPU only as"):
        run(config, progress=False)


@pytest.mark.skipif(not __import__("mlkv_torch")._C.with_rocksdb, reason="built without RocksDB")
def test_rocksdb_storage_trains_exactly_as_the_disk_store(tmp_path):
    common = [*SMALL, "train.steps=8", "train.log_every=1", "eval.every=8", "pipeline.depth=2"]
    runs = {}
    for kind in ("disk", "rocksdb"):
        summary = run(load_config(QUICKSTART, [f"output_dir={tmp_path / kind}", f"storage.kind={kind}", *common]),
                      progress=False)
        assert summary["storage"] == kind and summary["disk_bytes"] > 0
        runs[kind] = _losses(tmp_path / kind)
    assert list(runs["rocksdb"]) == list(range(1, 9))
    assert runs["rocksdb"] == runs["disk"]  # the same cache and op over another store: the same training
    assert (tmp_path / "rocksdb" / "tables" / "t_cat_0" / "CURRENT").exists()  # RocksDB's own files


def test_torch_threads_leave_a_core_to_the_lookahead(tmp_path):
    from mlkv_torch.train import torch_threads

    default = torch.get_num_threads()

    def threads(*overrides):
        return torch_threads(load_config(QUICKSTART, [f"output_dir={tmp_path}", *overrides]))

    assert threads("pipeline.depth=1") == max(1, default - 1)
    assert threads("pipeline.depth=auto") == max(1, default - 1)
    assert threads("pipeline.depth=0") == default  # nothing runs beside the step
    assert threads("storage.kind=memory") == default
    assert threads("train.torch_threads=3") == 3
    with pytest.raises(ConfigError, match="torch_threads"):
        threads("train.torch_threads=0")
    summary = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'run'}", "train.steps=2", "pipeline.depth=1",
                                           *SMALL]), progress=False)
    assert summary["torch_threads"] == max(1, default - 1)
    assert torch.get_num_threads() == default  # the run gives the setting back


def _shard_rows(out: Path, row_words: int) -> dict:
    """Every row each rank's disk shards hold, by (shard directory, id)."""
    from mlkv_torch.store import KVStore

    rows = {}
    for shard in sorted((out / "tables").glob("rank*/t_*")):
        with KVStore(shard, row_words, torch.float32, 1 << 20, cut_checkpoints=True) as store:
            for keys, values in store.scan():
                rows.update({(shard.relative_to(out).as_posix(), k): v for k, v in zip(keys.tolist(), values)})
    return rows


def _activity(out: Path) -> dict:
    """The activity of each virtual table's ids at the checkpoint in `out`, by table."""
    from mlkv_torch.train.checkpoint_tables import written_checkpoint

    checkpoint = written_checkpoint(str(out))
    return {table: checkpoint.activity(table) for table in checkpoint.tables if checkpoint.activity(table)}


VIRTUAL = ["data.synthetic.scale=1000", "data.synthetic.id_space=1099511627776", "data.synthetic.new_ids_per_batch=20",
           "storage.sharding_types=[row_wise]", "storage.virtual_tables.enabled=true",
           "storage.virtual_tables.eviction=count_and_timestamp", "storage.virtual_tables.trigger_ids=60",
           "storage.virtual_tables.count_threshold=2", "storage.virtual_tables.ttl_minutes=3",
           "storage.virtual_tables.minute_steps=1", "storage.virtual_tables.total_num_buckets=4"]


def test_virtual_tables_under_torchrun_killed_and_resumed_end_as_the_uninterrupted_run(tmp_path, runner_here):
    # TorchRec's virtual tables of 2**40 ids, placed row-wise by 4 buckets over 2 ranks by the planner
    # (sized by the eviction trigger, not the id space); rank 1 killed after step 10 (its last
    # checkpoint: step 8) and the job restarted: the same losses, and the same live ids, rows and
    # optimizer state on each rank as the run never killed.
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _torchrun(whole, 12, *VIRTUAL)
    done = _torchrun(killed, 12, *VIRTUAL, worker=[str(REPO / "tests" / "workers" / "elastic_worker.py")],
                     launcher=["--max-restarts", "1"], env={"MLKV_TEST_KILLS": "0:1:10"})
    assert "resuming from the last checkpoint" in done.stderr, done.stderr[-4000:]
    assert _losses(killed) == _losses(whole)
    summaries = [json.loads((d / "summary.json").read_text()) for d in (whole, killed)]
    assert summaries[0]["evicted_ids"] == summaries[1]["evicted_ids"] > 0
    assert summaries[0]["live_ids"] == summaries[1]["live_ids"] > 0
    rows = _shard_rows(whole, 16 + 1)  # quickstart: dim 16, row-wise Adagrad's one state word
    assert rows.keys() == _shard_rows(killed, 17).keys() and len(rows) == summaries[0]["live_ids"]
    got = _shard_rows(killed, 17)
    assert all(torch.equal(got[k], v) for k, v in rows.items())
    for rank, first_row in enumerate((0, 2**39)):  # two buckets a rank, each 2**38 ids
        assert (whole / "tables" / f"rank{rank}" / f"t_cat_0_rows{first_row}_cols0").is_dir()
    # Resumed on one process, its tables resharded: every id keeps its lookups counted, the step it
    # was last looked up at and whether it holds a row (ids without rows are the frequency filter's).
    activity = _activity(whole)
    assert len(activity) == 26 and all(bool(a[0].numel()) for a in activity.values())
    assert any(not bool((a[1] == a[1][0]).all()) for a in activity.values())  # not counted alike (as afresh)
    from mlkv_torch.export import export_checkpoint

    export_checkpoint(str(whole), str(tmp_path / "export"))
    assert "its tables were resharded for one process" in _run_here(runner_here, whole, 12, *VIRTUAL, "--resume")
    resharded = _activity(whole)
    assert resharded.keys() == activity.keys()
    for table, columns in activity.items():
        assert all(torch.equal(a, b) for a, b in zip(resharded[table], columns)), table
    # The ids the tables evicted so far go with them: the one process counts on from the two ranks' sum.
    assert sum(int(a.evicted) for a in activity.values()) == summaries[0]["evicted_ids"] > 0
    assert json.loads((whole / "summary.json").read_text())["evicted_ids"] == summaries[0]["evicted_ids"]
    # The export keeps the history too: imported into one process (no step trained, its evaluation
    # changes no id), the tables hold it as the checkpoint did.
    imported = tmp_path / "imported"
    _run_here(runner_here, imported, 12, *VIRTUAL, "--import", str(tmp_path / "export"))
    from_export = _activity(imported)
    assert from_export.keys() == activity.keys()
    for table, columns in activity.items():
        assert all(torch.equal(a, b) for a, b in zip(from_export[table], columns)), table


def test_memory_fraction_auto_plans_each_tables_memory_from_the_input_under_torchrun(tmp_path):
    out = tmp_path / "auto"
    done = _torchrun(out, 6, "storage.memory_fraction=auto", "storage.memory_budget_bytes=4194304", *COMMS)
    said = done.stderr
    assert "[train] the tables' memory, chosen from the input's first batches" in said
    lines = [line for line in said.splitlines() if line.startswith("[train]   t_cat_")]
    assert len(lines) == 26 and any(" disk " in line for line in lines) and any(" memory " in line for line in lines)
    assert "No available compute kernels" not in said  # the choice's constraints fit each sharding type
    record = json.loads((out / "tables" / ".mlkv_calibration.json").read_text())  # measured once, beside the tables
    assert record["all_to_all_bytes_per_s"] > 0  # the ranks measured their all-to-all together
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2


def test_memory_fraction_auto_keeps_virtual_tables_on_disk_and_their_ids_within_the_budget(tmp_path):
    out = tmp_path / "virtual"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "mlkv_torch.train", str(REPO / "configs" / "virtual_tables.yaml"), f"output_dir={out}",
                           "--no-progress", "train.steps=4", "train.batch_size=512", "eval.batches=2",
                           "eval.every=100", "storage.memory_fraction=auto"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("[train]   t_cat_")]
    assert len(lines) == 26 and all(" disk " in line for line in lines)  # no in-memory form of a 2**40-id table
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
