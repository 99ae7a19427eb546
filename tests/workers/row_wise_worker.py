"""A torchrun worker for tests/torchrec_integration/test_row_wise.py: DLRM under DistributedModelParallel (gloo, CPU)
with row-wise and table-row-wise disk tables, against the same model with every table in
TorchRec's memory, table-wise.

    torchrun --nproc_per_node N tests/workers/row_wise_worker.py OPTIMIZER[,OPTIMIZER...] OUT_DIR

For each optimizer ("sgd"; "rowwise_adagrad" through apply_optimizer_in_backward; "mean": SGD with
a mean-pooled row-wise table, every table by rows; "qcomm": SGD with TorchRec's quantized comms,
fp16 forward and bf16 backward), both plans train STEPS steps from the same
initial rows and batches; rank 0 writes OUT_DIR/<optimizer>.json: each plan's losses per rank, its
kernels and sharding types, and every table's trained rows (assembled from the ranks' shards of
the state dict). "resume" instead: the disk plan with row-wise Adagrad trains SAVE_AT steps and saves
a checkpoint (torch.distributed.checkpoint); a new model with empty storage loads it and trains the
rest; OUT_DIR/resume.json holds the losses of both parts, the trained rows, and the rows and optimizer
state saved. "resharded": that checkpoint (DCP_CHECKPOINT) loaded by another number of ranks, its
plan's blocks other than the saving run's; the rows and optimizer state loaded, then the losses of
the rest. "replicas": the disk
plan with SGD, REPLICA_STEPS steps without and with replicas of hot rows at bounds 0; their losses,
rows, the replicas' statistics and the bytes sent. Then OUT_DIR/refusals.json: what sharding a table
of fewer rows than ranks by rows, and a mean-pooled row-wise table beside a table-wise one, say.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dmp_worker import set_initial_rows, step_on
from dmp_worker import trained_rows as rows_of_every_rank
from mlkv_torch import optim
from mlkv_torch.ranks import all_gather_objects
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder
from mlkv_torch.torchrec.replicas import ReplicaSettings, replicate_hot_rows
from mlkv_torch.wire import EmbeddingTraffic

DIM, BATCH, STEPS, SAVE_AT, LR = 16, 8, 8, 4, 0.1
REPLICA_STEPS = 12  # hot rows chosen at steps 2, 5, 8 and 11


def quantized_comms() -> dict:
    """The sharder's arguments for TorchRec's quantized comms: fp16 forward, bf16 backward."""
    return {"qcomm_codecs_registry": get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16))}
# t_rw's rows do not divide evenly by the ranks: its last block is shorter.
SIZES = {"t_mem": 60, "t_rw": 3001, "t_twrw": 2000}
TABLES = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"])
          for name, n in SIZES.items()]
# OPTIMIZER "mean": SGD, t_rw pooling by mean (its ranks pool sums, which TorchRec divides after the
# reduce-scatter), and every table on disk row-wise: TorchRec's mean callback divides every table of
# the collection, so one that is not row-wise cannot share it (see `mixed_mean`).
MEAN_TABLES = [EmbeddingBagConfig(name=t.name, embedding_dim=DIM, num_embeddings=t.num_embeddings,
                                  feature_names=t.feature_names,
                                  pooling=PoolingType.MEAN if t.name == "t_rw" else PoolingType.SUM) for t in TABLES]
COLLECTION = "sparse_arch.embedding_bag_collection"


def constraints(on_disk: bool, all_row_wise: bool = False):
    memory, disk = ["fused"], [DISK_KERNEL]
    if not on_disk:
        return {name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=memory) for name in SIZES}
    return {"t_mem": ParameterConstraints(sharding_types=["row_wise" if all_row_wise else "table_wise"],
                                          compute_kernels=disk if all_row_wise else memory),
            "t_rw": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=disk),
            "t_twrw": ParameterConstraints(sharding_types=["table_row_wise"], compute_kernels=disk)}


def build(on_disk: bool, optimizer: str, storage_dir: str, **sharder_args):
    torch.manual_seed(0)  # the same dense layers in every build
    ebc = EmbeddingBagCollection(MEAN_TABLES if optimizer == "mean" else TABLES, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1], dense_device=torch.device("cpu"))
    if optimizer == "rowwise_adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.embedding_bags.parameters(), {"lr": LR, "eps": 1e-8})
        sharder = DiskEmbeddingBagCollectionSharder(storage_dir, **sharder_args)
    else:
        sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=optim.SGD(lr=LR), **sharder_args)
    planner = DiskAwarePlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                               batch_size=BATCH, constraints=constraints(on_disk, optimizer == "mean"))
    plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def trained_rows(dmp):
    """Every table's rows, assembled from every rank's shards of the state dict."""
    return rows_of_every_rank(dmp, COLLECTION, SIZES)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = torch.randint(0, 4, (len(TABLES) * BATCH,), generator=g)
    # Ids over the whole table (every rank's block is read) with a hot head, so rows recur.
    values = torch.cat([torch.where(torch.rand(int(lengths[i * BATCH:(i + 1) * BATCH].sum()), generator=g) < 0.5,
                                    torch.randint(0, 40, (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),), generator=g),
                                    torch.randint(0, SIZES[t.name], (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),),
                                                  generator=g))
                        for i, t in enumerate(TABLES)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t.name}" for t in TABLES], values=values, lengths=lengths)
    return torch.randn(BATCH, 4, generator=g), sparse, torch.randint(0, 2, (BATCH,), generator=g).float()


def train_step(dmp, opt, step: int) -> float:
    return step_on(dmp, opt, *batch(step))


def resumed_from_checkpoint(out_dir: str) -> dict:
    """Row-wise Adagrad on the disk plan: SAVE_AT steps, a checkpoint, and the rest in a new model that
    loads it into empty storage (the row shards and their accumulators at their offsets)."""
    dmp, opt, _ = build(True, "rowwise_adagrad", os.path.join(out_dir, "store-save"))
    set_initial_rows(dmp, COLLECTION, SIZES)
    losses = [train_step(dmp, opt, step) for step in range(SAVE_AT)]
    checkpoint = os.path.join(out_dir, "checkpoint")
    dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=checkpoint)
    dist.barrier()
    saved = {"rows": trained_rows(dmp), "state": optimizer_rows(opt)}
    dmp, opt, _ = build(True, "rowwise_adagrad", os.path.join(out_dir, "store-resume"))
    state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    losses += [train_step(dmp, opt, step) for step in range(SAVE_AT, STEPS)]
    return {"losses": all_gather_objects(losses), "rows": trained_rows(dmp), "saved": saved}


def resharded_from_checkpoint(out_dir: str) -> dict:
    """A DCP checkpoint written by another number of ranks ("resume" of a 2-rank run, at
    DCP_CHECKPOINT), loaded into this world's plan with empty storage (rows and optimizer state
    reshard across the new blocks), then trained on."""
    dmp, opt, plan = build(True, "rowwise_adagrad", os.path.join(out_dir, "store-resharded"))
    state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=os.environ["DCP_CHECKPOINT"])
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loaded = {"rows": trained_rows(dmp), "state": optimizer_rows(opt),
              "offsets": {t: [list(s.shard_offsets) for s in p.sharding_spec.shards]
                          for t, p in plan.plan[COLLECTION].items()}}
    losses = [train_step(dmp, opt, step) for step in range(SAVE_AT, STEPS)]
    return {"loaded": loaded, "losses": all_gather_objects(losses)}


def optimizer_rows(opt) -> dict:
    """Every table's optimizer state (by state dict key), assembled on every rank from every rank's
    shards; a rank's step counters beside it."""
    local = {}
    for key, value in opt.state_dict()["state"].items():
        if COLLECTION not in key:
            continue
        for name, held in value.items():
            tensor = held["rows"] if isinstance(held, dict) else held  # a disk table's: {"rows", "step"}
            if isinstance(tensor, ShardedTensor):
                local[f"{key}.{name}"] = (list(tensor.size()), [(list(s.metadata.shard_offsets), s.tensor.tolist())
                                                                for s in tensor.local_shards()])
    gathered = all_gather_objects(local)
    rows = {}
    for key in sorted(set().union(*gathered)):
        size = next(g[key][0] for g in gathered if key in g)
        full = torch.full(size, float("nan"))
        for g in gathered:
            for offsets, block in g.get(key, (None, []))[1]:
                block = torch.tensor(block)
                full[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))] = block
        rows[key] = full.tolist()
    return rows


