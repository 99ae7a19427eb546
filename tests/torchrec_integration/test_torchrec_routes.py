"""The routes from TorchRec's API to the disk kernel, written as a TorchRec user writes DMP code:
one settings object for every front door, fused_params read as FBGEMM reads them, one per-shard
budget for the planner and the kernel, state dict tensors that write through, one sharder for two
models, DMP on the meta device; and, under torchrun with 2 ranks, every sharding type
(tests/workers/routes_worker.py)."""
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.modules.embedding_configs import CountBasedEvictionPolicy, EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from mlkv_torch import DiskTableSettings, initial_rows, optim  # noqa: E402
from mlkv_torch.disk_modules import DiskTableModule  # noqa: E402
from mlkv_torch.torchrec import (DISK_KERNEL, DiskAwarePlanner, DiskAwareStorageEstimator,  # noqa: E402
                                 DiskEmbeddingBagCollection, DiskEmbeddingBagCollectionSharder)
from mlkv_torch.torchrec.sharded_tables import planning_with_disk  # noqa: E402
from mlkv_torch.torchrec.tables import table_seed  # noqa: E402
from mlkv_torch.written_through import WrittenThrough  # noqa: E402

WORKER = Path(__file__).parents[1] / "workers" / "routes_worker.py"
DIM, ROWS, BATCH, LR = 8, 64, 6, 0.1


def table(name="t", rows=ROWS, dim=DIM, **fields):
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{name}"],
                              **fields)


def batch(names=("t",), rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(names), BATCH), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in names], values=values,
                                               lengths=lengths.flatten())


def one_process_dmp(tables, sharder, sharding="table_wise", kernel=DISK_KERNEL, device="cpu", ebc=None):
    ebc = ebc if ebc is not None else EmbeddingBagCollection(tables, device=torch.device("meta"))
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel],
                                                min_partition=DIM // 2) for t in tables}
    planner_of = DiskAwarePlanner if kernel == DISK_KERNEL else EmbeddingShardingPlanner
    plan = planner_of(topology=Topology(world_size=1, compute_device="cpu"), batch_size=BATCH,
                      constraints=constraints).plan(ebc, [sharder])
    return DistributedModelParallel(ebc, device=torch.device(device), plan=plan, sharders=[sharder])


def rows_of(dmp, name="t"):
    """The table's rows, from this (only) rank's shards."""
    shards = dmp.state_dict()[f"embedding_bags.{name}.weight"].local_shards()
    rows = torch.empty(shards[0].metadata.shard_sizes[0], sum(s.metadata.shard_sizes[1] for s in shards))
    for shard in shards:
        (r0, c0), (n, c) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        rows[r0:r0 + n, c0:c0 + c] = shard.tensor
    return rows


def start_from(dmp, name="t", rows=ROWS):
    """Every shard of the table starts from mlkv_torch's initial rows (TorchRec's way of setting rows)."""
    state = dmp.state_dict()
    full = initial_rows(torch.arange(rows), DIM, seed=table_seed(0, name), num_embeddings=rows)
    for shard in state[f"embedding_bags.{name}.weight"].local_shards():
        (r0, c0), (n, c) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.detach().copy_(full[r0:r0 + n, c0:c0 + c])
    dmp.load_state_dict(state)


