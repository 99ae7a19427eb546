"""DistributedModelParallel with disk tables: 2 real processes under torchrun (gloo, CPU).

tests/workers/dmp_worker.py runs DLRM with TorchRec's in-memory kernels and with the planner's
mixed plan (a table-wise and a column-wise table on disk); from the same initial rows and
batches, the losses must agree at every step, for SGD (the sharder's optimizer) and row-wise
Adagrad (apply_optimizer_in_backward), across a learning-rate change made through the
optimizer's param_groups. A job that saves a checkpoint (torch.distributed.checkpoint) is then
killed; a new job that resumes from it with empty storage must produce the losses of the
uninterrupted job. TorchRec's TrainPipelineSparseDist over the mixed plan gives the plain loop's losses.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

WORKER = Path(__file__).parents[1] / "workers" / "dmp_worker.py"


def _torchrun(phase: str, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), phase, str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _result(phase: str, out: Path) -> dict:
    run = _torchrun(phase, out)
    assert run.returncode == 0, f"{phase} failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads((out / f"{phase}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dmp")
    # One job for the phases before the kill (the save phase ends it): a job's start takes seconds.
    killed = _torchrun("equivalence,pipeline,unsharded,save", out)
    phases = ("equivalence", "pipeline", "unsharded")
    assert all((out / f"{phase}.json").exists() for phase in phases), killed.stderr[-8000:]
    results = {phase: json.loads((out / f"{phase}.json").read_text()) for phase in phases}
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr, killed.stderr[-4000:]
    assert (out / "checkpoint" / ".metadata").exists(), "the checkpoint was complete before the kill"
    shutil.rmtree(out / "store-save")  # the resumed job starts from the checkpoint alone
    results["resume"] = _result("resume", out)
    return results


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_mixed_plan_trains_as_the_all_in_memory_plan(runs, optimizer):
    memory, mixed = runs["equivalence"][f"{optimizer}/memory"], runs["equivalence"][f"{optimizer}/mixed"]
    assert {t: k[0] for t, k in memory["kernels"].items()} == dict.fromkeys(["t0", "t1", "t2", "t3"], "fused")
    assert mixed["kernels"]["t1"] == ["customized_kernel", "table_wise", 1]
    assert mixed["kernels"]["t3"] == ["customized_kernel", "column_wise", 2]
    assert mixed["kernels"]["t0"][0] == mixed["kernels"]["t2"][0] == "fused"
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(mixed["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan", ["memory", "mixed"])
def test_the_bytes_sent_between_ranks_are_counted_by_kind(runs, plan):
    # Per step, each table shard's owner sends its pooled rows for the other rank's 8 samples, and
    # gets their gradients back: 3 table-wise tables of 16 columns and 2 column shards of 8, float32,
    # whichever rank holds which: the disk kernel sends what TorchRec's own kernel sends.
    from dmp_worker import BATCH, STEPS
    run = runs["equivalence"][f"sgd/{plan}"]
    sent = {kind: sum(rank[kind] for rank in run["sent"]) for kind in ("ids", "outputs", "gradients")}
    per_step = BATCH * (3 * 16 + 2 * 8) * 4
    assert sent["outputs"] == sent["gradients"] == STEPS * per_step, sent
    assert sent["ids"] > 0


def test_a_killed_job_resumed_from_its_checkpoint_continues_as_the_uninterrupted_job(runs):
    uninterrupted = runs["equivalence"]["rowwise_adagrad/mixed"]["losses"]  # the same plan, data and start
    save_at = len(uninterrupted[0]) - len(runs["resume"]["losses"][0])
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(runs["resume"]["losses"][rank]),
                                   torch.tensor(uninterrupted[rank][save_at:]), rtol=0, atol=0)


def test_trainpipelinesparsedist_trains_disk_tables_as_the_plain_loop(runs):
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(runs["pipeline"]["pipelined"]["losses"][rank]),
                                   torch.tensor(runs["pipeline"]["plain"]["losses"][rank]), rtol=0, atol=0)


def test_torchrecs_prefetch_pipeline_reads_disk_rows_ahead_and_trains_as_the_plain_loop(runs):
    # PrefetchPipeline: TorchRec's PrefetchTrainPipelineSparseDist, whose prefetch step also runs
    # without CUDA streams; it calls the sharded module's prefetch() one batch ahead.
    pipeline = runs["pipeline"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(pipeline["prefetch"]["losses"][rank]),
                                   torch.tensor(pipeline["plain"]["losses"][rank]), rtol=0, atol=0)
    prefetched = [s for rank in pipeline["prefetch"]["stats"] for s in rank.values()]
    plain = [s for rank in pipeline["plain"]["stats"] for s in rank.values()]
    assert len(prefetched) == 3  # t1 on rank 0, t3's two column shards
    assert all(s["read_ahead_rows"] > 0 and s["read_ahead_hits"] == s["read_ahead_rows"] for s in prefetched)
    assert all(s["read_ahead_rows"] == 0 for s in plain)
    # The misses the read-ahead served: most of them (the first batch's too, read ahead as the
    # pipeline fills).
    assert sum(s["read_ahead_hits"] for s in prefetched) >= 0.5 * sum(s["cache_misses"] for s in prefetched)
    # TorchRec's own pipeline on the CPU prefetches nothing and its forward finds no input.
    assert pipeline["torchrec_prefetch_on_cpu"].startswith("AssertionError: Invalid PrefetchPipelinedForward")
    # Into cache slots (CUDA's default): each forward pools from the read-ahead its prefetch queued
    # (no search among the read-aheads by ids: on CUDA no host synchronisation), every step.
    into_slots = pipeline["prefetch-into-slots"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(into_slots["losses"][rank]),
                                   torch.tensor(pipeline["plain"]["losses"][rank]), rtol=0, atol=0)
    # (A batch with a row left out of its slots, one written back while it was read, is fetched by
    # key instead: timing decides, so most steps, not every one.)
    steps = len(pipeline["plain"]["losses"][0])
    lookups = [s["read_ahead_lookups"] for rank in into_slots["stats"] for s in rank.values()]
    assert len(lookups) == 3 and all(steps >= n >= 0.75 * steps for n in lookups), lookups
    assert all(s["read_ahead_lookups"] == 0 for rank in pipeline["prefetch"]["stats"] for s in rank.values())


def test_the_one_process_collection_in_a_multi_rank_job_names_the_sharder(runs):
    error = runs["unsharded"]["error"]
    assert error is not None and "one of 2 ranks" in error and "DiskEmbeddingBagCollectionSharder" in error


def test_disk_table_shards_are_placed_in_host_memory_whatever_the_plan(tmp_path):
    # A plan for CUDA places shards on "rank:r/cuda:r"; a disk table's rows are read into host (or
    # file-backed) tensors, which a ShardedTensor refuses at a CUDA placement.
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    from mlkv_torch.torchrec.kernel import on_host

    on_cuda = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[4, 3], placement="rank:0/cuda:0")
    host = on_host(on_cuda)
    assert str(host.placement) == "rank:0/cpu"
    assert (list(host.shard_offsets), list(host.shard_sizes)) == ([0, 0], [4, 3])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "rendezvous"), 1), rank=0, world_size=1)
    try:
        def sharded(metadata):
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                [Shard(torch.ones(4, 3), metadata)],
                ShardedTensorMetadata([metadata], torch.Size([4, 3]), TensorProperties(dtype=torch.float32)))
        with pytest.raises(Exception, match="device"):
            sharded(on_cuda)
        assert sharded(host).local_shards()[0].tensor.device.type == "cpu"
    finally:
        dist.destroy_process_group()


def test_a_raw_id_table_refuses_a_dense_state_dict_and_saves_through_cuts(tmp_path):
    # A table of 2**40 rows (raw ids, the sharder's live_ids) under a one-rank DMP: a state dict
    # would hold it dense; outside disk_tables_left_out it says so, inside it holds the rest.
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskAwarePlanner, DiskEmbeddingBagCollectionSharder, disk_tables_left_out

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "rendezvous"), 1), rank=0, world_size=1)
    try:
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="item", embedding_dim=8, num_embeddings=2**40,
                                                         feature_names=["f"])], device=torch.device("meta"))
        sharder = DiskEmbeddingBagCollectionSharder(tmp_path / "tables", optimizer=optim.SGD(lr=0.1),
                                                    live_ids={"item": 10_000})
        plan = DiskAwarePlanner(topology=Topology(world_size=1, compute_device="cpu", ddr_cap=1 << 30),
                                batch_size=4).collective_plan(ebc, [sharder])
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
        ids = torch.tensor([5, 2**40 - 1, 2**39 + 7])
        out = dmp(KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([2, 1])))
        out.values().sum().backward()
        with pytest.raises(RuntimeError, match=r"tables \['item'\] hold raw ids .* cannot hold them dense"):
            dmp.state_dict()
        with disk_tables_left_out():
            assert "embedding_bags.item.weight" not in dmp.state_dict()
        assert dmp.module.checkpoint() is not None  # the rows, in a cut
        assert dmp.module.stats()["item_rows0_cols0"]["rows"] == 3
    finally:
        dist.destroy_process_group()