def with_and_without_replicas(out_dir: str) -> dict:
    """SGD on the disk plan without replicas and with replicas of hot rows at bounds 0."""
    result = {}
    for replicated in (False, True):
        dmp, opt, _ = build(True, "sgd", os.path.join(out_dir, f"store-replicas-{replicated}"))
        set_initial_rows(dmp, COLLECTION, SIZES)
        replicas = replicate_hot_rows(dmp.module.sparse_arch.embedding_bag_collection,
                                      ReplicaSettings(fraction=0.02, warmup_steps=2, refresh_every=3)
                                      ) if replicated else None
        with EmbeddingTraffic() as traffic:
            losses = [train_step(dmp, opt, step) for step in range(REPLICA_STEPS)]
        result["replicas" if replicated else "plain"] = {
            "losses": all_gather_objects(losses), "rows": trained_rows(dmp), "sent": all_gather_objects(traffic.bytes),
            "stats": all_gather_objects(replicas.stats if replicas else None)}
    return result


def refusal(model, constraints_of_plan, storage_dir: str) -> str:
    """What planning and sharding `model` under these constraints raises ("built" if nothing)."""
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=optim.SGD(lr=LR))
    planner = DiskAwarePlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                               batch_size=BATCH, constraints=constraints_of_plan)
    try:
        plan = planner.collective_plan(model, [sharder])
        DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "built"


