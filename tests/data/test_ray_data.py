"""Data prepared on Ray (`data.engine: ray`, mlkv_torch.data.ray_batches; `criteo convert --ray`),
on a local Ray of two CPUs: Criteo days converted by Ray tasks are the files the in-process
conversion writes, batches made by Ray actors are the in-process batches (a killed actor loses and
repeats none), the runner trains on Ray with the in-process loader's losses, and an address where
no Ray head answers is refused by name."""
import json
import os
import signal
import socket
import time
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from mlkv_torch.config import ConfigError, load_config
from mlkv_torch.data.loader import BatchLoader
from mlkv_torch.data.parquet import ParquetBatches, SparseFeature, parquet_batch
from mlkv_torch.data.parquet_generate import DEFAULT_CARDINALITIES, generate
from mlkv_torch.train.sources import ParquetSource
from mlkv_torch.data.transforms import RowGroupTransform
from mlkv_torch.train import run

ray = pytest.importorskip("ray")
from mlkv_torch.data.ray_batches import RayBatches, connect_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "parquet_example.yaml"
DENSE = [f"dense_{d}" for d in range(6)]
FEATURES = [SparseFeature(f"c_{f}", f"c_{f}", 500) for f in range(len(DEFAULT_CARDINALITIES))]


@pytest.fixture(scope="module")
def ray_workers_path():
    # Ray's workers import a user's transform as the trainer does: tests/helpers/ on their PYTHONPATH.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests" / "helpers"), before]))
    try:
        yield
    finally:
        ray.shutdown()
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture
def local_ray(ray_workers_path):
    """The module's local Ray of two CPUs, started by the first test that asks for it (and again after
    a test that ended it)."""
    if not ray.is_initialized():
        assert connect_ray("", 2)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("parquet")
    generate(str(out / "train"), 6000, files=2, row_group_rows=1000, unused_columns=4)
    generate(str(out / "eval"), 1000, unused_columns=4, held_out=True)
    return out


def test_an_address_where_no_ray_head_answers_is_refused_by_name(dataset, tmp_path):
    with socket.socket() as s:  # a port of this machine's loopback that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = load_config(EXAMPLE, [f"output_dir={tmp_path}", f"data.parquet.train=[{dataset / 'train'}]",
                                   "data.parquet.eval=[]", "data.engine=ray", f"data.ray.address=127.0.0.1:{port}"])
    with pytest.raises(ConfigError, match=f"data.ray.address: no Ray head answers at '127.0.0.1:{port}'"):
        run(config, progress=False)
    with pytest.raises(ConfigError, match="data.engine ray prepares Parquet datasets"):
        load_config(EXAMPLE, ["data.kind=synthetic", "data.engine=ray"])


def test_criteo_days_converted_on_ray_are_the_in_process_files(local_ray, tmp_path):
    from mlkv_torch.data.criteo_generate import generate as generate_criteo
    from mlkv_torch.data.criteo_parquet import convert_to_parquet, convert_to_parquet_on_ray
    from mlkv_torch.data.criteo_tsv import CriteoFormatError

    inputs = [str(tmp_path / f"part_{k}.tsv") for k in range(2)]
    for k, path in enumerate(inputs):
        generate_criteo(path, 1200, seed=k)
    on_ray = convert_to_parquet_on_ray(inputs, str(tmp_path / "ray"), days=2)
    here = [convert_to_parquet(path, str(tmp_path / "here"), days=2) for path in inputs]
    assert [d.rows for d in on_ray] == [d.rows for d in here] == [1200, 1200]
    assert all(d.pid != os.getpid() for d in on_ray)
    for a, b in zip(on_ray, here):
        assert [os.path.basename(f) for f in a.files] == [os.path.basename(f) for f in b.files]
        for fa, fb in zip(a.files, b.files):
            assert pq.read_table(fa).equals(pq.read_table(fb))
    # A bad line fails the task as it fails here: the file and line named, nothing written.
    with open(inputs[1], "r+") as f:
        lines = f.readlines()
        lines[6] = "1\tnot-a-number" + lines[6][lines[6].index("\t", 2):]
        f.seek(0)
        f.writelines(lines)
    with pytest.raises(CriteoFormatError, match="part_1.tsv.* line 7"):
        convert_to_parquet_on_ray([inputs[1]], str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "parquet").exists()


