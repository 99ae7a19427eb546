"""mlkv_torch.torchrec.load_export: a run's export loaded into a user's own model, as a TorchRec
user builds it (an EmbeddingBagCollection on meta, DistributedModelParallel with the disk sharder
and the planner under constraints), on another plan than the run's; checked row for row and state
for state against the export's files."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("pyarrow.parquet")

import torch.distributed as dist  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from mlkv_torch import optim  # noqa: E402
from mlkv_torch.config import ConfigError, load_config  # noqa: E402
from mlkv_torch.export import export_checkpoint  # noqa: E402
from mlkv_torch.exported_tables import read_export  # noqa: E402
from mlkv_torch.store import initial_rows  # noqa: E402
from mlkv_torch.torchrec import (DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder,  # noqa: E402
                                 load_export)
from mlkv_torch.train import run  # noqa: E402
from test_export import QUICKSTART, SMALL, _exported  # noqa: E402

# Where the user's plan puts the export's tables, one after another: the run had every table on disk.
PLACES = [(DISK_KERNEL, "table_wise"), (DISK_KERNEL, "row_wise"), ("fused", "table_wise"),
          ("fused", "column_wise"), ("dense", "data_parallel")]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """An export of the quickstart's one-process run (row-wise Adagrad, every table on disk)."""
    tmp = tmp_path_factory.mktemp("load-export")
    config = load_config(QUICKSTART, [f"output_dir={tmp / 'run'}", "train.steps=8", *SMALL])
    run(config, progress=False)
    export_checkpoint(str(tmp / "run"), str(tmp / "export"))
    return tmp / "export"


def _configs(export: Path, dim_of=lambda name, dim: dim):
    return [EmbeddingBagConfig(name=name, embedding_dim=dim_of(name, entry["dim"]), num_embeddings=entry["rows"],
                               feature_names=[f"f_{name}"])
            for name, entry in sorted(read_export(str(export)).tables.items())]