# ---- one settings object ------------------------------------------------------------------------------
def test_the_settings_are_one_object_taken_whole_or_by_keyword(tmp_path):
    settings = DiskTableSettings(optimizer=optim.Adagrad(lr=0.2), staleness=1, seed=5)
    ebc = DiskEmbeddingBagCollection([table()], path=tmp_path / "a", settings=settings, staleness=0)
    bag = ebc.embedding_bags["t"]
    assert (bag.optimizer, bag.staleness) == (optim.Adagrad(lr=0.2), 0)  # the keyword replaces the field
    sharder = DiskEmbeddingBagCollectionSharder(tmp_path / "b", settings=settings, qcomm_codecs_registry=None)
    assert sharder.options.settings == settings
    with pytest.raises(TypeError, match=r"DiskEmbeddingBagCollection got unexpected keyword arguments \['stalenes'\]"):
        DiskEmbeddingBagCollection([table()], path=tmp_path / "c", stalenes=1)
    with pytest.raises(ValueError, match="staleness must be a non-negative int"):
        DiskEmbeddingBagCollectionSharder(tmp_path / "d", staleness=-1)
    with pytest.raises(TypeError, match=r"DiskEmbeddingBagCollectionSharder got unexpected keyword arguments "
                                        r"\['stalenes'\]; the disk tables' settings are"):
        DiskEmbeddingBagCollectionSharder(tmp_path / "d", stalenes=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        DiskTableSettings(backend="leveldb")
    with pytest.raises(TypeError, match="optimizer must be an mlkv_torch.optim rule"):
        DiskTableSettings(optimizer=torch.optim.SGD)
    drawn = DiskTableSettings().with_seed()
    assert drawn.seed_drawn and drawn.with_seed() is drawn and not DiskTableSettings(seed=1).with_seed().seed_drawn
    assert isinstance(ebc, DiskTableModule) and ebc.disk_table_names == ["t"] and ebc.lookahead_process_group is None


# ---- fused_params as FBGEMM reads them ---------------------------------------------------------------
@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_fused_params_without_an_optimizer_train_as_torchrec_fused_tables(process_group, tmp_path, sharding):
    # TorchRec's fused tables take FBGEMM's default optimizer, exact SGD, at the learning rate given.
    fused_params = {"learning_rate": LR}
    models = {"disk": one_process_dmp([table()], DiskEmbeddingBagCollectionSharder(tmp_path, seed=0,
                                                                                    fused_params=fused_params),
                                      sharding),
              "fused": one_process_dmp([table()], EmbeddingBagCollectionSharder(fused_params=fused_params), sharding,
                                       kernel="fused")}
    rows = {}
    for kind, dmp in models.items():
        start_from(dmp)
        out = dmp(batch()).values()
        (out * torch.linspace(-1, 1, DIM)).sum().backward()
        rows[kind] = rows_of(dmp)
    assert models["disk"].plan.plan[""]["t"].compute_kernel == DISK_KERNEL
    # One rule in the same operation order as fbgemm's: equal to the bit.
    torch.testing.assert_close(rows["disk"], rows["fused"], rtol=0, atol=0)
    start = initial_rows(torch.arange(ROWS), DIM, seed=table_seed(0, "t"), num_embeddings=ROWS)
    assert (rows["disk"] - start).abs().max() > 0.05  # lr 0.1, not 0.01: a step of each row's gradient


def test_torchrecs_data_parallel_tables_train_as_embedding_bags_despite_fbgemms_autograd_warning(process_group):
    """The runner's plans replicate small tables (data_parallel, TorchRec's dense kernel), whose
    backward passes through fbgemm's dense_embedding_codegen_lookup_function, an op without an
    autograd kernel of its own: torch warns that this "may lead to silently incorrect behavior".
    It does not here: the rows step as torch.nn.EmbeddingBag's under the same SGD."""
    dmp = one_process_dmp([table()], EmbeddingBagCollectionSharder(), "data_parallel", kernel="dense")
    assert dmp.plan.plan[""]["t"].sharding_type == "data_parallel"
    (name, weight), = [(n, p) for n, p in dmp.named_parameters() if n.endswith("t.weight")]
    reference = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    start = initial_rows(torch.arange(ROWS), DIM, seed=table_seed(0, "t"), num_embeddings=ROWS)
    with torch.no_grad():
        weight.copy_(start)
        reference.weight.copy_(start)
    ours, theirs = torch.optim.SGD([weight], lr=LR), torch.optim.SGD(reference.parameters(), lr=LR)
    scale = torch.linspace(-1, 1, DIM)
    for step in range(3):
        kjt = batch(seed=step)
        with pytest.warns(UserWarning, match="dense_embedding_codegen_lookup_function: an autograd kernel was not "
                                             "registered"):
            (dmp(kjt).values() * scale).sum().backward()
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), kjt.lengths().cumsum(0)[:-1]])
        (reference(kjt.values(), offsets) * scale).sum().backward()
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad()
    assert (weight.detach() - start).abs().max() > 0.05  # trained: a step of lr 0.1
    torch.testing.assert_close(weight.detach(), reference.weight.detach(), rtol=1e-6, atol=1e-6)


