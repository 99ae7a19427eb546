"""A torchrun worker for tests/torchrec_integration/test_replicas.py: DLRM under DistributedModelParallel (gloo, CPU),
with and without replicas of hot rows (mlkv_torch.torchrec.replicate_hot_rows).

    torchrun --nproc_per_node 2 tests/workers/replica_worker.py PHASE[,PHASE...] OUT_DIR

The plan mixes every kind of table replicas meet: on rank 0, t0 table-wise in memory (TorchRec's
fused kernel) and t1 and t4 (mean pooling) table-wise on disk, whose lookup merges the kernels'
variable-batch outputs; t2 data-parallel (left alone); t3 column-wise and t6 table-column-wise on
disk over both ranks.

Phases, run in the order given (rank 0 writes OUT_DIR/<phase>.json; each phase's stores are under
OUT_DIR/<phase>):
- exact: per optimizer (SGD, Adagrad, row-wise Adagrad, Adam), the losses of STEPS steps without
  replicas and with them at bounds 0, from the same rows and batches; the replicas' statistics and
  the bytes sent.
- linear: SGD on a loss linear in the pooled embeddings, at bounds 2, up to a step that pushes
  every gradient owed: each rank's shards of every table, and those of the run without replicas;
  without DLRM, with a sixth table t5 of half the width; and the order in which the replicas'
  served hits and TorchRec's output all-to-alls ran, forward and backward (`CallOrder`).
- bounds: replicas at pull and push bounds 2: the ids each table served and pushed, step by step,
  and the losses beside the run without replicas.
"""
import json
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torchrec.distributed import comm_ops
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                table_wise)
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import initial_rows, optim
from mlkv_torch.ranks import all_gather_objects
from mlkv_torch.torchrec import DISK_KERNEL, DiskEmbeddingBagCollectionSharder
from mlkv_torch.torchrec.replicas.autograd import ServedHits
from mlkv_torch.torchrec.replicas import ReplicaSettings, replicate_hot_rows
from mlkv_torch.torchrec.tables import table_seed
from mlkv_torch.wire import EmbeddingTraffic

DIM, BATCH, STEPS, LR = 8, 32, 14, 0.5
SIZES = {"t0": 400, "t1": 3000, "t2": 60, "t3": 2000, "t4": 1000, "t6": 1200}
TABLES = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"],
                             pooling=PoolingType.MEAN if name == "t4" else PoolingType.SUM)
          for name, n in SIZES.items()]
# Without DLRM, a table of another width too: replicas keep a slot space a width.
LINEAR_TABLES = TABLES + [EmbeddingBagConfig(name="t5", embedding_dim=DIM // 2, num_embeddings=1500,
                                             feature_names=["f_t5"])]
OPTIMIZERS = {"sgd": optim.SGD(lr=LR), "adagrad": optim.Adagrad(lr=LR),
              "rowwise_adagrad": optim.RowWiseAdagrad(lr=LR), "adam": optim.Adam(lr=LR)}
COLLECTION = "sparse_arch.embedding_bag_collection"


