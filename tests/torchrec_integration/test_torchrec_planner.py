"""DiskAwarePlanner and DiskEmbeddingBagCollectionSharder on one process: which tables go to
disk under which memory caps, constraints that force a kernel, an infeasible budget's error,
the storage estimate of a disk shard, and the optimizer mapping from TorchRec's fused params."""
import logging

import pytest
import torch

pytest.importorskip("torchrec")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError, Topology  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from mlkv_torch import optim  # noqa: E402
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder  # noqa: E402
from mlkv_torch.torchrec.planner import DISK_SPACE_AMPLIFICATION  # noqa: E402
from mlkv_torch.memory_budget import shard_memory_budget  # noqa: E402
from mlkv_torch.torchrec.sharded_tables import planning_with_disk  # noqa: E402
from mlkv_torch.row_layout import row_bytes  # noqa: E402
from mlkv_torch.torchrec.fused_optimizer import fused_params_of, optimizer_from_fused_params  # noqa: E402

MiB = 1 << 20
# 64 KB, 128 MB, 3.2 MB and 512 MB of float32 weights.
SIZES = {"t0": 1000, "t1": 2_000_000, "t2": 50_000, "t3": 8_000_000}


@pytest.fixture(scope="module")
def ebc():
    tables = [EmbeddingBagConfig(name=name, embedding_dim=16, num_embeddings=n, feature_names=[f"f_{name}"])
              for name, n in SIZES.items()]
    return EmbeddingBagCollection(tables, device=torch.device("meta"))


def _plan(ebc, ddr_cap, constraints=None, ssd_cap=8 << 30):
    sharder = DiskEmbeddingBagCollectionSharder("/nonexistent/not-used-by-planning", optimizer=optim.SGD(lr=0.1))
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=ddr_cap, ssd_cap=ssd_cap)
    plan = DiskAwarePlanner(topology=topology, batch_size=128, constraints=constraints).plan(ebc, [sharder])
    return {name: ps for name, ps in plan.plan[""].items()}


def _on_disk(plan):
    return sorted(name for name, ps in plan.items() if ps.compute_kernel == DISK_KERNEL)


@pytest.mark.parametrize("ddr_mib, expected", [(4096, []), (400, ["t3"]), (100, ["t1", "t3"])])
def test_tables_that_do_not_fit_memory_go_to_disk(ebc, ddr_mib, expected):
    plan = _plan(ebc, ddr_mib * MiB)
    assert _on_disk(plan) == expected
    assert all(ps.compute_kernel == "fused" for name, ps in plan.items() if name not in expected)


def test_constraints_force_a_table_to_disk_or_to_memory(ebc):
    forced = {"t0": ParameterConstraints(compute_kernels=[DISK_KERNEL])}
    assert _on_disk(_plan(ebc, 4096 * MiB, forced)) == ["t0"]
    with pytest.raises(PlannerError):  # t3 (512 MB) cannot stay in 100 MiB of memory
        _plan(ebc, 100 * MiB, {"t3": ParameterConstraints(compute_kernels=["fused"])})


def test_an_infeasible_budget_names_the_table_that_fits_nowhere(ebc):
    with pytest.raises(PlannerError) as error:
        _plan(ebc, 20 * MiB)
    message = str(error.value)
    assert "table 't3' fits no rank" in message and "disk:" in message and "memory:" in message
    assert "Unable to find a plan" in message  # TorchRec's own explanation follows
    with pytest.raises(PlannerError, match="table 't3' fits no rank.*ssd"):
        _plan(ebc, 4096 * MiB, {"t3": ParameterConstraints(compute_kernels=[DISK_KERNEL])}, ssd_cap=256 * MiB)


def test_the_plan_prints_with_the_disk_tier(ebc, caplog):
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.planner.stats"):
        _plan(ebc, 100 * MiB)
    printed = caplog.text
    assert "customized_kernel" in printed and "SSD" in printed


