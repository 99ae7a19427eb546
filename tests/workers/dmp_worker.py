"""A torchrun worker for tests/torchrec_integration/test_torchrec_dmp.py: DLRM under DistributedModelParallel
(gloo, CPU) with TorchRec's in-memory kernels and with disk tables chosen through DiskAwarePlanner.

    torchrun --nproc_per_node 2 tests/workers/dmp_worker.py PHASE[,PHASE...] OUT_DIR

Phases (rank 0 writes OUT_DIR/<phase>.json):
- equivalence: per optimizer, the losses of the all-in-memory plan and of the mixed plan (t1
  table-wise and t3 column-wise on disk), from the same initial rows and batches, with a
  learning-rate change through dmp.fused_optimizer halfway, and the bytes each rank's training
  steps sent to the other (mlkv_torch.wire.EmbeddingTraffic).
- save: the mixed plan (row-wise Adagrad) trains SAVE_AT steps, saves a checkpoint
  (torch.distributed.checkpoint) and is killed (SIGKILL, no cleanup).
- resume: a new job, with empty storage, loads that checkpoint and trains the remaining steps;
  the equivalence phase's run of the same plan is the uninterrupted job to compare with.
- pipeline: the mixed plan (SGD) through the plain loop, TorchRec's TrainPipelineSparseDist and
  PrefetchPipeline (TorchRec's PrefetchTrainPipelineSparseDist), on the same batches: losses and the
  disk tables' statistics; and what TorchRec's own prefetch pipeline does on the CPU.
- unsharded: the one-process DiskEmbeddingBagCollection built in a 2-rank job (refused, naming the sharder).
"""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import initial_rows, optim
from mlkv_torch.ranks import all_gather_objects
from mlkv_torch.torchrec import (DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollection,
                                 DiskEmbeddingBagCollectionSharder)
from mlkv_torch.torchrec.prefetch_pipeline import PrefetchPipeline
from mlkv_torch.torchrec.tables import table_seed
from mlkv_torch.wire import EmbeddingTraffic

DIM, BATCH, STEPS, SAVE_AT, LR, HOT_IDS = 16, 8, 8, 4, 0.1, 40
SIZES = {"t0": 50, "t1": 3000, "t2": 400, "t3": 5000}
TABLES = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"])
          for name, n in SIZES.items()]


def constraints(mixed: bool):
    memory, disk = ["fused"], [DISK_KERNEL]
    return {
        "t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=memory),
        "t1": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=disk if mixed else memory),
        "t2": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=memory),
        "t3": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=disk if mixed else memory,
                                   min_partition=DIM // 2),
    }


def build(mixed: bool, optimizer: str, storage_dir: str, train_model: bool = False, **settings):
    torch.manual_seed(0)  # the same dense layers in every build
    ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1], dense_device=torch.device("cpu"))
    if train_model:  # model(batch) -> (loss, output), as training pipelines call it
        model = DLRMTrain(model)
    if optimizer == "rowwise_adagrad":  # TorchRec's way: an in-backward optimizer on the tables
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.embedding_bags.parameters(), {"lr": LR, "eps": 1e-8})
        sharder = DiskEmbeddingBagCollectionSharder(storage_dir, **settings)
    else:  # an mlkv_torch rule on the sharder, which the in-memory tables share
        sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=optim.SGD(lr=LR), **settings)
    planner = DiskAwarePlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                               batch_size=BATCH, constraints=constraints(mixed))
    plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def set_initial_rows(dmp, collection: str = "sparse_arch.embedding_bag_collection", sizes=None,
                     tables_attribute: str = "embedding_bags") -> None:
    """Every table (`sizes`: rows by name, default this worker's), in memory or on disk, starts from
    mlkv_torch.initial_rows: each rank fills its local shards through the state dict (`collection`:
    the collection's name in it; `tables_attribute`: where it keeps its tables, as TorchRec's)."""
    state = dmp.state_dict()
    for name, n in (sizes or SIZES).items():
        full = initial_rows(torch.arange(n), DIM, seed=table_seed(0, name), num_embeddings=n)
        for shard in state[f"{collection}.{tables_attribute}.{name}.weight"].local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r0:r0 + rows, c0:c0 + cols])
    dmp.load_state_dict(state)


def trained_rows(dmp, collection: str, sizes, tables_attribute: str = "embedding_bags") -> dict:
    """Every table's rows, assembled on every rank from every rank's shards of the state dict (the
    arguments as `set_initial_rows`'); rows in no rank's shard are NaN."""
    state = dmp.state_dict()
    local = {name: [(list(s.metadata.shard_offsets), s.tensor.detach().clone().tolist())
                    for s in state[f"{collection}.{tables_attribute}.{name}.weight"].local_shards()]
             for name in sizes}
    tables = {}
    for name, n in sizes.items():
        full = torch.full((n, DIM), float("nan"))
        for rank_shards in all_gather_objects(local[name]):
            for (r0, c0), rows in rank_shards:
                block = torch.tensor(rows)
                full[r0:r0 + block.shape[0], c0:c0 + block.shape[1]] = block
        tables[name] = full.tolist()
    return tables