# ---- one budget: what the planner charges is what the kernel opens -----------------------------------
def _planned_and_opened(tmp_path, tables, sharding, fraction, optimizer=optim.SGD(lr=LR), in_backward=None,
                        **sharder_args):
    """The bytes DiskAwarePlanner's storage estimate charges this rank's disk shards, and the bytes
    the kernels DMP opens hold (`in_backward`: (optimizer class, kwargs) applied to the tables)."""
    sharder = DiskEmbeddingBagCollectionSharder(tmp_path, memory_fraction=fraction, optimizer=optimizer, seed=0,
                                                **sharder_args)
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    if in_backward is not None:
        apply_optimizer_in_backward(in_backward[0], ebc.embedding_bags.parameters(), in_backward[1])
    topology = Topology(world_size=1, compute_device="cpu")
    estimator = DiskAwareStorageEstimator(topology)
    estimator.options = sharder.options
    with planning_with_disk():
        options = EmbeddingEnumerator(topology=topology, batch_size=BATCH, estimator=[estimator]).enumerate(
            ebc, [sharder])
    charged = sum(shard.storage.ddr for o in options
                  if o.compute_kernel == DISK_KERNEL and o.sharding_type == sharding for shard in o.shards)
    dmp = one_process_dmp(tables, sharder, sharding, ebc=ebc)
    (kernel,) = list(dmp.module.disk_kernels())
    return charged, kernel, dmp


def test_the_planner_charges_an_in_backward_optimizers_rows_over_the_sharders(process_group, tmp_path):
    # Adagrad's rows carry a state per weight: the planner must size them as the kernel opens them.
    charged, kernel, _ = _planned_and_opened(tmp_path, [table(rows=20_000)], "table_wise", 0.5,
                                             in_backward=(torch.optim.Adagrad, {"lr": 0.5}))
    (bag,) = kernel.bags
    assert bag.optimizer == optim.Adagrad(lr=0.5, eps=1e-8) and charged == kernel.memory_budget_bytes


@pytest.mark.parametrize("rows, dim, fraction", [(256, 128, 0.1), (256, 128, 0.5), (100_000, 256, 0.001)])
def test_a_plan_the_planner_accepts_opens_with_the_bytes_it_charged(process_group, tmp_path, rows, dim, fraction):
    # Wide rows at a small fraction: once refused at DMP construction after planning succeeded.
    charged, kernel, _ = _planned_and_opened(tmp_path, [table(rows=rows, dim=dim)], "table_wise", fraction)
    assert charged == kernel.memory_budget_bytes > 0


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_the_bytes_charged_equal_the_bytes_opened_for_fixed_and_virtual_tables(process_group, tmp_path, sharding):
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=500, eviction_threshold=2)
    tables = [table("a", rows=5000), table("b", rows=1 << 40, use_virtual_table=True, total_num_buckets=4,
                                           virtual_table_eviction_policy=policy)]
    charged, kernel, _ = _planned_and_opened(tmp_path, tables, sharding, 0.2)
    assert charged == kernel.memory_budget_bytes
    # The virtual table's share holds the counts of the ids it keeps (its trigger), from the user's policy.
    bag = kernel.bags[[shard.name for shard in kernel.config.embedding_tables].index("b")]
    assert bag._batch.tables[bag._table].id_policy.trigger_ids == 500