def test_a_planner_that_knows_no_disk_kernel_keeps_every_table_in_memory_and_says_how(ebc):
    # DistributedModelParallel's default planner, handed the disk sharder: no crash in its estimators.
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    sharder = DiskEmbeddingBagCollectionSharder("/nonexistent/not-used-by-planning", optimizer=optim.SGD(lr=0.1))
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=64 << 30)
    with pytest.warns(UserWarning,
                      match=r"every table stays in memory.*DiskAwarePlanner.*plan=planner.collective_plan"):
        plan = EmbeddingShardingPlanner(topology=topology, batch_size=128).plan(ebc, [sharder])
    assert plan.plan[""] and all(ps.compute_kernel != DISK_KERNEL for ps in plan.plan[""].values())
    assert _on_disk(_plan(ebc, 100 * MiB)) == ["t1", "t3"]  # the disk-aware planner still offers it


def test_storage_estimate_of_a_disk_shard(ebc):
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from mlkv_torch.torchrec.planner import DiskAwareStorageEstimator

    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=1 << 30, ssd_cap=8 << 30)
    estimator = DiskAwareStorageEstimator(topology)
    estimator.options = DiskEmbeddingBagCollectionSharder("/x", optimizer=optim.RowWiseAdagrad(lr=0.1),
                                                          memory_fraction=0.05).options
    sharder = DiskEmbeddingBagCollectionSharder("/x", optimizer=optim.RowWiseAdagrad(lr=0.1))
    with planning_with_disk():  # what DiskAwarePlanner plans inside: the sharder offers its disk kernel
        options = EmbeddingEnumerator(topology=topology, batch_size=128,
                                      estimator=[estimator]).enumerate(ebc, [sharder])
    disk = [o for o in options
            if o.name == "t3" and o.compute_kernel == DISK_KERNEL and o.sharding_type == "table_wise"]
    assert disk, "the sharder must offer the disk kernel for table-wise sharding"
    storage = disk[0].shards[0].storage
    per_row = row_bytes(16, torch.float32, optim.RowWiseAdagrad())  # 16 weights + 1 accumulator
    assert per_row == 68
    assert storage.ddr == shard_memory_budget(SIZES["t3"], row_bytes(16, torch.float32, optim.RowWiseAdagrad()), 0.05)
    assert storage.ssd == int(SIZES["t3"] * (per_row + 16) * DISK_SPACE_AMPLIFICATION)
    assert storage.hbm == 0
    assert not [o for o in options if o.compute_kernel == DISK_KERNEL and o.sharding_type == "data_parallel"]


@pytest.mark.parametrize("rule", [optim.SGD(lr=0.3), optim.Adagrad(lr=0.2, eps=1e-6), optim.RowWiseAdagrad(lr=0.1),
                                  optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-7)], ids=lambda r: type(r).__name__)
def test_fused_params_round_trip(rule):
    assert optimizer_from_fused_params(fused_params_of(rule), "t") == rule


def test_fused_params_from_apply_optimizer_in_backward_and_bad_ones():
    assert optimizer_from_fused_params({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "lr": 0.5}, "t") == \
        optim.RowWiseAdagrad(lr=0.5, eps=1e-8)
    # What fused_params leave out takes FBGEMM's default, as TorchRec's fused tables do: exact SGD at 0.01.
    assert optimizer_from_fused_params({}, "t") == optimizer_from_fused_params(None, "t") == optim.SGD(lr=0.01)
    assert optimizer_from_fused_params({"learning_rate": 0.1, "cache_load_factor": 0.2}, "t") == optim.SGD(lr=0.1)
    assert optimizer_from_fused_params({"optimizer": EmbOptimType.EXACT_ADAGRAD}, "t") == \
        optim.Adagrad(lr=0.01, eps=1e-8)
    with pytest.raises(ValueError, match="table 't'.*lamb.*no disk-table form"):
        optimizer_from_fused_params({"optimizer": EmbOptimType.LAMB}, "t")
    with pytest.raises(ValueError, match="weight_decay"):
        optimizer_from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.1}, "t")
    with pytest.raises(ValueError, match="memory_fraction"):
        DiskEmbeddingBagCollectionSharder("/x", memory_fraction=0.0)


