"""A torchrun worker for tests/test_cuda_training.py: DLRM under DistributedModelParallel on one GPU
(NCCL, world size 1) with every table on the disk kernel, sharded as asked (table_wise, row_wise,
table_row_wise), beside the same model under DMP on the CPU (a gloo group of the same process),
trained on the same batches. fbgemm ops that the installed fbgemm has no CUDA kernel for run through
the host (tests/workers/fbgemm_host_route.py); the JSON names them.

    torchrun --nproc_per_node 1 tests/workers/cuda_dmp_worker.py OUT_DIR SHARDING_TYPE

Writes OUT_DIR/cuda_dmp.json: each device's losses, the device of the CUDA model's output and of its
tables' caches; ("cuda_bf16_comms") the CUDA model with TorchRec's bf16 comms codecs on NCCL; and
("cuda_prefetch") the CUDA model trained through TorchRec's own
PrefetchTrainPipelineSparseDist on the same batches: its losses and the disk tables' statistics.
"""
import json
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fbgemm_host_route import ROUTED, route_fbgemm_ops_without_cuda_kernels
from mlkv_torch import optim
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder

DIM, BATCH, STEPS, LR = 16, 32, 10, 0.1
SIZES = {"t0": 300, "t1": 2000}
TABLES = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"])
          for name, n in SIZES.items()]


def build(device: torch.device, group: dist.ProcessGroup, storage_dir: str, sharding_type: str,
          train_model: bool = False, comms: Optional[CommType] = None):
    torch.manual_seed(0)  # the same dense layers on both devices: made on the CPU, then moved
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(TABLES, device=torch.device("meta")),
                 dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                 dense_device=torch.device("cpu"))
    if train_model:  # model(batch) -> (loss, output), as training pipelines call it
        model = DLRMTrain(model)
    codecs = {} if comms is None else {"qcomm_codecs_registry": get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=comms, backward_precision=comms))}
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=optim.SGD(lr=LR), **codecs)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[DISK_KERNEL])
                   for t in TABLES}
    planner = DiskAwarePlanner(topology=Topology(world_size=1, compute_device=device.type), batch_size=BATCH,
                               constraints=constraints)
    plan = planner.collective_plan(model, [sharder], group)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(group), device=device, plan=plan,
                                   sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(TABLES) * BATCH,), generator=g)
    values = torch.cat([torch.randint(0, 60, (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),), generator=g)
                        for i in range(len(TABLES))])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t.name}" for t in TABLES], values=values, lengths=lengths)
    dense, labels = torch.randn(BATCH, 4, generator=g), torch.randint(0, 2, (BATCH,), generator=g).float()
    return dense.to(device), sparse.to(device), labels.to(device)


def main() -> None:
    out_dir, sharding_type = sys.argv[1], sys.argv[2]
    route_fbgemm_ops_without_cuda_kernels()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    result = {}
    # "cuda_bf16_comms": TorchRec's quantized comms, bf16 both ways, on NCCL.
    for name, device, group, comms in (("cuda", torch.device("cuda:0"), dist.group.WORLD, None),
                                       ("cpu", torch.device("cpu"), dist.new_group(backend="gloo"), None),
                                       ("cuda_bf16_comms", torch.device("cuda:0"), dist.group.WORLD, CommType.BF16)):
        dmp, optimizer = build(device, group, os.path.join(out_dir, f"tables-{name}"), sharding_type, comms=comms)
        losses = []
        for step in range(STEPS):
            dense, sparse, labels = batch(step, device)
            optimizer.zero_grad()
            logits = dmp(dense, sparse).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        plan = dmp.plan.get_plan_for_module("sparse_arch.embedding_bag_collection")
        result[name] = {"losses": losses, "output_device": logits.device.type,
                        "sharding_types": sorted({p.sharding_type for p in plan.values()})}
    # TorchRec's prefetch pipeline on CUDA (its own streams): batch t+1's rows read ahead by the
    # sharded module's prefetch() during step t.
    dmp, optimizer = build(torch.device("cuda:0"), dist.group.WORLD, os.path.join(out_dir, "tables-prefetch"),
                           sharding_type, train_model=True)
    pipeline = PrefetchTrainPipelineSparseDist(dmp, optimizer, torch.device("cuda:0"))
    batches = iter([Batch(*batch(step, torch.device("cpu"))) for step in range(STEPS)])
    losses = [pipeline.progress(batches)[0].item() for _ in range(STEPS)]
    result["cuda_prefetch"] = {"losses": losses,
                               "stats": dmp.module.model.sparse_arch.embedding_bag_collection.stats()}
    result["routed_through_host"] = sorted(ROUTED)
    with open(os.path.join(out_dir, "cuda_dmp.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
