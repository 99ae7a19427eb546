"""python -m mlkv_torch.export: a run's checkpoint, written by one process or by the ranks of a
torchrun job, as one Parquet file per table and a manifest; checked against the rows and optimizer
state the resumed model itself gives, and the checkpoint left as it was."""
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
pq = pytest.importorskip("pyarrow.parquet")

from mlkv_torch.config import ConfigError, load_config  # noqa: E402
from mlkv_torch.export import export_checkpoint  # noqa: E402
from mlkv_torch.store import initial_rows  # noqa: E402
from mlkv_torch.train import run  # noqa: E402
from mlkv_torch.train.experiment import Experiment  # noqa: E402
from test_reshard import list_column, same_tables  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SMALL = ["data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2", "eval.every=100",
         "storage.memory_budget_bytes=1048576", "train.checkpoint_every=4", "pipeline.depth=2"]
WORKER = REPO / "tests" / "workers" / "checkpoint_state_worker.py"


def _files(directory: Path) -> dict:
    """Every file under `directory` with its content's hash and its modification time."""
    return {p.relative_to(directory).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _exported(out: Path, table: str):
    """(ids, weights, state or None) of a table's Parquet file, checked against the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["tables"][table]
    path = out / entry["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"] and path.stat().st_size == entry["bytes"]
    data = pq.read_table(path)
    assert data.num_rows == entry["rows_in_file"]
    ids = torch.tensor(data.column("id").to_numpy())
    weights = list_column(data, "weight").reshape(-1, entry["dim"])
    state = list_column(data, "state").reshape(ids.numel(), -1) if "state" in data.column_names else None
    assert (state.shape[1] if state is not None else 0) == entry["state"]["columns"]
    return ids, weights, state


def _check_against(out: Path, reference: dict) -> None:
    """Every exported table equals `reference` ({table: (weights, state [rows, k])}) bit for bit
    at its ids; a disk table's other rows are the initial rows the manifest describes."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["tables"]) == sorted(reference)
    unwritten = 0  # rows of disk tables that are not in the files
    for table, (weights, state) in reference.items():
        entry = manifest["tables"][table]
        ids, got_weights, got_state = _exported(out, table)
        assert ids.unique().numel() == ids.numel() and bool(((ids >= 0) & (ids < entry["rows"])).all()), table
        assert torch.equal(got_weights, weights[ids]), table
        assert torch.equal(got_state if got_state is not None else torch.zeros(ids.numel(), 0),
                           state.reshape(weights.shape[0], -1)[ids]), table
        if entry["placement"] == "disk":
            assert 0 < ids.numel() <= entry["rows"], table  # the rows it trained
            unwritten += entry["rows"] - ids.numel()
            others = torch.ones(entry["rows"], dtype=torch.bool)
            others[ids] = False
            kind, a, b = entry["initial_rows"]["distribution"]
            assert kind == "uniform"
            expected = initial_rows(others.nonzero().squeeze(1), entry["dim"], seed=entry["initial_rows"]["seed"],
                                    low=a, high=b)
            assert torch.equal(weights[others], expected), table
        else:
            assert ids.numel() == entry["rows"], table  # a table in memory: every row
    assert unwritten > 0  # disk tables give the rows they wrote, not every row


def test_a_one_process_checkpoint_exports_the_rows_and_state_the_resumed_tables_hold(tmp_path):
    out = tmp_path / "run"
    config = load_config(QUICKSTART, [f"output_dir={out}", "train.steps=8", *SMALL])
    run(config, progress=False)
    before = _files(out)
    manifest = export_checkpoint(str(out), str(tmp_path / "export"))
    assert _files(out) == before  # the checkpoint is only read
    assert manifest["step"] == 8 and manifest["written_by"] == {"processes": 1, "one_process": True}
    experiment = Experiment(config, resume=True)
    try:
        reference = {name: bag.snapshot(include_state=True)
                     for name, bag in experiment.collection.embedding_bags.items()}
    finally:
        experiment.collection.close()
    _check_against(tmp_path / "export", reference)
    assert {t["state"]["holds"] for t in manifest["tables"].values()} == {
        "row-wise Adagrad's accumulator: the mean over the row of squared gradients, summed over steps"}


def test_a_torchrun_checkpoint_exports_every_placement_as_the_resumed_model_gives_it(tmp_path, runner_here):
    out = tmp_path / "run"
    common = [f"output_dir={out}", *SMALL]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*cmd, "-m", "mlkv_torch.train", str(QUICKSTART), "train.steps=8", "--no-progress", *common],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    before = _files(out)
    done = subprocess.run([sys.executable, "-m", "mlkv_torch.export", str(out), str(tmp_path / "export")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[export] step 8: 26 tables" in done.stderr
    assert _files(out) == before
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    placements = {(t["placement"], t["sharding"]) for t in manifest["tables"].values()}
    # Tables on disk, sharded in memory, and replicated: each is read its own way (row-wise disk
    # tables, read from each rank's block, in tests/train/test_reshard.py).
    assert {p for p, s in placements} == {"disk", "memory"} and ("memory", "data_parallel") in placements
    assert any(p == "memory" and s != "data_parallel" for p, s in placements)
    state_path = tmp_path / "state.pt"
    done = subprocess.run([*cmd, str(WORKER), str(QUICKSTART), str(state_path), *common],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(f"{state_path}.rank{r}", weights_only=True) for r in range(2)]
    assert [r["step"] for r in ranks] == [8, 8]
    reference = {}
    for table in ranks[0]["tables"]:
        weight = _whole([r["tables"][table]["weight"] for r in ranks])
        held = [r["tables"][table]["state"] for r in ranks]  # a rank without a shard holds no state of it
        states = [_whole([h[k] for h in held if k in h]).reshape(weight.shape[0], -1)
                  for k in sorted(set().union(*held))]
        reference[table] = (weight, torch.cat(states, dim=1) if states else torch.zeros(0))
    _check_against(tmp_path / "export", reference)
    # Resumed on one process, every table on disk, killed while it reshards and resumed again: the
    # checkpoint it reads stays as it was until the new one is committed, and the last attempt
    # carries each row and its optimizer state over (a replicated table's per-element sums as
    # row-wise Adagrad's mean of them).
    resume = [sys.executable, "-m", "mlkv_torch.train", str(QUICKSTART), "train.steps=8", "--no-progress",
              "--resume", *common]
    for delay in (0.0, 0.2):
        _kill_when_resharding(resume, out / "tables" / "one-process-step8", delay)
        if (out / "checkpoint.pt").exists():
            assert delay > 0  # the first kill comes as the tables are made, long before a commit
            break  # the reshard was committed before the kill came
        after = _files(out)
        assert {name: after.get(name) for name in before} == before
    code, err = runner_here(resume[3:])  # the last attempt, in this process
    assert code == 0, err[-4000:]
    export_checkpoint(str(out), str(tmp_path / "one"))
    same_tables(tmp_path / "export", tmp_path / "one")


def _kill_when_resharding(command: list, tables: Path, delay: float) -> None:
    """Runs `command` and kills it (SIGKILL) `delay` seconds after it makes `tables` (anew, where an
    attempt killed before left them)."""
    def made() -> tuple:
        try:
            found = tables.stat()
            return found.st_ino, found.st_ctime_ns
        except FileNotFoundError:
            return ()

    left = made()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 300
    while made() in ((), left) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    process.kill()
    process.wait()


def _whole(parts: list) -> torch.Tensor:
    """A tensor from each rank's part of it: the same replicated tensor, or the shards of a
    ShardedTensor placed at their offsets."""
    if isinstance(parts[0], torch.Tensor):
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    full = torch.full(parts[0]["size"], float("nan"))
    for part in parts:
        for offsets, shard in part["shards"]:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape))] = shard
    assert not bool(full.isnan().any())
    return full