def test_a_disk_table_whose_reads_would_bind_one_rank_is_sharded_by_rows(ebc):
    # t3 (512 MB) is on disk at 100 MiB a rank. Table-wise, one rank would read all of its misses;
    # row-wise each rank reads its block's share, and the planner charges each shard that share.
    plan = _plan(ebc, 100 * MiB)
    assert plan["t3"].compute_kernel == DISK_KERNEL
    assert plan["t3"].sharding_type == "row_wise", {name: ps.sharding_type for name, ps in plan.items()}
    blocks = [(list(s.shard_offsets), list(s.shard_sizes)) for s in plan["t3"].sharding_spec.shards]
    assert blocks == [([0, 0], [4_000_000, 16]), ([4_000_000, 0], [4_000_000, 16])]
    # Forced table-wise, it stays on disk whole on one rank.
    forced = _plan(ebc, 100 * MiB, {"t3": ParameterConstraints(sharding_types=["table_wise"])})
    assert forced["t3"].compute_kernel == DISK_KERNEL and forced["t3"].sharding_type == "table_wise"


def test_a_table_of_raw_ids_is_sized_by_its_live_ids_not_its_id_space():
    # 2**40 rows: as rows, a 16 TiB shard that fits no rank; as the 3M ids it will hold, it fits
    # on disk, and each row shard counts its share of them.
    raw = EmbeddingBagCollection([EmbeddingBagConfig(name="item", embedding_dim=16, num_embeddings=2**40,
                                                     feature_names=["f_item"])], device=torch.device("meta"))
    with pytest.raises(PlannerError, match=r"table 'item' fits no rank \(disk: its largest shard needs ddr"):
        _plan(raw, ddr_cap=1 << 30)
    sharder = DiskEmbeddingBagCollectionSharder("/x", optimizer=optim.SGD(lr=0.1), live_ids={"item": 3_000_000})
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=1 << 30, ssd_cap=8 << 30)
    for kind in ("table_wise", "row_wise"):
        plan = DiskAwarePlanner(topology=topology, batch_size=128, constraints={
            "item": ParameterConstraints(sharding_types=[kind])}).plan(raw, [sharder]).plan[""]["item"]
        assert (plan.compute_kernel, plan.sharding_type) == (DISK_KERNEL, kind)
    options = sharder.options
    assert options.live_rows("item", 2**39, 2**40) == 1_500_000  # a row shard: half the ids
    assert options.live_rows("item", 2**40, 2**40) == 3_000_000
    assert options.live_rows("other", 1000, 1000) == 1000  # no estimate: its rows
    with pytest.raises(ValueError, match="live_ids must map table names to positive ints"):
        DiskEmbeddingBagCollectionSharder("/x", live_ids={"item": 0})


def test_a_virtual_table_is_sized_by_its_eviction_trigger_and_sharded_by_whole_buckets():
    from torchrec.modules.embedding_configs import CountBasedEvictionPolicy

    def virtual(buckets, trigger, rows=2**40):
        policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=trigger) if trigger else None
        return EmbeddingBagCollection([EmbeddingBagConfig(
            name="item", embedding_dim=16, num_embeddings=rows, feature_names=["f_item"], use_virtual_table=True,
            total_num_buckets=buckets, virtual_table_eviction_policy=policy)], device=torch.device("meta"))

    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=1 << 30, ssd_cap=8 << 30)
    sharder = DiskEmbeddingBagCollectionSharder("/x", optimizer=optim.SGD(lr=0.1))
    row_wise = {"item": ParameterConstraints(sharding_types=["row_wise"])}
    plan = DiskAwarePlanner(topology=topology, batch_size=128, constraints=row_wise).plan(
        virtual(4, 2_000_000), [sharder]).plan[""]["item"]
    assert (plan.compute_kernel, plan.sharding_type) == (DISK_KERNEL, "row_wise")
    assert [s.shard_offsets[0] for s in plan.sharding_spec.shards] == [0, 2**39]  # two whole buckets a rank
    assert sharder.options.live_rows("item", 2**39, 2**40, sharder.options.virtual_cap(virtual(4, 2_000_000)
                                     .embedding_bag_configs()[0])) == 2_000_000  # a rank keeps at most its trigger
    with pytest.raises(ValueError, match=r"table 'item': total_num_buckets 3 is not a multiple of the 2 ranks"):
        DiskAwarePlanner(topology=topology, batch_size=128, constraints=row_wise).plan(
            virtual(3, 2_000_000, rows=3 * 2**38), [sharder])  # (TorchRec asks the buckets to divide the rows)
    with pytest.raises(ValueError, match=r"table 'item' is virtual .* training_id_eviction_trigger_count"):
        DiskAwarePlanner(topology=topology, batch_size=128, constraints=row_wise).plan(virtual(4, 0), [sharder])
