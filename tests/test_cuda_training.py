"""Training on CUDA: DiskEmbeddingBagCollection inside TorchRec's DLRM on the GPU against TorchRec's own
EmbeddingBagCollection there, and the runner's run on CUDA against the same run on the CPU (both skip
without a GPU); the runner's refusals of a device it cannot train on run everywhere."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from conftest import rounding_tolerance  # noqa: E402
from mlkv_torch import optim  # noqa: E402
from mlkv_torch.config import ConfigError, load_config  # noqa: E402
from mlkv_torch.train import run  # noqa: E402
from test_torchrec_collection import DIM, disk_copy_of, kjt, tables  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
SMALL = ["data.synthetic.scale=1000", "train.batch_size=256", "eval.batches=2", "storage.memory_budget_bytes=1048576",
         "train.log_every=1", "eval.every=12", "train.steps=12"]


@needs_gpu
def test_dlrm_with_the_disk_collection_on_cuda_trains_as_with_embedding_bag_collection(tmp_path):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(shared=False))
    disk = disk_copy_of(ebc, tmp_path, optimizer=optim.SGD(lr=0.05), device="cuda")
    arch = dict(dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    reference = DLRM(embedding_bag_collection=ebc, **arch).cuda()
    ours = DLRM(embedding_bag_collection=disk, **arch).cuda()
    ours.load_state_dict({k: v for k, v in reference.state_dict().items() if "embedding_bags" not in k},
                         strict=False)
    assert disk.device.type == "cuda"
    optimizers = [torch.optim.SGD(reference.parameters(), lr=0.05),
                  torch.optim.SGD([p for n, p in ours.named_parameters() if "embedding_bags" not in n], lr=0.05)]
    # The GPU's embedding-bag backward adds a repeated id's gradients in its own order (atomics): a
    # few roundings of each step's update (conftest.rounding_tolerance), SGD's step bounded by 1.
    steps = 30
    tolerance = rounding_tolerance(steps, 0.05, 1.0)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        dense = torch.randn(6, 4, generator=g).cuda()
        labels = torch.randint(0, 2, (6,), generator=g).float().cuda()
        features = kjt(100 + step).to(torch.device("cuda"))
        losses = []
        for model, optimizer in zip((reference, ours), optimizers):
            optimizer.zero_grad()
            loss = loss_fn(model(dense, features).squeeze(1), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        assert losses[1].device.type == "cuda"
        torch.testing.assert_close(losses[1], losses[0], **tolerance, msg=f"step {step}")
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(disk.embedding_bags[name].weight.to_dense().cpu(), bag.weight.detach().cpu(),
                                   **tolerance, msg=f"table {name}")


def assert_losses_follow(cuda, cpu):
    """The dense layers' sums run in cuBLAS's order on the GPU and MKL's on the CPU, and the tables'
    gradients are added in another order: each step rounds differently, and the differences carry
    into the next steps through the weights. 1e-5 of the loss a step (about 170 roundings of float32,
    more than the widest layer's fan-in) bounds that; a wrong row or a skipped update moves the loss
    by far more."""
    assert len(cuda) == len(cpu)
    for step, (ours, reference) in enumerate(zip(cuda, cpu)):
        assert abs(ours - reference) <= 1e-5 * (step + 1) * abs(reference), \
            f"step {step + 1}: {ours} on CUDA, {reference} on the CPU"


def _losses(out: Path):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@needs_gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_the_runner_on_cuda_follows_the_same_run_on_the_cpu(tmp_path, optimizer):
    summaries, losses = {}, {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        config = load_config(QUICKSTART, [f"output_dir={out}", f"device={device}", f"train.optimizer={optimizer}",
                                          *SMALL])
        summaries[device] = run(config, progress=False)
        losses[device] = _losses(out)
    assert len(losses["cuda"]) == 12
    assert_losses_follow(losses["cuda"], losses["cpu"])
    assert summaries["cuda"]["device"] == "cuda"
    assert summaries["cuda"]["auc"] == pytest.approx(summaries["cpu"]["auc"], abs=2e-3)


def test_the_runner_refuses_a_device_it_cannot_train_on(tmp_path):
    with pytest.raises(ConfigError, match="storage kind memory"):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", "device=cuda", "storage.kind=memory"])
    with pytest.raises(ConfigError, match="device"):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", "device=tpu"])
    with pytest.raises(ConfigError, match="in_memory_tables false puts every table on disk"):
        load_config(QUICKSTART, [f"output_dir={tmp_path}", "storage.kind=memory", "storage.in_memory_tables=false"])
    if not torch.cuda.is_available():
        config = load_config(QUICKSTART, [f"output_dir={tmp_path / 'run'}", "device=cuda", *SMALL])
        with pytest.raises(ConfigError, match="torch sees no GPU"):
            run(config, progress=False)


@needs_gpu
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "table_row_wise"])
def test_dmp_with_nccl_on_one_gpu_trains_disk_tables_as_on_the_cpu(tmp_path, sharding_type):
    worker = Path(__file__).parent / "workers" / "cuda_dmp_worker.py"
    repo = str(worker.parents[1])  # an in-place build (the GPU machine's) is imported from the checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(worker), str(tmp_path), sharding_type],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "cuda_dmp.json").read_text())
    assert result["cuda"]["output_device"] == "cuda"
    assert result["cuda"]["sharding_types"] == result["cpu"]["sharding_types"] == [sharding_type]
    assert_losses_follow(result["cuda"]["losses"], result["cpu"]["losses"])
    # TorchRec's bf16 codecs on the NCCL all-to-alls: each pooled output and gradient rounded to 8 bits
    # of mantissa (2^-9 relative), which the loss follows to within 2% over these 10 steps.
    for ours, reference in zip(result["cuda_bf16_comms"]["losses"], result["cuda"]["losses"]):
        assert abs(ours - reference) <= 0.02 * abs(reference), (result["cuda_bf16_comms"], result["cuda"])
    # TorchRec's own PrefetchTrainPipelineSparseDist on CUDA: the disk tables read the next batch's
    # rows ahead (its prefetch() one batch ahead), and training follows the plain loop.
    prefetch = result["cuda_prefetch"]
    assert_losses_follow(prefetch["losses"], result["cuda"]["losses"])
    assert all(stats["read_ahead_rows"] > 0 for stats in prefetch["stats"].values()), prefetch["stats"]


def test_a_rank_trains_on_the_gpu_of_its_local_rank_over_nccl_and_a_config_that_cannot_is_refused():
    from mlkv_torch.train.placement import choose_placement

    assert choose_placement("cpu", True, 1, 2, gpus=8) == choose_placement("cpu", False, 0, 1, gpus=0)
    assert choose_placement("cpu", True, 1, 2, gpus=8).device == torch.device("cpu")
    assert choose_placement("cpu", True, 1, 2, gpus=8).backend == "gloo"
    placed = choose_placement("cuda", True, 3, 8, gpus=8)
    assert (placed.device, placed.backend) == (torch.device("cuda", 3), "nccl")
    assert choose_placement("cuda", False, 0, 1, gpus=1).device.type == "cuda"  # one process: no group of its own
    with pytest.raises(ConfigError, match=r"4 ranks on this node .* and 2 GPUs here"):
        choose_placement("cuda", True, 0, 4, gpus=2)
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        choose_placement("cuda", True, 0, 1, gpus=0)


def test_torchrun_with_more_ranks_than_gpus_is_refused_on_every_rank_before_training(tmp_path):
    ranks = torch.cuda.device_count() + 1
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(ranks), "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={tmp_path}",
                           "device=cuda", *SMALL], capture_output=True, text=True, timeout=300,
                          cwd=QUICKSTART.parents[1])
    assert done.returncode != 0
    expected = "torch sees no GPU" if ranks == 1 else f"{ranks} ranks on this node"
    assert done.stderr.count(f"config error: device cuda: {expected}") == ranks, done.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_the_runner_under_torchrun_follows_the_one_process_run(tmp_path, device):
    # One rank of DistributedModelParallel over the default group the runner chooses (NCCL on a
    # GPU, gloo on the CPU), its own collectives over a gloo group of their own, every table on disk
    # as in one process: the same model, trained as the one-process run trains it.
    worker = Path(__file__).parent / "workers" / "runner_on_ranks.py"
    overrides = [f"device={device}", "storage.in_memory_tables=false", *SMALL]
    repo = str(worker.parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, str(worker.parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(worker), str(QUICKSTART), f"output_dir={tmp_path / 'ranks'}", *overrides],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    on_ranks = json.loads(done.stdout.strip().splitlines()[-1])
    assert (on_ranks["backend"], on_ranks["device"]) == ({"cpu": "gloo", "cuda": "nccl"}[device], device)
    one = run(load_config(QUICKSTART, [f"output_dir={tmp_path / 'one'}", *overrides]), progress=False)
    got, expected = _losses(tmp_path / "ranks"), _losses(tmp_path / "one")
    assert len(got) == 12
    if device == "cpu":  # the same kernels in the same order
        assert got == pytest.approx(expected, rel=1e-6)
    else:  # DDP's and the pipeline's order on the GPU
        assert_losses_follow(got, expected)
    assert on_ranks["auc"] == pytest.approx(one["auc"], abs=2e-3)