def test_a_small_tables_fraction_sets_its_cache(process_group, tmp_path):
    # 128 KB of rows: its fraction, not a floor above it, decides what it caches.
    cached = {}
    for fraction in (0.05, 0.5, 1.0):
        _, kernel, _ = _planned_and_opened(tmp_path / str(fraction), [table(rows=4000)], "table_wise", fraction)
        (bag,) = kernel.bags
        cached[fraction] = bag.cache_rows
    assert cached[0.05] < cached[0.5] < cached[1.0], cached


# ---- state dict tensors write through ----------------------------------------------------------------
def test_writes_into_a_collections_state_dict_reach_its_tables(tmp_path):
    ebc = DiskEmbeddingBagCollection([table()], path=tmp_path, optimizer=optim.Adagrad(lr=LR), seed=0)
    bag = ebc.embedding_bags["t"]
    weight = ebc.state_dict()["embedding_bags.t.weight"]
    assert isinstance(weight, WrittenThrough)
    new = torch.randn(ROWS, DIM)
    weight.copy_(new)  # as TorchRec's utilities copy weights between models
    torch.testing.assert_close(bag.snapshot(), new, rtol=0, atol=0)
    weight.detach()[3:5] = 7.0  # a view's writes: those rows alone
    weight[10].add_(1.0)
    new[3:5], new[10] = 7.0, new[10] + 1.0
    torch.testing.assert_close(bag.snapshot(), new, rtol=0, atol=0)
    assert not isinstance(weight + 1, WrittenThrough) and not isinstance(weight.clone(), WrittenThrough)
    # The optimizer state too, and the weights keep their values when it is written.
    state = ebc.fused_optimizer.state_dict()["state"]["t.weight"]["t.optimizer_state"]["rows"]
    state.fill_(0.5)
    assert torch.equal(bag.state_snapshot(), torch.full((ROWS, DIM), 0.5))
    torch.testing.assert_close(bag.snapshot(), new, rtol=0, atol=0)
    # Saved and copied, it is a plain tensor (torch.load with weights_only takes it).
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, new)
    assert type(copy.deepcopy(weight)) is torch.Tensor


def test_a_state_dict_write_keeps_what_training_changed_since_and_takes_every_way_of_writing(tmp_path):
    ebc = DiskEmbeddingBagCollection([table()], path=tmp_path, optimizer=optim.SGD(lr=LR), seed=0)
    bag = ebc.embedding_bags["t"]
    weight = ebc.state_dict()["embedding_bags.t.weight"]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f_t"], values=torch.tensor([5]), lengths=torch.tensor([1]))
    ebc(kjt).values().sum().backward()  # row 5 trains after the state dict was taken
    trained = bag.snapshot()[5].clone()
    weight[5, 0] = 42.0  # one element: the rest of the row keeps its trained values
    trained[0] = 42.0
    torch.testing.assert_close(bag.snapshot()[5], trained, rtol=0, atol=0)
    torch.nn.init.constant_(weight[7:9], 3.0)  # torch.nn.init passes the tensor by keyword
    assert torch.equal(bag.snapshot()[7:9], torch.full((2, DIM), 3.0))
    for row in weight[10:12]:  # iteration and unbind give views that write through
        row.zero_()
    assert torch.equal(bag.snapshot()[10:12], torch.zeros(2, DIM))
    first, _ = weight.split([1, ROWS - 1])
    first.fill_(-1.0)
    assert torch.equal(bag.snapshot()[0], torch.full((DIM,), -1.0))


def test_writes_into_a_sharded_state_dict_reach_the_shards_without_load_state_dict(process_group, tmp_path):
    dmp = one_process_dmp([table()], DiskEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.SGD(lr=LR)),
                          "column_wise")
    new = torch.randn(ROWS, DIM)
    for shard in dmp.state_dict()["embedding_bags.t.weight"].local_shards():
        (r0, c0), (n, c) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.detach().copy_(new[r0:r0 + n, c0:c0 + c])
    torch.testing.assert_close(rows_of(dmp), new, rtol=0, atol=0)


