"""TorchRec's DLRM under DistributedModelParallel with the tables that do not fit in memory on
disk: the usual EmbeddingBagCollection on the meta device, with mlkv-torch's sharder and planner.
The largest table is sharded by rows, so every rank's disk serves a block of it.

    torchrun --nproc_per_node 2 examples/dmp.py [STORAGE_DIR]
"""
import sys
import tempfile

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import remove_tables
from mlkv_torch.ranks import exit_without_finalizing
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder
from mlkv_torch.torchrec.kernel import rank_storage_dir

DIM, BATCH, STEPS = 16, 256, 60
ROWS = {"t0": 2_000_000, "t1": 1_000_000, "t2": 1_000, "t3": 500}  # two large tables, two small ones


def batch(g: torch.Generator):
    """This rank's dense features, one id per table per sample, and labels that depend on the ids."""
    ids = [torch.randint(0, min(n, 1000), (BATCH,), generator=g) for n in ROWS.values()]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t}" for t in ROWS], values=torch.cat(ids),
                                                 lengths=torch.ones(len(ROWS) * BATCH, dtype=torch.int64))
    labels = ((ids[0] % 2) ^ (ids[2] % 3 == 0)).float()
    return torch.randn(BATCH, 13, generator=g), sparse, labels


def main(storage: str) -> None:
    dist.init_process_group("gloo")
    remove_tables(rank_storage_dir(storage, dist.get_rank()))  # this rank's from an earlier run: start afresh
    torch.manual_seed(0)  # the same dense layers on every rank
    tables = [EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{t}"])
              for t, n in ROWS.items()]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
                 dense_in_features=13, dense_arch_layer_sizes=[32, DIM], over_arch_layer_sizes=[32, 1],
                 dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.1})  # as usual
    # The changes: the disk sharder (where its shards live, how much of their bytes they may keep in
    # memory) and the planner that knows it; 40 MiB of host memory per rank for the tables.
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir=storage, memory_fraction=0.1)
    # TorchRec's constraints as usual: here, t0's rows spread over the ranks (each reads its block).
    planner = DiskAwarePlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu",
                                                 ddr_cap=40 << 20), batch_size=BATCH,
                               constraints={"t0": ParameterConstraints(sharding_types=["row_wise"])})
    plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.1))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        dense_features, sparse, labels = batch(g)
        opt.zero_grad()
        loss = loss_fn(dmp(dense_features, sparse).squeeze(1), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        tables = plan.plan["sparse_arch.embedding_bag_collection"]
        on_disk = sorted(t for t, p in tables.items() if p.compute_kernel == DISK_KERNEL)
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(f"tables on disk: {on_disk} ({', '.join(f'{t} {tables[t].sharding_type}' for t in on_disk)}); "
              f"loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="mlkv-example-dmp-") as folder:  # this rank's, removed at its end
            main(folder)
    # Without Python's teardown, where torch's gloo threads, still freeing the last backward's
    # allreduce, can abort the process (pytorch#190489; mlkv_torch.ranks says how).
    exit_without_finalizing(0)
