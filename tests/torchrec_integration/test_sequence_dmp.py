"""An EmbeddingCollection's disk tables under DistributedModelParallel: 2 real processes under
torchrun (gloo, CPU), table-wise, row-wise and column-wise, against the same plan with every table
in TorchRec's memory (TorchRec's own sequence shardings and fused kernel; tests/workers/sequence_dmp_worker.py).

Each id is looked up on one rank and its embedding sent back, nothing is summed across ranks, and
each row's gradients are summed over its ids by both kernels: measured equal to the bit here. The
claim is float32 rounding (rtol 1e-5), as fbgemm's CPU kernels may round the update differently
(a fused multiply-add or not) from one build to another.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

WORKER = Path(__file__).parents[1] / "workers" / "sequence_dmp_worker.py"
OPTIMIZERS = ["sgd", "rowwise_adagrad"]
MODES = OPTIMIZERS + ["qcomm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           ",".join(MODES), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return {name: json.loads((out / f"{name}.json").read_text()) for name in MODES + ["refusals"]}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sequence_disk_tables_train_as_torchrecs_own_shardings_in_memory(runs, optimizer):
    memory, disk = runs[optimizer]["memory"], runs[optimizer]["disk"]
    for table, sharding in (("t_tw", "table_wise"), ("t_rw", "row_wise"), ("t_cw", "column_wise")):
        assert disk["kernels"][table][:2] == ["customized_kernel", sharding]
        assert memory["kernels"][table] == ["fused"] + disk["kernels"][table][1:]  # the same shards
    assert disk["kernels"]["t_rw"][2] == [[0, 0], [1501, 0]]  # TorchRec's blocks: ceil(3001 / 2)
    assert disk["kernels"]["t_cw"][2] == [[0, 0], [0, 8]]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(disk["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    for table, reference in memory["rows"].items():
        trained = torch.tensor(disk["rows"][table])
        assert not trained.isnan().any(), f"{table}: some rows are in no rank's shard"
        torch.testing.assert_close(trained, torch.tensor(reference), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{table}: {m}")
    # Every shard of every table was trained and its rows went through its store.
    shards = {name: stats for rank in disk["stats"] for name, stats in rank.items()}
    assert sorted(shards) == ["t_cw_rows0_cols0", "t_cw_rows0_cols8", "t_rw_rows0_cols0", "t_rw_rows1501_cols0",
                              "t_tw_rows0_cols0"]
    assert all(stats["disk_rows"] > 0 for stats in shards.values()), shards


def test_quantized_comms_halve_the_sequence_all_to_alls_and_train_as_torchrecs_own(runs):
    # TorchRec's codecs (fp16 forward, bf16 backward) on the sequence embeddings' all-to-alls: the
    # disk plan against the same plan in TorchRec's memory with the same codecs.
    memory, disk = runs["qcomm"]["memory"], runs["qcomm"]["disk"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(disk["losses"][rank]), torch.tensor(memory["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
    full = runs["sgd"]["disk"]  # the same plan, steps and batches in float32
    for kind in ("outputs", "gradients"):
        assert sum(r[kind] for r in disk["sent"]) * 2 == sum(r[kind] for r in full["sent"]) > 0, kind
    assert [r["ids"] for r in disk["sent"]] == [r["ids"] for r in full["sent"]]
    assert disk["losses"] != full["losses"]  # the rounding is there


def test_a_table_with_fewer_rows_than_ranks_is_refused_row_wise(runs):
    assert runs["refusals"]["too_few_rows"].startswith(
        "ValueError: table 'tiny' has 1 rows, fewer than the 2 ranks it is sharded row_wise over")