def batch(step: int, hot_ids: int = HOT_IDS):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = torch.randint(0, 4, (len(TABLES) * BATCH,), generator=g)
    # Ids from a hot range, so rows recur and their optimizer state matters.
    values = torch.cat([torch.randint(0, min(hot_ids, SIZES[t.name]), (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),),
                                      generator=g) for i, t in enumerate(TABLES)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t.name}" for t in TABLES], values=values, lengths=lengths)
    return torch.randn(BATCH, 4, generator=g), sparse, torch.randint(0, 2, (BATCH,), generator=g).float()


def train_step(dmp, opt, step: int) -> float:
    if step == STEPS // 2:  # a schedule: the learning rate reaches every table through the optimizers
        for group in opt.param_groups:
            group["lr"] = LR / 4
    return step_on(dmp, opt, *batch(step))


def step_on(dmp, opt, dense, sparse, labels) -> float:
    """One training step of DLRM on a batch; its loss."""
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, sparse).squeeze(1), labels)
    loss.backward()
    opt.step()
    return float(loss)


def gathered(losses):
    return all_gather_objects(losses)  # not a gloo collective: see mlkv_torch.ranks


def run_phase(phase: str, out_dir: str) -> dict:
    """One phase (see the module's docstring); its result."""
    result = {}
    if phase == "equivalence":
        for optimizer in ("sgd", "rowwise_adagrad"):
            for mixed in (False, True):
                dmp, opt, plan = build(mixed, optimizer, os.path.join(out_dir, f"store-{optimizer}-{mixed}"))
                kernels = {t: [p.compute_kernel, p.sharding_type, len(p.sharding_spec.shards)]
                           for t, p in plan.plan["sparse_arch.embedding_bag_collection"].items()}
                set_initial_rows(dmp)
                with EmbeddingTraffic() as traffic:  # what the training steps send between ranks
                    losses = [train_step(dmp, opt, step) for step in range(STEPS)]
                result[f"{optimizer}/{'mixed' if mixed else 'memory'}"] = {"losses": gathered(losses),
                                                                          "kernels": kernels,
                                                                          "sent": gathered(traffic.bytes)}
    elif phase == "pipeline":
        # TorchRec's TrainPipelineSparseDist (input distribution of batch t+1 overlapped with step t)
        # and PrefetchPipeline (TorchRec's PrefetchTrainPipelineSparseDist, which also reads batch
        # t+1's disk rows ahead) over the mixed plan, against the plain loop on the same batches.
        # "prefetch-into-slots": rows read ahead into cache slots (CUDA's default), each forward
        # pooling from the read-ahead its prefetch queued.
        for kind in ("plain", "pipelined", "prefetch", "prefetch-into-slots"):
            into_slots = {"read_ahead_into_slots": True, "memory_fraction": 1.0} if kind.endswith("slots") else {}
            dmp, opt, _ = build(True, "sgd", os.path.join(out_dir, f"store-pipeline-{kind}"), train_model=True,
                                **into_slots)
            set_initial_rows(dmp, "model.sparse_arch.embedding_bag_collection")
            batches = [Batch(*batch(step)) for step in range(STEPS)]
            losses = []
            if kind == "plain":
                for b in batches:
                    opt.zero_grad()
                    loss, _ = dmp(b)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss))
            else:
                kinds = {"pipelined": TrainPipelineSparseDist, "prefetch": PrefetchPipeline,
                         "prefetch-into-slots": PrefetchPipeline}
                pipeline, it = kinds[kind](dmp, opt, torch.device("cpu")), iter(batches)
                for _ in range(STEPS):
                    losses.append(float(pipeline.progress(it)[0]))
            stats = dmp.module.model.sparse_arch.embedding_bag_collection.stats()
            result[kind] = {"losses": gathered(losses), "stats": gathered(stats)}
        try:  # TorchRec's own, on the CPU: why PrefetchPipeline exists
            dmp, opt, _ = build(True, "sgd", os.path.join(out_dir, "store-pipeline-torchrec"), train_model=True)
            pipeline = PrefetchTrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
            pipeline.progress(iter([Batch(*batch(step)) for step in range(3)]))
            result["torchrec_prefetch_on_cpu"] = "trained"
        except Exception as e:  # noqa: BLE001 - the message is the result
            result["torchrec_prefetch_on_cpu"] = f"{type(e).__name__}: {e}"
    elif phase == "unsharded":  # the one-process collection swapped in under torchrun: told what to do
        try:
            DiskEmbeddingBagCollection(TABLES, path=os.path.join(out_dir, f"unsharded-{dist.get_rank()}"),
                                       optimizer=optim.SGD(lr=LR))
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e)
    elif phase == "save":
        dmp, opt, _ = build(True, "rowwise_adagrad", os.path.join(out_dir, "store-save"))
        set_initial_rows(dmp)
        for step in range(SAVE_AT):
            train_step(dmp, opt, step)
        dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(out_dir, "checkpoint"))
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # the job dies here: no close, no flush
    elif phase == "resume":
        dmp, opt, _ = build(True, "rowwise_adagrad", os.path.join(out_dir, "store-resume"))
        state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(out_dir, "checkpoint"))
        dmp.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        result["losses"] = gathered([train_step(dmp, opt, step) for step in range(SAVE_AT, STEPS)])
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    return result


def main() -> None:
    phases, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    for phase in phases:  # one job runs several: each job's start (torch, the process group) is seconds
        result = run_phase(phase, out_dir)
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