def build(optimizer: str, storage_dir: str, linear: bool = False):
    """DLRM, or (`linear`) the collection alone, under DMP, every table from mlkv_torch.initial_rows."""
    torch.manual_seed(0)  # the same dense layers in every build
    tables = LINEAR_TABLES if linear else TABLES
    collection = EmbeddingBagCollection(tables, device=torch.device("meta"))
    model = collection if linear else DLRM(
        embedding_bag_collection=collection, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1], dense_device=torch.device("cpu"))
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir, optimizer=OPTIMIZERS[optimizer])
    t0_kernel = "fused" if optimizer != "adam" else DISK_KERNEL  # fbgemm's CPU kernel has no Adam
    plan = construct_module_sharding_plan(
        collection, {"t0": table_wise(rank=0, compute_kernel=t0_kernel),
                     "t1": table_wise(rank=0, compute_kernel=DISK_KERNEL), "t2": data_parallel(),
                     "t3": column_wise(ranks=[0, 1], compute_kernel=DISK_KERNEL),
                     "t4": table_wise(rank=0, compute_kernel=DISK_KERNEL),
                     "t6": column_wise(ranks=[1, 0], compute_kernel=DISK_KERNEL),
                     **({"t5": table_wise(rank=1, compute_kernel=DISK_KERNEL)} if linear else {})},
        sharder=sharder, local_size=dist.get_world_size(), world_size=dist.get_world_size(), device_type="cpu")
    # TorchRec's helpers make no table-column-wise sharding: t6's column shards, on one host, are one.
    plan["t6"].sharding_type = ShardingType.TABLE_COLUMN_WISE.value
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder],
                                   plan=ShardingPlan({"" if linear else COLLECTION: plan}))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    state = dmp.state_dict()
    prefix = "" if linear else f"{COLLECTION}."
    for table in tables:
        name, n = table.name, table.num_embeddings
        full = initial_rows(torch.arange(n), table.embedding_dim, seed=table_seed(0, name), num_embeddings=n)
        weight = state[f"{prefix}embedding_bags.{name}.weight"]
        if isinstance(weight, torch.Tensor) and not hasattr(weight, "local_shards"):  # data-parallel
            weight.detach().copy_(full)
            continue
        for shard in weight.local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r0:r0 + rows, c0:c0 + cols])
    dmp.load_state_dict(state)
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def batch(step: int, tables=TABLES, cold: bool = False):
    """Zipf-like ids (rows recur, a few very often), one id a bag mostly, some bags of two or none;
    `cold`: one id a bag, each table of width DIM its last row (never hot), so none of their bags is
    a replica hit (t5, of another width, still hits)."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = torch.multinomial(torch.tensor([0.05, 0.8, 0.15]), len(tables) * BATCH, replacement=True,
                                generator=g)
    if cold:
        lengths = torch.ones_like(lengths)
    values = []
    for i, t in enumerate(tables):
        n = int(lengths[i * BATCH:(i + 1) * BATCH].sum())
        u = torch.rand(n, generator=g)
        values.append(((t.num_embeddings + 1) ** u - 1).long().clamp_(max=t.num_embeddings - 1)  # ~ 1/x
                      if not (cold and t.embedding_dim == DIM) else torch.full((n,), t.num_embeddings - 1))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t.name}" for t in tables], values=torch.cat(values),
                                                 lengths=lengths)
    return torch.randn(BATCH, 4, generator=g), sparse, torch.randint(0, 2, (BATCH,), generator=g).float()


def train(optimizer: str, storage_dir: str, settings):
    dmp, opt = build(optimizer, storage_dir)
    replicas = replicate_hot_rows(dmp.module.sparse_arch.embedding_bag_collection, settings) if settings else None
    if replicas is not None:
        replicas.trace = []
    losses = []
    with EmbeddingTraffic() as traffic:
        for step in range(STEPS):
            dense, sparse, labels = batch(step)
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, sparse).squeeze(1), labels)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return {"losses": all_gather_objects(losses), "sent": all_gather_objects(traffic.bytes),
            "shards": all_gather_objects(local_shards(dmp.state_dict(), f"{COLLECTION}.")),
            "stats": all_gather_objects(replicas.stats if replicas else {}),
            "hit_rate": all_gather_objects(replicas.hit_rate() if replicas else None),
            "trace": all_gather_objects(replicas.trace if replicas else []),
            "sharding_types": sorted(dmp.module.sparse_arch.embedding_bag_collection._sharding_types)}


@contextmanager
def call_order():
    """Records in a list, in order, the calls of the served hits' pooling (s forward, S backward) and
    of TorchRec's variable-batch output all-to-all: its request (r sends, R waits for the gradients)
    and its wait (w waits, W sends the gradients)."""
    calls = []
    functions = {comm_ops.Variable_Batch_All2All_Pooled_Req: "r", comm_ops.Variable_Batch_All2All_Pooled_Wait: "w",
                 ServedHits: "s"}
    saved = {f: (f.__dict__["forward"], f.__dict__["backward"]) for f in functions}

    def recorded(method, letter):
        def call(*args):
            calls.append(letter)
            return method(*args)
        return staticmethod(call)

    for f, letter in functions.items():
        f.forward, f.backward = recorded(f.forward, letter), recorded(f.backward, letter.upper())
    try:
        yield calls
    finally:
        for f, (forward, backward) in saved.items():
            f.forward, f.backward = forward, backward


def train_linear(storage_dir: str, settings, steps: int):
    """SGD on a loss linear in the pooled embeddings: the gradients do not depend on the rows, so
    once every replica gradient is pushed the tables must be those of the run without replicas,
    whatever rows the replicas served. The last step's batch is cold but for t5: the width-DIM
    tables' owed rows go without a hit, and on rank 0 t5's hits come after them in the merge.
    Returns this rank's shards of every table, the rows owed and hits in the last step, and the
    calls' order (`call_order`)."""
    dmp, opt = build("sgd", storage_dir, linear=True)
    replicas = replicate_hot_rows(dmp.module, settings) if settings else None
    served_without_push = 0  # steps whose replicas served hits and pushed nothing
    with call_order() as calls:
        for step in range(steps):
            if replicas is not None:
                hits, pushed = replicas.stats["replica_hits"], replicas.stats["push_rows"]
            if replicas is not None and step == steps - 1:
                owed_before_last, hits_before_last = replicas.owed_rows(), replicas.stats["replica_hits"]
            # Step 5 repeats step 4's batch: within the bounds its rows are served again, none is pushed.
            _, sparse, _ = batch(4 if step == 5 else step, LINEAR_TABLES, cold=step == steps - 1)
            pooled = dmp(sparse)
            pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
            coefficients = torch.randn(pooled.values().shape, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            (pooled.values() * coefficients).sum().backward()
            opt.step()
            if replicas is not None:
                served_without_push += replicas.stats["replica_hits"] > hits and replicas.stats["push_rows"] == pushed
    if replicas is None:
        return {"shards": local_shards(dmp.state_dict(), ""), "pending": 0}
    return {"shards": local_shards(dmp.state_dict(), ""), "pending": replicas.owed_rows(),
            "owed_before_last": owed_before_last, "hits_in_last": replicas.stats["replica_hits"] - hits_before_last,
            "served_without_push": served_without_push, "call_order": "".join(calls)}


def local_shards(state, prefix: str):
    """This rank's shards of every table, as lists."""
    shards = {}
    for name in [t.name for t in LINEAR_TABLES if f"{prefix}embedding_bags.{t.name}.weight" in state]:
        weight = state[f"{prefix}embedding_bags.{name}.weight"]
        local = [weight] if not hasattr(weight, "local_shards") else [s.tensor for s in weight.local_shards()]
        shards[name] = [t.detach().clone().tolist() for t in local]
    return shards


def run_phase(phase: str, out_dir: str) -> dict:
    """One phase's results (rank 0's are written); its stores go under `out_dir`."""
    result = {}
    if phase == "exact":
        for optimizer in OPTIMIZERS:
            for replicated in (False, True):
                settings = ReplicaSettings(fraction=0.03, warmup_steps=3, refresh_every=5) if replicated else None
                result[f"{optimizer}/{'replicas' if replicated else 'plain'}"] = train(
                    optimizer, os.path.join(out_dir, f"store-{optimizer}-{replicated}"), settings)
    elif phase == "bounds":
        for bound in (0, 2):
            settings = ReplicaSettings(fraction=0.03, pull_bound=bound, push_bound=bound, warmup_steps=3,
                                       refresh_every=5)
            result[f"bound{bound}"] = train("sgd", os.path.join(out_dir, f"store-bound{bound}"), settings)
        result["plain"] = train("sgd", os.path.join(out_dir, "store-plain"), None)
    elif phase == "linear":
        # Choices at steps 3 and 8: step 7 pushes every gradient owed, so after 8 steps none is.
        settings = ReplicaSettings(fraction=0.03, pull_bound=2, push_bound=2, warmup_steps=3, refresh_every=5)
        replicated = train_linear(os.path.join(out_dir, "store-replicas"), settings, steps=8)
        plain = train_linear(os.path.join(out_dir, "store-plain"), None, steps=8)
        result = {"replicas": all_gather_objects(replicated), "plain": all_gather_objects(plain)}
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    return result


def main() -> None:
    phases, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    for phase in phases:
        os.makedirs(os.path.join(out_dir, phase), exist_ok=True)
        result = run_phase(phase, os.path.join(out_dir, phase))
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
