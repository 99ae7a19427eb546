"""Row-wise and table-row-wise disk tables under DistributedModelParallel: 2 and 4 real processes
under torchrun (gloo, CPU), against every table in TorchRec's memory (tests/workers/row_wise_worker.py).

Each rank holds a block of the table's rows (TorchRec's bucketization sends it its block's ids,
local to the block), pools its part of every bag, and the partial sums meet in TorchRec's
reduce-scatter. The sums change order against the table-wise reference, so losses and rows agree
to float32 rounding of a few terms (rtol 1e-5), not to the bit.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

pytest.importorskip("torchrec")

WORKER = Path(__file__).parents[1] / "workers" / "row_wise_worker.py"


def _run(tmp_path_factory, ranks: int, optimizers: str, env: Optional[dict] = None) -> dict:
    out = tmp_path_factory.mktemp(f"rw{ranks}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(WORKER), optimizers, str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return {**{(ranks, name): json.loads((out / f"{name}.json").read_text())
               for name in optimizers.split(",") + ["refusals"]}, (ranks, "out"): out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two = _run(tmp_path_factory, 2, "sgd,rowwise_adagrad,mean,resume,replicas,qcomm")
    checkpoint = two[(2, "out")] / "checkpoint"  # the 2-rank run's DCP checkpoint
    return {**two, **_run(tmp_path_factory, 4, "sgd,resharded", {"DCP_CHECKPOINT": str(checkpoint)})}


@pytest.mark.parametrize("ranks, optimizer", [(2, "sgd"), (2, "rowwise_adagrad"), (4, "sgd")])
def test_row_wise_disk_tables_train_as_the_tables_in_memory(runs, ranks, optimizer):
    memory, disk = runs[(ranks, optimizer)]["memory"], runs[(ranks, optimizer)]["disk"]
    kernel, sharding, offsets = disk["kernels"]["t_rw"]
    assert (kernel, sharding) == ("customized_kernel", "row_wise")
    block = -(-3001 // ranks)  # TorchRec's blocks: ceil(rows / ranks), the last one shorter
    assert offsets == [[block * r, 0] for r in range(ranks)]
    assert disk["kernels"]["t_twrw"][:2] == ["customized_kernel", "table_row_wise"]
    assert len(disk["kernels"]["t_twrw"][2]) == ranks  # one node: the table's rows over all its ranks
    assert disk["kernels"]["t_mem"][:2] == ["fused", "table_wise"]
    for rank in range(ranks):
        torch.testing.assert_close(torch.tensor(disk["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    for table in ("t_mem", "t_rw", "t_twrw"):
        trained, reference = torch.tensor(disk["rows"][table]), torch.tensor(memory["rows"][table])
        assert not trained.isnan().any(), f"{table}: some rows are in no rank's shard"
        torch.testing.assert_close(trained, reference, rtol=1e-5, atol=1e-6, msg=lambda m: f"{table}: {m}")
    # Training moved rows of every rank's block (the batches read the whole table).
    from mlkv_torch import initial_rows
    from mlkv_torch.torchrec.tables import table_seed
    initial = initial_rows(torch.arange(3001), 16, seed=table_seed(0, "t_rw"), num_embeddings=3001)
    moved = (torch.tensor(disk["rows"]["t_rw"]) != initial).any(1)
    assert all(bool(moved[r0:r0 + block].any()) for r0, _ in offsets)


def test_row_wise_tables_resumed_from_a_checkpoint_continue_as_the_uninterrupted_run(runs):
    # The checkpoint (torch.distributed.checkpoint) holds each rank's row shards and their row-wise
    # Adagrad accumulators at their offsets; loaded into empty storage, training goes on to the bit.
    uninterrupted, resumed = runs[(2, "rowwise_adagrad")]["disk"], runs[(2, "resume")]
    for rank in range(2):
        assert resumed["losses"][rank] == uninterrupted["losses"][rank]
    for table in ("t_mem", "t_rw", "t_twrw"):
        assert resumed["rows"][table] == uninterrupted["rows"][table], table


def test_replicas_of_hot_rows_of_row_wise_tables_at_bounds_zero_train_as_without_them(runs):
    # Hits are pooled from the replicas; misses and push bags reach the row blocks' ranks as a
    # variable batch, whose partial sums gloo reduces by an all-to-all (TorchRec's reduce-scatter-v
    # is NCCL's). Pooling a hit's rows in one sum, not per block, changes float order: rtol 1e-5.
    plain, replicated = runs[(2, "replicas")]["plain"], runs[(2, "replicas")]["replicas"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(replicated["losses"][rank]), torch.tensor(plain["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    for table in ("t_mem", "t_rw", "t_twrw"):
        torch.testing.assert_close(torch.tensor(replicated["rows"][table]), torch.tensor(plain["rows"][table]),
                                   rtol=0, atol=1e-6, msg=lambda m: f"{table}: {m}")
    for stats in replicated["stats"]:
        assert stats["replica_hits"] > 0.05 * stats["lookups"] and stats["push_rows"] > 0, stats
    sent = {kind: sum(rank[kind] for rank in replicated["sent"]) for kind in ("outputs", "gradients")}
    before = {kind: sum(rank[kind] for rank in plain["sent"]) for kind in ("outputs", "gradients")}
    assert all(sent[kind] < before[kind] for kind in sent), (sent, before)


def test_quantized_comms_with_disk_tables_train_as_in_memory_and_halve_the_bytes(runs):
    # TorchRec's codecs (fp16 forward, bf16 backward) on the all-to-alls and reduce-scatters: the
    # disk plan rounds its outputs and gradients as the plan in memory does.
    memory, disk = runs[(2, "qcomm")]["memory"], runs[(2, "qcomm")]["disk"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(disk["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    full = runs[(2, "sgd")]["disk"]  # the same plan, steps and batches in float32
    for kind in ("outputs", "gradients"):
        assert sum(r[kind] for r in disk["sent"]) * 2 == sum(r[kind] for r in full["sent"]) > 0, kind
    assert [r["ids"] for r in disk["sent"]] == [r["ids"] for r in full["sent"]]
    assert disk["losses"] != full["losses"]  # the rounding is there


def test_a_table_with_fewer_rows_than_ranks_is_refused_by_name(runs):
    message = runs[(2, "refusals")]["too_few_rows"]
    assert message.startswith("ValueError"), message
    assert "table 'tiny' has 1 rows, fewer than the 2 ranks it is sharded row_wise" in message, message
    assert "table-wise" in message


def test_a_mean_pooled_row_wise_table_trains_as_in_memory(runs):
    # Every table by rows, t_rw pooled by mean: its ranks pool sums, TorchRec divides them after the
    # reduce-scatter by the bag's length plus 1e-6 (its guard against empty bags): rtol 1e-5 covers it.
    memory, disk = runs[(2, "mean")]["memory"], runs[(2, "mean")]["disk"]
    assert {t: k[1] for t, k in disk["kernels"].items()} == {"t_mem": "row_wise", "t_rw": "row_wise",
                                                              "t_twrw": "table_row_wise"}
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(disk["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(disk["rows"]["t_rw"]), torch.tensor(memory["rows"]["t_rw"]),
                               rtol=1e-5, atol=1e-6)


def test_a_mean_pooled_row_wise_table_beside_a_table_wise_one_is_refused(runs):
    message = runs[(2, "refusals")]["mixed_mean"]
    assert message.startswith("ValueError"), message
    assert "tables ['t_rw'] pool by mean and are sharded by rows, beside tables ['t_mem']" in message, message


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_bytes_row_wise_tables_send_are_counted(runs, ranks):
    # Per step and table, a table-wise owner sends the other ranks their bags' pooled rows and gets
    # their gradients back: (ranks - 1) x BATCH rows. A row-wise table's every rank reduce-scatters
    # its partial sums of all ranks' bags, and all-gathers their gradients: ranks x that.
    from row_wise_worker import BATCH, DIM, STEPS
    run = runs[(ranks, "sgd")]["disk"]
    sent = {kind: sum(rank[kind] for rank in run["sent"]) for kind in ("ids", "outputs", "gradients")}
    rows = (ranks - 1) * BATCH * DIM * 4  # bytes
    assert sent["outputs"] == sent["gradients"] == STEPS * rows * (1 + ranks + ranks), sent
    assert sent["ids"] > 0


def test_a_dcp_checkpoint_of_two_ranks_loads_into_four_ranks_blocks_with_every_row_and_state(runs):
    # TorchRec users' own checkpoints (torch.distributed.checkpoint): the 2-rank job's, loaded by 4
    # ranks whose blocks of the row-wise and table-row-wise disk tables differ; DCP reads each new
    # block from the saved ones, and writing it into the disk tables' state dict fills their stores.
    saved, loaded = runs[(2, "resume")]["saved"], runs[(4, "resharded")]["loaded"]
    assert loaded["offsets"]["t_rw"] == [[751 * r, 0] for r in range(4)]  # 2 ranks held blocks of 1501
    for table in ("t_mem", "t_rw", "t_twrw"):
        assert torch.equal(torch.tensor(loaded["rows"][table]), torch.tensor(saved["rows"][table])), table
    assert sorted(loaded["state"]) == sorted(saved["state"]) and len(saved["state"]) == 3
    for key, state in saved["state"].items():
        assert torch.equal(torch.tensor(loaded["state"][key]), torch.tensor(state)), key
    losses = runs[(4, "resharded")]["losses"]
    assert len(losses) == 4 and all(len(r) == 4 and all(math.isfinite(x) for x in r) for r in losses)
