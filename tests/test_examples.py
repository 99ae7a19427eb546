"""The examples a new user starts from (examples/, shown in the README) run and learn: one process,
a sequence model, virtual tables of raw ids, and DistributedModelParallel under torchrun with 2
processes."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _losses(output: str):
    found = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", output)
    assert found, output[-3000:]
    return float(found.group(1)), float(found.group(2))


def test_one_process_example_trains_and_reruns_in_its_folder(tmp_path):
    runs = [subprocess.run([sys.executable, str(EXAMPLES / "one_process.py"), str(tmp_path / "tables")],
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-4000:]
    first, last = _losses(runs[0].stdout)
    assert last < first / 2, runs[0].stdout
    assert runs[1].stdout == runs[0].stdout  # the second run started over from the initial rows


def test_sequence_example_trains_with_its_item_table_on_disk(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "sequence.py"), str(tmp_path / "tables")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    first, last = _losses(done.stdout)
    assert last < first / 2, done.stdout
    assert (tmp_path / "tables" / "item").is_dir()


def test_virtual_tables_example_trains_evicts_and_exports_and_leaves_no_temporary_tables(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "virtual_tables.py")],  # no folder: a temporary one
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-4000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mlkv-example-")]
    first, last = _losses(done.stdout)
    assert last < 0.7 * first, done.stdout  # new items keep arriving: less to learn than one_process's
    found = re.search(r"(\d+) live ids, (\d+) evicted, (\d+) rows exported", done.stdout)
    live, evicted, exported = map(int, found.groups())
    assert evicted > 0 and live == exported and live <= 3000 + 256  # the trigger, and one batch's new ids


def test_dmp_example_puts_the_large_tables_on_disk_the_largest_by_rows_and_trains(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(EXAMPLES / "dmp.py"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tables on disk: ['t0', 't1'] (t0 row_wise, t1 " in done.stdout, done.stdout[-3000:]
    first, last = _losses(done.stdout)
    assert last < first / 2, done.stdout
    assert (tmp_path / "run" / "rank0").is_dir() and (tmp_path / "run" / "rank1").is_dir()


def test_the_getting_started_python_block_runs_as_written(tmp_path):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert blocks, "docs/getting-started.md has no python block"
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, block + done.stderr[-3000:]
        assert "Warning" not in done.stderr, done.stderr[-3000:]


def test_the_parquet_transforms_example_makes_its_features(monkeypatch):
    import pyarrow as pa

    from mlkv_torch.data.transforms import RowGroupTransform

    monkeypatch.syspath_prepend(str(EXAMPLES))  # as docs/data.md runs it: PYTHONPATH=examples
    table = pa.table({"a": [1, 2, 1, 3], "b": [5, 5, 5, 6], "x": [0.5, None, 2.0, -1.0]})
    crossed = RowGroupTransform("parquet_transforms:crossed", args={"columns": ["a", "b"], "into": "ab"}).load()(table)
    ids = crossed.column("ab").to_pylist()
    assert crossed.column_names == ["a", "b", "x", "ab"]
    assert ids[0] == ids[2] and len(set(ids)) == 3 and min(ids) >= 0  # one id a combination
    buckets = RowGroupTransform("parquet_transforms:bucketized",
                                args={"column": "x", "boundaries": [0.0, 1.0], "into": "a"}).load()(table)
    assert buckets.column_names == ["a", "b", "x"] and buckets.column("a").to_pylist() == [1, 0, 2, 0]


def test_the_store_demo_runs_and_removes_its_temporary_store(tmp_path):
    demo = Path(__file__).resolve().parents[1] / "scripts" / "quickstart.py"
    done = subprocess.run([sys.executable, str(demo), "--rows", "200000"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "reopened: 199,990 rows recovered" in done.stdout and done.stdout.endswith("quickstart done\n")
    assert os.listdir(tmp_path) == []


def test_the_run_plot_draws_each_metric_on_its_whole_scale_with_the_ceiling(tmp_path, monkeypatch):
    import json

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from plot_run import figure

    records = [{"step": s, "loss": 0.4 - s / 1e4, "samples_per_s": 5e4, "hit_rate": 0.6} for s in (10, 20, 30)]
    records += [{"step": 30, "eval_auc": 0.881, "eval_oracle_auc": 0.915}, {"step": 20, "eval_auc": 0.879}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loss, auc, rate, hits = figure([str(tmp_path)]).axes
    assert auc.get_ylim() == (0.5, 1.0) and hits.get_ylim() == (0.0, 1.0) and rate.get_ylim()[0] == 0
    drawn, ceiling = auc.get_lines()
    assert list(drawn.get_ydata()) == [0.879, 0.881]  # as logged, in step order
    assert ceiling.get_linestyle() == "--" and list(ceiling.get_ydata()) == [0.915]
    assert ceiling.get_color() == drawn.get_color() and len(hits.get_lines()) == 1