def too_few_rows(storage_dir: str) -> str:
    """What sharding a table of fewer rows than ranks row-wise on disk says (every rank raises)."""
    small = [EmbeddingBagConfig(name="tiny", embedding_dim=DIM, num_embeddings=dist.get_world_size() - 1,
                                feature_names=["f_tiny"])]
    return refusal(EmbeddingBagCollection(small, device=torch.device("meta")),
                   {"tiny": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=[DISK_KERNEL])},
                   storage_dir)


def mixed_mean(storage_dir: str) -> str:
    """What sharding a mean-pooled table row-wise beside a table-wise one says."""
    return refusal(EmbeddingBagCollection(MEAN_TABLES, device=torch.device("meta")), constraints(True), storage_dir)


def main() -> None:
    optimizers, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    for optimizer in optimizers:
        result = {}
        if optimizer == "resume":
            result = resumed_from_checkpoint(out_dir)
        elif optimizer == "resharded":
            result = resharded_from_checkpoint(out_dir)
        elif optimizer == "replicas":
            result = with_and_without_replicas(out_dir)
        for on_disk in (() if optimizer in ("resume", "resharded", "replicas") else (False, True)):
            dmp, opt, plan = build(on_disk, "sgd" if optimizer == "qcomm" else optimizer,
                                   os.path.join(out_dir, f"store-{optimizer}-{on_disk}"),
                                   **(quantized_comms() if optimizer == "qcomm" else {}))
            set_initial_rows(dmp, COLLECTION, SIZES)
            with EmbeddingTraffic() as traffic:  # what the training steps send between ranks
                losses = [train_step(dmp, opt, step) for step in range(STEPS)]
            result["disk" if on_disk else "memory"] = {
                "losses": all_gather_objects(losses), "sent": all_gather_objects(traffic.bytes),
                "kernels": {t: [p.compute_kernel, p.sharding_type,
                                [list(s.shard_offsets) for s in p.sharding_spec.shards]]
                            for t, p in plan.plan[COLLECTION].items()},
                "rows": trained_rows(dmp)}
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{optimizer}.json"), "w") as f:
                json.dump(result, f)
    refusals = {"too_few_rows": too_few_rows(os.path.join(out_dir, "store-small")),
                "mixed_mean": mixed_mean(os.path.join(out_dir, "store-mixed-mean"))}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "refusals.json"), "w") as f:
            json.dump(refusals, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
