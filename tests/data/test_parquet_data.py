"""Parquet datasets with a declared schema (mlkv_torch.data.parquet): batches against a plain
reading of the files (pyarrow's whole table, a Python FNV-1a, Python modulo), only the declared
columns read, bad files refused by file and column, and the runner training on one, with two
features sharing a table."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlkv_torch.config import ConfigError, load_config
from mlkv_torch.data.parquet import ParquetBatches, ParquetFormatError, SparseFeature, hash_strings
from mlkv_torch.data.parquet_generate import DEFAULT_CARDINALITIES, generate, sparse_kind
from mlkv_torch.train import run

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "parquet_example.yaml"
DENSE = [f"dense_{d}" for d in range(6)]


def features(rows_scale: int = 1):
    return [SparseFeature(f"c_{f}", f"c_{f}", max(2, (n if sparse_kind(f) != "string" else 2 * n) // rows_scale))
            for f, n in enumerate(DEFAULT_CARDINALITIES)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("parquet")
    generate(str(out / "train"), 6000, files=2, row_group_rows=1500, unused_columns=6)
    generate(str(out / "eval"), 2000, row_group_rows=1000, unused_columns=6, held_out=True)
    return out


def fnv1a(text: str) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % (1 << 64)
    return h >> 1


def test_string_hashes_are_fnv1a_of_their_bytes():
    strings = ["", "a", "00002941", "session-11b77a2f44f4", "é"]
    array = pa.array(strings).slice(1)  # an offset into the buffers too
    assert hash_strings(array).tolist() == [fnv1a(s) for s in strings[1:]]
    assert hash_strings(pa.array(strings, type=pa.large_string())).tolist() == [fnv1a(s) for s in strings]


def assert_batch_holds(batch, rows, whole, feats, dense=DENSE):
    """`batch` holds `rows` of `whole` (the files read plainly, column -> values) as the schema declares."""
    assert batch.labels.tolist() == [float(whole["label"][r] > 0) for r in rows]
    values = [[0.0 if whole[d][r] is None else whole[d][r] for d in dense] for r in rows]
    np.testing.assert_array_equal(batch.dense_features.numpy(), np.asarray(values, dtype=np.float32))
    kjt = batch.sparse_features.to_dict()
    for f in feats:
        cells = [whole[f.column][r] for r in rows]
        lists = [c if isinstance(c, list) else [c] for c in cells]
        ids = [[(fnv1a(v) if isinstance(v, str) else v) % f.rows for v in cell] for cell in lists]
        assert kjt[f.column].lengths().tolist() == [len(cell) for cell in ids]
        assert kjt[f.column].values().tolist() == [v for cell in ids for v in cell]


@pytest.mark.parametrize("shuffle_window", [0, 3])
def test_batches_hold_the_files_rows_as_declared(dataset, shuffle_window):
    feats = features(rows_scale=7)
    batches = ParquetBatches([str(dataset / "train")], 512, "label", DENSE, feats, shuffle_window=shuffle_window,
                             seed=5)
    whole = pq.read_table(sorted((dataset / "train").glob("*.parquet"))).to_pydict()  # every column, plainly
    assert batches.rows == 6000 and batches.batches_per_epoch == 11
    seen = []
    for number in [0, 4, 10, 11, 17]:
        rows = batches.row_indices(number)
        seen.append(rows)
        assert_batch_holds(batches(number), rows, whole, feats)
    if shuffle_window:
        assert not np.array_equal(seen[0], np.arange(512))
    else:
        assert np.array_equal(seen[1], np.arange(4 * 512, 5 * 512))


@pytest.mark.parametrize("shuffle_window", [0, 3])
def test_each_rank_reads_its_own_share_of_the_rows_and_row_groups(dataset, shuffle_window):
    # 6000 rows in 4 row groups of 1500. Two ranks: rows 0-2999 and 3000-5999, two row groups each.
    # Three ranks: 2000 rows each, rank 1's share straddling row groups 1 and 2.
    feats = features(rows_scale=7)
    whole = pq.read_table(sorted((dataset / "train").glob("*.parquet"))).to_pydict()
    for world, groups_per_rank in ((2, [2, 2]), (3, [2, 2, 2])):
        share = 6000 // world
        epoch = []
        for rank in range(world):
            batches = ParquetBatches([str(dataset / "train")], 512, "label", DENSE, feats,
                                     shuffle_window=shuffle_window, seed=5, world=world)
            assert batches.batches_per_epoch == world * (share // 512)
            numbers = [rank + world * k for k in range(share // 512)]  # this rank's batches of epoch 0
            rows = [batches.row_indices(n) for n in numbers]
            for n, r in zip(numbers[:2], rows):
                assert_batch_holds(batches(n), r, whole, feats)
            for n in numbers[2:]:
                batches(n)
            assert batches.row_groups_read == groups_per_rank[rank]  # its own row groups alone
            mine = np.concatenate(rows)
            assert mine.min() >= rank * share and mine.max() < (rank + 1) * share
            epoch.append(mine)
            if not shuffle_window:
                assert np.array_equal(mine, np.arange(rank * share, rank * share + len(mine)))
            # The next epoch: the same share, shuffled anew with a window.
            again = np.concatenate([batches.row_indices(n + batches.batches_per_epoch) for n in numbers])
            assert np.array_equal(np.sort(again), np.sort(mine))
            assert np.array_equal(again, mine) == (not shuffle_window)
        rows = np.concatenate(epoch)
        assert len(np.unique(rows)) == len(rows) == world * (share // 512) * 512  # no row twice in an epoch
    with pytest.raises(ValueError, match="hold 6000 rows, fewer than one batch \\(512\\) for each of 12 ranks"):
        ParquetBatches([str(dataset / "train")], 512, "label", DENSE, feats, world=12)


def test_the_ranks_shares_are_torchrecs_and_each_rank_shuffles_its_own():
    from torchrec.datasets.criteo import BinaryCriteoUtils

    from mlkv_torch.data.row_order import ShuffledRows

    for rows, world in ((6000, 2), (10, 3), (1001, 4), (7, 7)):
        order = ShuffledRows(rows, 1, world=world)
        for rank in range(world):
            ranges, _ = BinaryCriteoUtils.get_file_row_ranges_and_remainder([rows], rank, world)
            assert (order.first_row(rank), order.first_row(rank + 1) - 1) == ranges[0]
    order = ShuffledRows(6000, 100, shuffle_window=5, seed=1, world=2)
    rank_0, rank_1 = order(0), order(1)  # each rank's first batch, from its own permutation
    assert rank_0.max() < 3000 <= rank_1.min() and not np.array_equal(rank_0 + 3000, rank_1)


def test_only_the_declared_columns_are_read(dataset):
    batches = ParquetBatches([str(dataset / "train")], 512, "label", DENSE[:2], features()[:3])
    declared = {"label", "dense_0", "dense_1", "c_0", "c_1", "c_2"}
    read = every = 0
    for path in sorted((dataset / "train").glob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                chunk = meta.row_group(g).column(c)
                every += chunk.total_compressed_size
                read += chunk.total_compressed_size if chunk.path_in_schema.split(".")[0] in declared else 0
    assert (batches.bytes_read_per_epoch, batches.bytes_per_epoch) == (read, every)
    assert read < every / 3
    import pyarrow.compute  # noqa: F401  (imported now: their files are not counted below)
    import torchrec.datasets.utils  # noqa: F401
    import torchrec.sparse.jagged_tensor  # noqa: F401

    before = bytes_read_by_this_process()
    for number in range(batches.batches_per_epoch):  # each row group decoded once, though several batches read it
        batches(number)
    assert batches.row_groups_read == 4
    # What left the files (page cache or disk): the declared columns' chunks, and little besides.
    assert read <= bytes_read_by_this_process() - before < read + every / 10


def bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def write(path: Path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.mark.parametrize("column,problem", [
    (pa.array([[1, 2], None, [3], [4]]), "1 null rows"),
    (pa.array([[1, None], [2], [3], [4]]), "1 null ids"),
    (pa.array([[1], [-2], [3], [4]]), "a negative id"),
    (pa.array([5, 6, None, 7]), "1 null rows"),
])
def test_bad_ids_are_refused_with_the_file_and_column(tmp_path, column, problem):
    path = write(tmp_path / "bad.parquet", {"label": [0, 1, 0, 1], "ids": column})
    batches = ParquetBatches([path], 2, "label", [], [SparseFeature("ids", "t", 10)])
    with pytest.raises(ParquetFormatError, match=f"bad.parquet.*column 'ids' has {problem}"):
        batches(0)


def test_large_integer_dense_values_read_as_floats(tmp_path):
    path = write(tmp_path / "f.parquet", {"label": [0, 1], "cents": pa.array([16_777_217, 3], type=pa.int64()),
                                          "ids": [1, 2]})
    batch = ParquetBatches([path], 2, "label", ["cents"], [SparseFeature("ids", "t", 10)])(0)
    assert batch.dense_features[:, 0].tolist() == [16_777_216.0, 3.0]  # float32's nearest, as numpy rounds


def test_a_count_label_past_2_24_is_a_click(tmp_path):
    # Clicks counted per impression: 2**24 + 1 has no float32 of its own, which a safe cast refuses.
    path = write(tmp_path / "f.parquet", {"label": pa.array([2**24 + 1, 0, 2**40], type=pa.int64()), "ids": [1, 2, 3]})
    batch = ParquetBatches([path], 3, "label", [], [SparseFeature("ids", "t", 10)])(0)
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]


def test_nan_dense_values_read_as_missing_and_an_infinity_is_refused(tmp_path):
    path = write(tmp_path / "f.parquet", {"label": [0, 1, 1], "x": pa.array([1.5, float("nan"), None]),
                                          "ids": [1, 2, 3]})
    batch = ParquetBatches([path], 3, "label", ["x"], [SparseFeature("ids", "t", 10)])(0)
    assert batch.dense_features[:, 0].tolist() == [1.5, 0.0, 0.0]  # pandas writes a missing float as NaN
    path = write(tmp_path / "inf.parquet", {"label": [0, 1], "x": [1.5, -float("inf")], "ids": [1, 2]})
    with pytest.raises(ParquetFormatError, match="inf.parquet', row group 0: column 'x' .* 1 infinite values"):
        ParquetBatches([path], 2, "label", ["x"], [SparseFeature("ids", "t", 10)])(0)


def test_uint64_ids_of_2_63_and_up_keep_their_unsigned_remainder(tmp_path):
    big = [2**64 - 1, 2**63, 5]
    path = write(tmp_path / "f.parquet", {"label": [0, 1, 1], "ids": pa.array(big, type=pa.uint64())})
    batch = ParquetBatches([path], 3, "label", [], [SparseFeature("ids", "t", 1000)])(0)
    assert batch.sparse_features.values().tolist() == [v % 1000 for v in big]


def test_a_schema_the_files_do_not_hold_is_refused_with_the_file_and_column(tmp_path):
    path = write(tmp_path / "f.parquet", {"label": [0, 1], "x": ["a", "b"], "ids": pa.array([1.5, 2.5])})
    with pytest.raises(ParquetFormatError, match="f.parquet' has no column 'clicks'"):
        ParquetBatches([path], 1, "clicks", [], [SparseFeature("ids", "t", 10)])
    with pytest.raises(ParquetFormatError, match="column 'x' \\(a dense feature\\) has type string"):
        ParquetBatches([path], 1, "label", ["x"], [SparseFeature("x", "t", 10)])
    with pytest.raises(ParquetFormatError, match="column 'ids' \\(a sparse feature\\) has type double"):
        ParquetBatches([path], 1, "label", [], [SparseFeature("ids", "t", 10)])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ParquetFormatError, match="junk.parquet' cannot be read"):
        ParquetBatches([str(tmp_path / "junk.parquet")], 1, "label", [], [SparseFeature("ids", "t", 10)])
    with pytest.raises(ValueError, match="no Parquet file"):
        ParquetBatches([str(tmp_path / "missing")], 1, "label", [], [SparseFeature("ids", "t", 10)])
    with pytest.raises(ValueError, match="'ids' is the label and is declared as a feature too"):
        ParquetBatches([path], 1, "ids", [], [SparseFeature("ids", "t", 10)])


def test_the_runner_trains_on_parquet_files_with_two_features_sharing_a_table(dataset, tmp_path):
    out = tmp_path / "run"
    sparse = [{"column": f.column, "rows": f.rows} for f in features()]
    for f in (0, 3):  # int ids both: one table
        sparse[f].update(table="shared", rows=1460)
    overrides = [f"output_dir={out}", f"data.parquet.train=[{dataset / 'train'}]",
                 f"data.parquet.eval=[{dataset / 'eval'}]", "train.batch_size=256", "train.steps=20",
                 "train.log_every=5", "eval.every=20", "eval.batches=4", "data.parquet.shuffle_window=4",
                 f"data.parquet.sparse={json.dumps(sparse)}"]
    twice = json.dumps([{"column": "c_0", "rows": 10}, {"column": "c_0", "table": "other", "rows": 10}])
    with pytest.raises(ConfigError, match="column 'c_0' is declared twice"):
        load_config(EXAMPLE, [*overrides[:2], f"data.parquet.sparse={twice}"])
    with pytest.raises(ConfigError, match="data.parquet: .*has no column 'nope'"):
        run(load_config(EXAMPLE, [*overrides[:2], "data.parquet.label=nope"]), progress=False)
    summary = run(load_config(EXAMPLE, overrides), progress=False)
    assert summary["steps"] == 20 and summary["samples_per_s"] > 0
    assert summary["auc"] > 0.55  # held-out rows of the planted model: it learns from 20 batches
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))
    tables = sorted(p.name for p in (out / "tables").iterdir() if p.is_dir())
    assert "t_shared" in tables and "t_c_0" not in tables and "t_c_3" not in tables and len(tables) == 12


def test_under_torchrun_each_rank_reads_its_own_share(dataset, tmp_path):
    sparse = json.dumps([{"column": f.column, "rows": f.rows} for f in features(rows_scale=7)])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "mlkv_torch.train", str(EXAMPLE), f"output_dir={tmp_path / 'run'}", "--no-progress",
                           f"data.parquet.train=[{dataset / 'train'}]", f"data.parquet.eval=[{dataset / 'eval'}]",
                           f"data.parquet.sparse={sparse}", "train.batch_size=256", "train.steps=4", "eval.every=4",
                           "eval.batches=2"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    for share in ("rank 0 of 2 reads rows 0-2,999 of 6,000", "rank 1 of 2 reads rows 3,000-5,999 of 6,000"):
        assert f"[data] {share} (11 batches an epoch)" in done.stderr, done.stderr[-3000:]  # diagnostics: stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["auc"] is not None


@pytest.mark.parametrize("shuffle_window", [0, 2])
def test_criteo_days_as_parquet_make_criteos_batches(tmp_path, shuffle_window):
    # A converted Criteo day written as Parquet and read through its schema: the batches of the npy
    # path (CriteoBatches), bit for bit.
    from mlkv_torch.data.criteo_convert import convert
    from mlkv_torch.data.criteo_generate import generate as generate_criteo
    from mlkv_torch.data.criteo_batches import CriteoBatches
    from mlkv_torch.data.criteo_parquet import day_to_parquet, parquet_schema

    generate_criteo(str(tmp_path / "train.txt"), 3000)
    days = convert([str(tmp_path / "train.txt")], str(tmp_path / "cache"), days=2)[0]
    files = [str(tmp_path / "parquet" / f"day_{d}.parquet") for d in range(2)]
    assert [day_to_parquet(prefix, path, row_group_rows=700) for prefix, path in zip(days, files)] == [1500, 1500]
    cardinalities = [max(2, n // 1000) for n in DEFAULT_CARDINALITIES * 2][:26]
    schema = parquet_schema(cardinalities)
    ours = ParquetBatches(files, 256, schema["label"], schema["dense"],
                          [SparseFeature(s["column"], s["column"], s["rows"]) for s in schema["sparse"]],
                          shuffle_window=shuffle_window, seed=3)
    theirs = CriteoBatches(days, 256, cardinalities, shuffle_window=shuffle_window, seed=3)
    assert ours.batches_per_epoch == theirs.batches_per_epoch == 11
    for number in (0, 5, 12):
        a, b = ours(number), theirs(number)
        assert a.labels.tolist() == b.labels.tolist()
        assert np.array_equal(a.dense_features.numpy(), b.dense_features.numpy())
        kjt_a, kjt_b = a.sparse_features.to_dict(), b.sparse_features.to_dict()
        for i in range(26):
            assert kjt_a[f"cat_{i}"].values().tolist() == kjt_b[f"cat_{i}"].values().tolist()
            assert kjt_a[f"cat_{i}"].lengths().tolist() == kjt_b[f"cat_{i}"].lengths().tolist()


# A user's transform of each row group, named by import path (tests/helpers/row_group_transforms.py).

def test_a_transform_makes_declared_columns_from_the_columns_it_reads(dataset):
    from mlkv_torch.data.transforms import RowGroupTransform

    boundaries = [-1.0, 0.0, 0.5, 1.0]
    transform = RowGroupTransform("row_group_transforms:price_buckets", reads=("dense_0",),
                                  args={"boundaries": boundaries})
    feats = [*features(rows_scale=7)[:3], SparseFeature("bucket", "bucket", 5)]
    batches = ParquetBatches([str(dataset / "train")], 512, "label", ["dense_1", "dense_2"], feats,
                             shuffle_window=3, seed=5, transform=transform)
    whole = pq.read_table(sorted((dataset / "train").glob("*.parquet"))).to_pydict()
    # What the transform does, plainly: dense_1 doubled, dense_0's bucket a sparse feature.
    whole["dense_1"] = [None if v is None else v * 2 for v in whole["dense_1"]]
    whole["bucket"] = [int(np.searchsorted(boundaries, 0.0 if v is None else v)) for v in whole["dense_0"]]
    for number in (0, 7, 12):
        assert_batch_holds(batches(number), batches.row_indices(number), whole, feats, dense=["dense_1", "dense_2"])
    # dense_0 is read for the transform: its chunks count, the other undeclared columns' do not.
    plain = ParquetBatches([str(dataset / "train")], 512, "label", ["dense_1", "dense_2"], feats[:3])
    dense_0 = sum(pq.ParquetFile(p).metadata.row_group(g).column(1).total_compressed_size
                  for p in sorted((dataset / "train").glob("*.parquet")) for g in range(2))
    assert pq.ParquetFile(sorted((dataset / "train").glob("*.parquet"))[0]).schema_arrow.names[1] == "dense_0"
    assert batches.bytes_read_per_epoch == plain.bytes_read_per_epoch + dense_0


@pytest.mark.parametrize("function,reads,error,problem", [
    ("no_such_module:f", (), ValueError, "module 'no_such_module' cannot be imported here"),
    ("row_group_transforms:missing", (), ValueError, "has no function 'missing'"),
    ("row_group_transforms:price_buckets", ("dense_0", "nope"), ParquetFormatError,
     "has no column 'nope', which the transform row_group_transforms:price_buckets reads"),
    ("row_group_transforms:drops_the_first_row", (), ParquetFormatError,
     "after the transform row_group_transforms:drops_the_first_row\\) has no column 'bucket'"),
    ("row_group_transforms:not_a_table", (), TypeError, "returned a dict .*it must return a pyarrow Table"),
])
def test_a_transform_that_cannot_make_the_schema_is_refused_when_the_files_are_opened(dataset, function, reads,
                                                                                    error, problem):
    from mlkv_torch.data.transforms import RowGroupTransform

    transform = RowGroupTransform(function, reads=reads, args={"boundaries": [0.0]} if reads else {})
    with pytest.raises(error, match=problem):
        ParquetBatches([str(dataset / "train")], 512, "label", [], [SparseFeature("bucket", "bucket", 5)],
                       transform=transform)


def test_a_transform_that_fails_on_a_row_group_or_drops_rows_is_named_with_the_row_group(tmp_path):
    from mlkv_torch.data.transforms import RowGroupTransform

    path = write(tmp_path / "f.parquet", {"label": [0, 1, 1], "ids": [1, 2, 3]})
    fails = ParquetBatches([path], 3, "label", [], [SparseFeature("ids", "t", 10)],
                           transform=RowGroupTransform("row_group_transforms:fails_on_rows"))
    with pytest.raises(RuntimeError, match="fails_on_rows failed on Parquet file .*f.parquet', row group 0: "
                                           "KeyError: 'no price list for this region'"):
        fails(0)
    drops = ParquetBatches([path], 2, "label", [], [SparseFeature("ids", "t", 10)],
                           transform=RowGroupTransform("row_group_transforms:drops_the_first_row"))
    with pytest.raises(ValueError, match="returned 2 rows for the 3 of Parquet file .*row group 0; it must keep"):
        drops(0)


def test_a_torchrec_npy_day_with_negative_int32_values_becomes_parquet_of_the_values_unsigned(tmp_path):
    from mlkv_torch.data.criteo_parquet import day_to_parquet, parquet_schema

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "day_0")
    sparse = rng.integers(0, 1 << 31, (8, 26)).astype(np.int32)
    sparse[0, :3] = [-1, -(1 << 31), 7]  # torchrec's npy files hold values past 2**31 so
    np.save(f"{prefix}_dense.npy", rng.random((8, 13), dtype=np.float32))
    np.save(f"{prefix}_sparse.npy", sparse)
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, (8, 1), dtype=np.int32))
    path = str(tmp_path / "day_0.parquet")
    assert day_to_parquet(prefix, path) == 8
    schema = parquet_schema([1000] * 26)
    batch = ParquetBatches([path], 8, schema["label"], schema["dense"],
                           [SparseFeature(s["column"], s["column"], s["rows"]) for s in schema["sparse"]])(0)
    ids = batch.sparse_features.values().view(26, 8).T
    assert ids[0, :3].tolist() == [(2**32 - 1) % 1000, 2**31 % 1000, 7]
    assert ids.tolist() == (sparse.astype(np.int64) % (1 << 32) % 1000).tolist()


def test_the_generators_help_says_what_it_makes_and_every_option(capsys):
    from mlkv_torch.data.parquet_generate import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "written as a wide table, more columns than a model reads (as production logs are)." in text
    assert "Columns: `label` (int8 clicks)" in text  # the layout a config must declare
    for option in ("OUT_DIR", "--rows ROWS", "--files FILES", "--row-group-rows ROW_GROUP_ROWS", "--seed SEED",
                   "--unused-columns UNUSED_COLUMNS"):
        after = text.split(option, 2)[-1].split()  # the option's line in the list: its help follows it
        assert after and not after[0].startswith("-") and after[0] != "options:", f"{option} has no help"
