"""The runner's data (mlkv_torch.train.sources): `batch_source` makes the source data.kind names,
each with the tables, dense features and batch size its config gives, and what a BatchSource is
when a source leaves it be (no row order, batches made in this process, nothing to close)."""
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrec")  # the batches are TorchRec's
from mlkv_torch.config import load_config  # noqa: E402
from mlkv_torch.data.criteo_generate import generate as generate_criteo  # noqa: E402
from mlkv_torch.data.parquet_generate import generate as generate_parquet  # noqa: E402
from mlkv_torch.data.row_order import ShuffledRows  # noqa: E402
from mlkv_torch.train.sources import (BatchSource, CriteoSource, ParquetSource, SyntheticSource,  # noqa: E402
                                      batch_source)

REPO = Path(__file__).resolve().parents[2]


def test_a_synthetic_config_makes_a_synthetic_source_a_table_per_feature(tmp_path):
    config = load_config(REPO / "configs" / "quickstart.yaml", [f"output_dir={tmp_path}", "train.batch_size=32"])
    source = batch_source(config)
    assert type(source) is SyntheticSource
    generator = source.generator
    assert source.tables == [(name, rows, [name]) for name, rows in zip(generator.feature_names,
                                                                         generator.table_sizes)]
    assert (source.num_dense, source.batch_size) == (config.data.synthetic.num_dense, 32)
    assert source.row_order is None and source.remote_workers is None
    assert source.make_batch(3).labels.shape == (32,)


def test_a_criteo_config_makes_a_criteo_source_of_its_cardinalities(tmp_path):
    train = tmp_path / "day_0.tsv"
    generate_criteo(str(train), 300)
    cardinalities = [100 + k for k in range(26)]
    config = load_config(REPO / "configs" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'out'}", "data.kind=criteo", f"data.criteo.train=[{train}]", "train.batch_size=64",
        "data.criteo.cardinalities=[" + ",".join(map(str, cardinalities)) + "]"])
    source = batch_source(config)
    assert type(source) is CriteoSource
    assert [rows for _, rows, _ in source.tables] == cardinalities
    assert all(features == [name] for name, _, features in source.tables)
    assert (source.num_dense, source.batch_size) == (13, 64)
    assert source.row_order is None and source.remote_workers is None
    assert source.make_batch(0).sparse_features.keys() == [name for name, _, _ in source.tables]


def test_a_parquet_config_makes_a_parquet_source_whose_ranks_share_the_rows(tmp_path):
    generate_parquet(str(tmp_path / "train"), 4000, row_group_rows=1000)
    config = load_config(REPO / "configs" / "parquet_example.yaml", [
        f"output_dir={tmp_path / 'out'}", f"data.parquet.train=[{tmp_path / 'train'}]", "data.parquet.eval=[]",
        "train.batch_size=100"])
    for world in (1, 2):
        source = batch_source(config, world=world)
        assert type(source) is ParquetSource
        assert isinstance(source.row_order, ShuffledRows)
        assert (source.row_order.rows, source.row_order.world, source.row_order.batches_per_rank) == (
            4000, world, 40 // world)
        assert [column for column, _, _ in source.tables] == [f.column for f in config.data.parquet.sparse]
        assert (source.num_dense, source.batch_size) == (len(config.data.parquet.dense), 100)
        assert source.remote_workers is None  # data.engine local: made in this process
        source.close()


class _Numbers(BatchSource):
    tables = [("t", 10, ["f"])]
    num_dense = 1
    batch_size = 4

    def make_batch(self, number: int) -> Any:
        return number

    def eval(self, batches, rank, world, at_batch=0):
        return iter(())

    def live_ids(self, batches):
        return None


def test_a_batch_source_without_a_row_order_or_remote_workers_has_nothing_to_close():
    source = _Numbers()
    assert source.row_order is None and source.remote_workers is None
    assert source.close() is None and source.make_batch(5) == 5
    with pytest.raises(TypeError, match="abstract"):
        BatchSource()