def _whole(value) -> torch.Tensor:
    """A state dict's tensor, or a ShardedTensor of one process, whole."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value.detach()
    whole = torch.empty(value.size(), dtype=value.dtype)
    for shard in value.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = shard.tensor
    return whole


def _expected_weights(export: Path, table: str, entry: dict) -> torch.Tensor:
    """The table's rows as the export gives them: its file's, the rest its initial rows."""
    ids, weights, _ = _exported(export, table)
    kind, a, b = entry["initial_rows"]["distribution"]
    rows = initial_rows(torch.arange(entry["rows"]), entry["dim"], seed=entry["initial_rows"]["seed"], low=a, high=b)
    rows[ids] = weights
    return rows


def test_an_export_loads_into_a_users_model_on_another_plan_with_every_row_and_state(export, tmp_path):
    tables = _configs(export)
    # Column-wise tables in blocks of 4 columns: several blocks of a table on one rank.
    constraints = {t.name: ParameterConstraints(compute_kernels=[PLACES[i % 5][0]], sharding_types=[PLACES[i % 5][1]],
                                                min_partition=4)
                   for i, t in enumerate(tables)}
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
        sharder = DiskEmbeddingBagCollectionSharder(tmp_path / "tables", optimizer=optim.RowWiseAdagrad(lr=0.1),
                                                    seed=0)
        plan = DiskAwarePlanner(topology=Topology(world_size=1, compute_device="cpu"), batch_size=256,
                                constraints=constraints).collective_plan(ebc, [sharder])
        model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
        got = {(ps.compute_kernel, ps.sharding_type) for ps in plan.plan[""].values()}
        assert got == set(PLACES)
        assert {len(ps.ranks) for ps in plan.plan[""].values() if ps.sharding_type == "column_wise"} == {4}
        assert load_export(model, str(export)) == 8
        weights = model.state_dict()  # disk tables as ShardedTensors too
        state = model.fused_optimizer.state_dict()["state"]
        manifest = read_export(str(export)).tables
        for i, table in enumerate(t.name for t in tables):
            entry = manifest[table]
            expected = _expected_weights(export, table, entry)
            assert torch.equal(_whole(weights[f"embedding_bags.{table}.weight"]), expected), table
            if PLACES[i % 5][1] == "data_parallel":
                continue  # its state is the user's dense optimizer's
            ids, _, exported_state = _exported(export, table)
            accumulator = torch.zeros(entry["rows"])
            accumulator[ids] = exported_state[:, 0]
            held = state[f"embedding_bags.{table}.weight"]
            if PLACES[i % 5][0] == DISK_KERNEL:
                assert held[f"{table}.optimizer_state"]["step"] == 8, table
                held = {f"{table}.momentum1": held[f"{table}.optimizer_state"]["rows"]}
            # A column-wise table keeps an accumulator a block (TorchRec: [rows] a block, end to end);
            # the export's row-wise one stands for each.
            momentum = _whole(held[f"{table}.momentum1"]).reshape(-1)
            assert torch.equal(momentum, accumulator.repeat(momentum.numel() // entry["rows"])), table
        model.module.close()  # the sharded collection: the tables' stores
    finally:
        dist.destroy_process_group()


def test_a_plain_collection_loads_the_rows_and_a_model_unlike_the_export_is_refused_by_name(export, tmp_path):
    tables = _configs(export)
    ebc = EmbeddingBagCollection(tables, device=torch.device("cpu"))  # one process, TorchRec's own tables
    assert load_export(ebc, str(export)) == 8
    manifest = read_export(str(export)).tables
    for table in manifest:
        assert torch.equal(ebc.embedding_bags[table].weight.detach(),
                           _expected_weights(export, table, manifest[table])), table
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection

    other_seed = DiskEmbeddingBagCollection(tables, path=tmp_path / "seed1", seed=1, optimizer=optim.Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match="the rows it never wrote start from seed .* use the seed it was written"):
        load_export(other_seed, str(export))  # the run's seed was 0
    other_seed.close()
    # A model of both: its large tables on disk, the others in TorchRec's collection.
    largest = max(manifest, key=lambda t: manifest[t]["rows"])
    disk = DiskEmbeddingBagCollection([t for t in tables if t.name == largest], path=tmp_path / "seed0", seed=0,
                                      optimizer=optim.Adagrad(lr=0.1))
    both = torch.nn.ModuleDict({"disk": disk, "memory": EmbeddingBagCollection([t for t in tables if t.name != largest],
                                                                               device=torch.device("cpu"))})
    assert load_export(both, str(export)) == 8
    for table in manifest.keys() - {largest}:
        assert torch.equal(both["memory"].embedding_bags[table].weight.detach(),
                           _expected_weights(export, table, manifest[table])), table
    weights, state = disk.embedding_bags[largest].snapshot(include_state=True)
    assert torch.equal(weights, _expected_weights(export, largest, manifest[largest]))
    ids, _, exported_state = _exported(export, largest)  # row-wise Adagrad's accumulator stands for each element's
    expected = torch.zeros(manifest[largest]["rows"], manifest[largest]["dim"])
    expected[ids] = exported_state[:, :1].expand(-1, manifest[largest]["dim"])
    assert torch.equal(state, expected)
    disk.close()
    first = tables[0].name
    narrower = EmbeddingBagCollection(_configs(export, lambda name, dim: 8 if name == first else dim),
                                      device=torch.device("meta"))
    with pytest.raises(ConfigError, match=f"table '{first}': the export at .*'s dim is 16, the model's 8"):
        load_export(narrower, str(export))
    other = EmbeddingBagCollection([EmbeddingBagConfig(name="ads", embedding_dim=16, num_embeddings=10,
                                                       feature_names=["ad"])], device=torch.device("meta"))
    with pytest.raises(ConfigError, match=r"holds no table \['ads'\] of the model"):
        load_export(other, str(export))
    with pytest.raises(ConfigError, match="holds no embedding table"):
        load_export(torch.nn.Linear(2, 2), str(export))