def test_export_and_import_refuse_what_they_cannot_do_by_name(tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint of a run"):
        export_checkpoint(str(tmp_path), str(tmp_path / "export"))
    out = tmp_path / "run"
    run(load_config(QUICKSTART, [f"output_dir={out}", "train.steps=4", *SMALL]), progress=False)
    _check_import_refusals(out, tmp_path)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists: export into a path that does not"):
        export_checkpoint(str(out), str(tmp_path / "taken"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="cannot be written: cannot create"):
        export_checkpoint(str(out), str(tmp_path / "a_file" / "export"))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    del state["tables"]  # as an earlier version wrote it
    torch.save(state, out / "checkpoint.pt")
    with pytest.raises(ConfigError, match="does not record its tables"):
        export_checkpoint(str(out), str(tmp_path / "export"))


def _check_import_refusals(out: Path, tmp_path: Path) -> None:
    """--import of an export whose files are damaged, missing or not an export's, or into a run whose
    tables differ: a ConfigError naming it, before any table is filled."""
    import shutil

    from mlkv_torch.exported_tables import read_export

    export = tmp_path / "export"
    export_checkpoint(str(out), str(export))
    assert read_export(str(export)).step == 4

    def refused(damage, match: str, overrides: tuple = ()) -> None:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(export, copy)
        damage(copy)
        config = load_config(QUICKSTART, [f"output_dir={tmp_path / 'importing'}", "train.steps=6", *SMALL, *overrides])
        with pytest.raises(ConfigError, match=match):
            run(config, progress=False, overwrite=True, imported=str(copy))

    def flip_a_byte(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))

    def edit_manifest(copy: Path, edit) -> None:
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))

    refused(lambda c: flip_a_byte(c / "t_cat_0.parquet"), r"t_cat_0.parquet \(t_cat_0\) is damaged: its size or SHA")
    # The ranks of an import divide the checksums (each file read by one) and all refuse what any found.
    damaged = tmp_path / "damaged"
    shutil.copytree(export, damaged)
    second = list(json.loads((export / "manifest.json").read_text())["tables"].values())[1]["file"]
    flip_a_byte(damaged / second)
    assert read_export(str(damaged), (0, 2)).step == 4  # rank 0's share: every other file
    with pytest.raises(ConfigError, match=f"{second} .* is damaged"):
        read_export(str(damaged), (1, 2))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "workers" / "read_export_worker.py"), str(damaged),
                           str(tmp_path / "found")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    found = [(tmp_path / f"found.rank{r}").read_text() for r in range(2)]
    assert found[0] == found[1] and f"{second} (" in found[0] and "is damaged" in found[0], found
    refused(lambda c: (c / "dense.pt").unlink(), r"lacks dense.pt \(the dense model's file\)")
    refused(lambda c: (c / "manifest.json").unlink(), "is not an export: it holds no manifest.json$")
    refused(lambda c: ((c / "manifest.json").unlink(), Path(f"{c}.partial").mkdir()), "was killed before it finished")
    refused(lambda c: edit_manifest(c, lambda m: m.update(format="other")), "not a manifest this mlkv_torch reads")
    refused(lambda c: None, r"table 't_cat_0': the export at .*'s dim is 16, this run's 8",
            ("model.embedding_dim=8", "model.dense_arch=[64,8]"))
    refused(lambda c: None, r"'s optimizer is 'rowwise_adagrad', this run's 'adagrad'", ("train.optimizer=adagrad",))
    from mlkv_torch.train import main

    with pytest.raises(SystemExit) as exited:  # argparse's usage error, before anything opens
        main([str(QUICKSTART), "--resume", "--import", str(export)])
    assert exited.value.code == 2