# ---- one sharder, two models -------------------------------------------------------------------------
def test_one_sharder_shards_two_models_each_with_its_own_tables(process_group, tmp_path):
    sharder = DiskEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.SGD(lr=LR))
    first, second = one_process_dmp([table()], sharder), one_process_dmp([table()], sharder)
    assert not torch.equal(rows_of(first), rows_of(second))  # a drawn seed: other rows, as TorchRec's
    (first_kernel,), (second_kernel,) = first.module.disk_kernels(), second.module.disk_kernels()
    assert first_kernel.rank_dir == str(tmp_path / "rank0")
    assert second_kernel.rank_dir == str(tmp_path / "module1" / "rank0")
    before = rows_of(first)
    (second(batch()).values().sum()).backward()  # training one leaves the other alone
    assert torch.equal(rows_of(first), before) and not torch.equal(rows_of(second), before)
    seeded = DiskEmbeddingBagCollectionSharder(tmp_path / "seeded", optimizer=optim.SGD(lr=LR), seed=3)
    assert torch.equal(rows_of(one_process_dmp([table()], seeded)), rows_of(one_process_dmp([table()], seeded)))
    with pytest.raises(ValueError, match="names the cuts of one module's tables"):
        cut = DiskEmbeddingBagCollectionSharder(tmp_path / "cut", optimizer=optim.SGD(lr=LR), cuts={0: None})
        one_process_dmp([table()], cut), one_process_dmp([table()], cut)
    assert DiskTableSettings.of(DiskTableSettings().with_seed(), {"seed": 3}, "x").seed_drawn is False
    with pytest.raises(ValueError, match="FBGEMM's fused Adagrad starts its accumulators at 0"):
        DiskEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.Adagrad(initial_accumulator_value=0.5))


def test_a_model_sharded_on_meta_first_takes_no_place_of_the_sharders(process_group, tmp_path):
    # TorchRec users build a meta DMP for shapes or a checkpoint's layout, then the real one.
    sharder = DiskEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.SGD(lr=LR))
    one_process_dmp([table()], sharder, device="meta")
    (kernel,) = one_process_dmp([table()], sharder).module.disk_kernels()
    assert kernel.rank_dir == str(tmp_path / "rank0")


# ---- DMP on the meta device --------------------------------------------------------------------------
def test_dmp_on_the_meta_device_opens_nothing_and_gives_shapes(process_group, tmp_path):
    sharder = DiskEmbeddingBagCollectionSharder(tmp_path / "tables", optimizer=optim.SGD(lr=LR))
    dmp = one_process_dmp([table(), table("u", rows=100)], sharder, device="meta")
    out = dmp(batch(("t", "u")))
    assert out.values().is_meta and out.values().shape == (BATCH, 2 * DIM)
    assert not (tmp_path / "tables").exists()  # nothing opened, nothing written
    assert [name for name, _ in dmp.named_parameters()] == ["embedding_bags.t.weight", "embedding_bags.u.weight"]
    weight = dmp.state_dict()["embedding_bags.t.weight"]
    assert weight.size() == (ROWS, DIM) and all(s.tensor.is_meta for s in weight.local_shards())
    assert dmp.module.stats() == {}


# ---- two ranks, every sharding type --------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("routes")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(WORKER), str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return [json.loads((out / f"routes-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise", "table_row_wise"])
def test_two_ranks_train_fused_params_as_fbgemm_default(two_ranks, sharding):
    results = [rank["fused_params"][sharding] for rank in two_ranks]
    assert all(r["kernel"] == [DISK_KERNEL, sharding] for r in results)
    assert sum(r["held"] for r in results) >= ROWS * DIM  # every row is on some rank
    for r in results:
        assert r["max_error"] < 1e-5 < 0.5 * r["max_update"], r


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise", "table_row_wise"])
def test_a_virtual_table_keeps_its_eviction_policy_whatever_the_sharding(two_ranks, sharding):
    results = [rank["virtual"][sharding] for rank in two_ranks]
    assert all(r["kernel"] == sharding and r["finite"] for r in results)
    assert all(r["evicted"] > 0 for r in results if r["shards"]), results
    assert any(r["shards"] for r in results)
