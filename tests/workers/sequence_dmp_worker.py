"""A torchrun worker for tests/torchrec_integration/test_sequence_dmp.py: a sequence model (an EmbeddingCollection and a
per-id head) under DistributedModelParallel (gloo, CPU) with disk tables sharded table-wise,
row-wise and column-wise, against the same plan with every table in TorchRec's memory.

    torchrun --nproc_per_node N tests/workers/sequence_dmp_worker.py OPTIMIZER[,OPTIMIZER...] OUT_DIR

For each optimizer ("sgd" through the sharder; "rowwise_adagrad" through apply_optimizer_in_backward;
"qcomm": SGD with TorchRec's quantized comms on the sequence all-to-alls, fp16 forward and bf16
backward) both plans train STEPS steps from the same initial rows and batches; rank 0 writes
OUT_DIR/<optimizer>.json: each plan's losses per rank, the bytes its embeddings' all-to-alls sent,
kernels and sharding types, every table's trained rows (assembled from the ranks' shards of the
state dict) and the disk shards' statistics. Then OUT_DIR/refusals.json: what sharding a table of
fewer rows than ranks by rows on disk says.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dmp_worker import DIM, set_initial_rows, trained_rows
from row_wise_worker import quantized_comms
from mlkv_torch import optim
from mlkv_torch.ranks import all_gather_objects
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingCollectionSharder
from mlkv_torch.wire import EmbeddingTraffic

BATCH, STEPS, LR = 6, 6, 0.1
SHARDING = {"t_tw": "table_wise", "t_rw": "row_wise", "t_cw": "column_wise"}
SIZES = {"t_tw": 500, "t_rw": 3001, "t_cw": 800}  # t_rw's last row block is shorter
TABLES = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"])
          for name, n in SIZES.items()]
COLLECTION = "collection"


class SequenceModel(torch.nn.Module):
    """Each id's embedding through one linear head; a sample's logit sums its ids' over every feature."""

    def __init__(self, collection: torch.nn.Module) -> None:
        super().__init__()
        self.collection = collection
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        logits = torch.zeros(features.stride())
        for jagged in self.collection(features).values():
            per_id = self.head(jagged.values()).squeeze(1)
            sample = torch.repeat_interleave(torch.arange(jagged.lengths().numel()), jagged.lengths())
            logits = logits.index_add(0, sample, per_id)
        return logits


def build(on_disk: bool, optimizer: str, storage_dir: str, tables=TABLES, sharding=SHARDING):
    comms = quantized_comms() if optimizer == "qcomm" else {}
    torch.manual_seed(0)  # the same head in every build
    collection = EmbeddingCollection(tables, device=torch.device("meta"))
    model = SequenceModel(collection)
    if optimizer == "rowwise_adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, collection.embeddings.parameters(), {"lr": LR, "eps": 1e-8})
        sharder = DiskEmbeddingCollectionSharder(storage_dir, **comms)
    else:
        sharder = DiskEmbeddingCollectionSharder(storage_dir, optimizer=optim.SGD(lr=LR), **comms)
    kernel = [DISK_KERNEL] if on_disk else ["fused"]
    # Column-wise: two shards of 8 columns, one per rank.
    constraints = {name: ParameterConstraints(sharding_types=[kind], compute_kernels=kernel, min_partition=DIM // 2)
                   for name, kind in sharding.items()}
    planner = DiskAwarePlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                               batch_size=BATCH, constraints=constraints)
    plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def batch(step: int):
    """This rank's part of a batch: sequences of up to 5 ids over the whole table (every rank's
    block is read), half from a hot head so rows recur."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = torch.randint(0, 6, (len(TABLES) * BATCH,), generator=g)
    values = []
    for i, t in enumerate(TABLES):
        n = int(lengths[i * BATCH:(i + 1) * BATCH].sum())
        values.append(torch.where(torch.rand(n, generator=g) < 0.5, torch.randint(0, 40, (n,), generator=g),
                                  torch.randint(0, SIZES[t.name], (n,), generator=g)))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t.name}" for t in TABLES], values=torch.cat(values),
                                                 lengths=lengths)
    return sparse, torch.randint(0, 2, (BATCH,), generator=g).float()


def train_step(dmp, opt, step: int) -> float:
    features, labels = batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(features), labels)
    loss.backward()
    opt.step()
    return float(loss)


def too_few_rows(storage_dir: str) -> str:
    """What sharding a table of fewer rows than ranks row-wise on disk says (every rank raises)."""
    tiny = [EmbeddingConfig(name="tiny", embedding_dim=DIM, num_embeddings=dist.get_world_size() - 1,
                            feature_names=["f_tiny"])]
    try:
        build(True, "sgd", storage_dir, tables=tiny, sharding={"tiny": "row_wise"})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "built"


def main() -> None:
    optimizers, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    for optimizer in optimizers:
        result = {}
        for on_disk in (False, True):
            dmp, opt, plan = build(on_disk, optimizer, os.path.join(out_dir, f"store-{optimizer}-{on_disk}"))
            set_initial_rows(dmp, COLLECTION, SIZES, tables_attribute="embeddings")
            with EmbeddingTraffic() as traffic:  # what the training steps send between ranks
                losses = [train_step(dmp, opt, step) for step in range(STEPS)]
            sharded = dmp.module.collection
            result["disk" if on_disk else "memory"] = {
                "losses": all_gather_objects(losses), "sent": all_gather_objects(traffic.bytes),
                "kernels": {t: [p.compute_kernel, p.sharding_type,
                                [list(s.shard_offsets) for s in p.sharding_spec.shards]]
                            for t, p in plan.plan[COLLECTION].items()},
                "rows": trained_rows(dmp, COLLECTION, SIZES, tables_attribute="embeddings"),
                "stats": all_gather_objects(sharded.stats() if on_disk else {})}
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{optimizer}.json"), "w") as f:
                json.dump(result, f)
    refusals = {"too_few_rows": too_few_rows(os.path.join(out_dir, "store-small"))}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "refusals.json"), "w") as f:
            json.dump(refusals, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