def test_batches_made_by_ray_actors_are_the_in_process_batches_and_a_killed_actor_loses_none(local_ray, dataset):
    make = partial(ParquetBatches, [str(dataset / "train")], 200, "label", DENSE, FEATURES, shuffle_window=3, seed=5,
                   world=2)
    here = make()
    batches = RayBatches(make, partial(parquet_batch, here.feature_names), 2, stride=2)
    pids = batches.worker_pids()
    # Rank 1 of 2 (rows 3000-5999): batches 1, 3, 5, ... past the end of the first epoch, two requests in flight.
    loader = BatchLoader(batches, first=1, count=20, stride=2, tuner=None)
    delivered = []
    try:
        for k, batch in enumerate(loader):
            if k == 4:
                os.kill(pids[0], signal.SIGKILL)  # its calls in flight are run again by its next process
            delivered.append(batch)
        restarted = batches.worker_pids()
    finally:
        batches.close()  # the actors' CPUs go back to the other tests
    assert len(delivered) == 20
    assert restarted[0] != pids[0] and restarted[1] == pids[1]
    for k, batch in enumerate(delivered):
        expected = here(1 + 2 * k)
        assert torch.equal(batch.labels, expected.labels)
        assert torch.equal(batch.dense_features, expected.dense_features)
        assert torch.equal(batch.sparse_features.values(), expected.sparse_features.values())
        assert torch.equal(batch.sparse_features.lengths(), expected.sparse_features.lengths())


def test_a_batch_that_does_not_come_is_asked_for_again_of_the_next_actor_and_its_actor_restarted(local_ray, dataset,
                                                                                                   tmp_path):
    from stalling_batch_maker import StallsOnce

    make = partial(ParquetBatches, [str(dataset / "train")], 200, "label", DENSE, FEATURES, shuffle_window=3, seed=5)
    here = make()
    stalls = partial(StallsOnce, str(tmp_path / "stalled"), 5, 30.0, make)  # batch 5's first maker sleeps 30 s
    # A timeout well above a batch's time on a busy machine (the suite runs beside other work): only batch 5 passes it.
    batches = RayBatches(stalls, partial(parquet_batch, here.feature_names), 2, batch_timeout_s=6.0)
    try:
        pids = batches.worker_pids()
        delivered = list(BatchLoader(batches, count=16, tuner=None))
        # Batches 7, 9, ... go to the restarted actor, not to the one asleep: none waits a timeout.
        assert batches.asked_again == 1 and batches.restarts == 1
        assert batches.worker_pids()[1] != pids[1]
    finally:
        batches.close()
    for number, batch in enumerate(delivered):
        assert torch.equal(batch.sparse_features.values(), here(number).sparse_features.values())
        assert torch.equal(batch.labels, here(number).labels)
    assert (tmp_path / "stalled").exists()


def overlapping(spans):
    """Whether two of the (pid, began, ended) spans of different processes overlap."""
    return any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in spans for b in spans)


