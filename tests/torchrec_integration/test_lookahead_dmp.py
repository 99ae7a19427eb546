"""LookaheadPipeline under DistributedModelParallel: 2 real processes under torchrun (gloo, CPU).

tests/workers/lookahead_dmp_worker.py trains DLRM (DLRMTrain) with the mixed plan of
tests/workers/dmp_worker.py (a table-wise and a column-wise table on disk, row-wise Adagrad) with the
plain loop and with the pipeline at depths 0, 1, 3 and "auto", and at depth 3 with rows read ahead
into cache slots. The losses must equal the plain loop's exactly on every rank, and at depth >= 1
the disk shards of every rank must have served rows read ahead (read-ahead hits), which only a
lookahead on the distributed ids produces; into slots, every batch is pooled from the read-ahead
the pipeline named for it. A
lookahead on features in another order than the forward's is refused, not misrouted.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

WORKER = Path(__file__).parents[1] / "workers" / "lookahead_dmp_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lookahead_dmp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"worker failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads((out / "lookahead.json").read_text())


@pytest.mark.parametrize("depth", ["0", "1", "3", "auto"])
def test_training_equals_the_plain_loop_and_rows_are_read_ahead(runs, depth):
    plain, piped = runs["plain"], runs[depth]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(piped["losses"][rank]), torch.tensor(plain["losses"][rank]),
                                   rtol=0, atol=0)
        stats = piped["pipeline"][rank]
        assert stats["disk_collections"] == 1
        assert piped["disk_shards"][rank] > 0, "the plan puts a disk shard on every rank"
        if depth == "0":
            assert piped["read_ahead_hits"][rank] == piped["read_ahead_rows"][rank] == 0
            assert stats["lookahead_ms"] == 0
        else:
            assert piped["read_ahead_hits"][rank] > 0, f"rank {rank}: rows of future batches must be read ahead"
            assert stats["lookahead_ms"] > 0
    assert plain["read_ahead_hits"] == [0, 0]
    assert piped["read_ahead_lookups"] == [0, 0]  # not into slots: each lookup finds its rows by key


def test_into_slots_each_batch_is_pooled_from_the_read_ahead_the_pipeline_names(runs):
    # As on CUDA by default: the pipeline names each batch's read-ahead as it enters the step, and
    # the disk kernels pool from it (its deduplication and slots: on CUDA no host synchronisation).
    plain, piped = runs["plain"], runs["3-into-slots"]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(piped["losses"][rank]), torch.tensor(plain["losses"][rank]),
                                   rtol=0, atol=0)
        # Each step, on each of the rank's disk shards (the plan's two disk tables, a table-wise and
        # a column-wise one, split over the ranks); a batch with a row left out of its slots (one
        # written back while it was read: timing decides) is fetched by key instead.
        steps = 24 * piped["disk_shards"][rank]
        assert steps >= piped["read_ahead_lookups"][rank] >= 0.75 * steps, piped["read_ahead_lookups"]


def test_auto_depth_is_agreed_by_all_ranks(runs):
    ranks = runs["auto"]["pipeline"]
    assert ranks[0]["depth"] == ranks[1]["depth"] and 1 <= ranks[0]["depth"] <= 8
    # The ranks chose from the same (largest) latency.
    assert ranks[0]["read_ahead_latency_ms"] == ranks[1]["read_ahead_latency_ms"] > 0
    assert all(r["step_ms"] > 0 for r in ranks)


@pytest.mark.parametrize("mode", ["plain", "1"])
def test_lookahead_on_features_the_forward_does_not_get_is_refused(runs, mode):
    assert runs[mode]["refuses_other_keys"] == [True, True]