def test_unshuffled_batches_keep_every_actor_working_and_each_row_group_is_decoded_once(local_ray, dataset, tmp_path):
    # A row group takes 0.5 s to decode (the transform sleeps, and logs who decoded it when).
    log = tmp_path / "decoded"
    slow = RowGroupTransform("row_group_transforms:slow_and_logged", (), {"seconds": 0.5, "log": str(log)})
    make = partial(ParquetBatches, [str(dataset / "train")], 200, "label", DENSE, FEATURES, transform=slow)
    here = ParquetBatches([str(dataset / "train")], 200, "label", DENSE, FEATURES)
    batches = RayBatches(make, partial(parquet_batch, here.feature_names), 2, chunk=1000 // 200)
    try:
        delivered = list(BatchLoader(batches, count=here.batches_per_epoch, tuner=None))
    finally:
        batches.close()
    spans = [(int(pid), float(began), float(ended))
             for pid, began, ended in map(str.split, log.read_text().splitlines())]
    assert len(spans) == here.row_groups == 6
    assert len({pid for pid, _, _ in spans}) == 2 and overlapping(spans)
    for number, batch in enumerate(delivered):
        expected = here(number)
        assert torch.equal(batch.labels, expected.labels)
        assert torch.equal(batch.dense_features, expected.dense_features)
        assert torch.equal(batch.sparse_features.values(), expected.sparse_features.values())


def free_cpus_within(seconds: float) -> float:
    """The local Ray's free CPUs once it has all of them back, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def test_a_batch_maker_that_fails_to_start_ends_the_others_and_is_named(local_ray, dataset, tmp_path, monkeypatch):
    from failing_batch_maker import FailsToStartOnce

    make = partial(ParquetBatches, [str(dataset / "train")], 200, "label", DENSE, FEATURES)
    fails = partial(FailsToStartOnce, str(tmp_path / "failed"), make)
    with pytest.raises(RuntimeError, match="(?s)a Ray batch maker failed to start.*no such file on this node"):
        RayBatches(fails, partial(parquet_batch, make().feature_names), 2)
    assert free_cpus_within(30) == 2  # the maker that started is ended too
    # Through the runner's source: a transform's module this process imports but Ray's workers cannot.
    (tmp_path / "driver_only_transform.py").write_text("def unchanged(table):\n    return table\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    transform = json.dumps({"function": "driver_only_transform:unchanged"})
    config = load_config(EXAMPLE, [f"output_dir={tmp_path / 'out'}", f"data.parquet.train=[{dataset / 'train'}]",
                                   "data.parquet.eval=[]", "data.engine=ray", "data.ray.actors=2",
                                   f"data.parquet.transform={transform}"])
    with pytest.raises(ConfigError, match="(?s)data.ray: a Ray batch maker failed to start.*driver_only_transform"):
        ParquetSource(config)
    assert free_cpus_within(30) == 2


def test_the_runner_trains_on_ray_with_the_in_process_loaders_losses(local_ray, dataset, tmp_path):
    # With a user's transform (tests/helpers/row_group_transforms.py) that Ray's workers import for themselves.
    sparse = json.dumps([*({"column": f.column, "rows": f.rows} for f in FEATURES), {"column": "bucket", "rows": 4}])
    transform = json.dumps({"function": "row_group_transforms:price_buckets", "reads": ["dense_0"],
                            "args": {"boundaries": [-0.5, 0.0, 0.5]}})
    losses = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        summary = run(load_config(EXAMPLE, [f"output_dir={out}", f"data.parquet.train=[{dataset / 'train'}]",
                                            f"data.parquet.eval=[{dataset / 'eval'}]", f"data.engine={engine}",
                                            "data.ray.actors=2", "train.batch_size=256", "train.steps=12",
                                            "train.log_every=3", "eval.every=12", "eval.batches=2",
                                            "data.parquet.shuffle_window=4", f"data.parquet.sparse={sparse}",
                                            f"data.parquet.transform={transform}"]),
                      progress=False)
        assert summary["steps"] == 12
        losses[engine] = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                          if "loss" in r]
    assert len(losses["ray"]) == 4 and losses["ray"] == losses["local"]
    # More actors than the cluster has CPUs for: refused by name, not waited on forever.
    config = load_config(EXAMPLE, [f"output_dir={tmp_path / 'crowded'}", f"data.parquet.train=[{dataset / 'train'}]",
                                   "data.parquet.eval=[]", "data.engine=ray", "data.ray.actors=3",
                                   "data.ray.start_timeout_s=5"])
    with pytest.raises(ConfigError, match="Ray started [0-2] of 3 batch makers"):  # CPUs freed late: fewer start
        ParquetSource(config)


def test_the_runner_asks_for_more_actors_when_ray_makes_batches_too_slowly(local_ray, dataset, tmp_path, capsys):
    # One actor, and each row group takes 0.3 s to decode: training waits for its batches. Steps past
    # the first epoch: the actor decodes ahead while the model is built, and in a run of 16 steps the
    # windows the loader judges could all come from what it decoded then.
    slow = json.dumps({"function": "row_group_transforms:slow_and_logged",
                       "args": {"seconds": 0.3, "log": str(tmp_path / "decoded")}})
    summary = run(load_config(EXAMPLE, [f"output_dir={tmp_path / 'out'}", f"data.parquet.train=[{dataset / 'train'}]",
                                        f"data.parquet.eval=[{dataset / 'eval'}]", "data.engine=ray",
                                        "data.ray.actors=1", "train.batch_size=256", "train.steps=48",
                                        "train.log_every=16", "eval.every=48", "eval.batches=1",
                                        f"data.parquet.transform={slow}"]), progress=False)
    assert summary["input"]["workers_needed"] > summary["input"]["cpu_budget"] == 1, summary["input"]
    out = capsys.readouterr().err  # diagnostics go to stderr: stdout is the summary alone
    assert "the input needs" in out and "ask for more actors (data.ray.actors)" in out
    assert "give it more cores" not in out


# Last in the module: it ends the module's local Ray, which no test after it then has to start again.
@pytest.fixture
def own_local_ray():
    """No Ray connected when the test starts, none after it (`local_ray` starts the module's again)."""
    ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()


def test_auto_actors_of_a_local_ray_are_its_cpus_whatever_the_ranks(own_local_ray, dataset, tmp_path):
    # Each rank starts a local Ray of its share of the cores (cpu_budget): all of them are its actors.
    config = load_config(EXAMPLE, [f"output_dir={tmp_path}", f"data.parquet.train=[{dataset / 'train'}]",
                                   "data.parquet.eval=[]", "data.engine=ray", "data.ray.actors=auto"])
    source = ParquetSource(config, cpu_budget=2, world=2)
    try:
        assert ray.cluster_resources()["CPU"] == 2 and source.remote_workers == 2
    finally:
        source.close()
    assert not ray.is_initialized()
