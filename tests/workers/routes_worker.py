"""Run under torchrun (gloo, CPU): TorchRec's API to the disk kernel, as a TorchRec user writes DMP
code, for every sharding type the disk tables take.

- fused_params: a sharder given ``fused_params={"learning_rate": 0.1}`` and no optimizer trains its
  disk tables as FBGEMM's default, exact SGD at 0.1: the rows after one step equal plain torch's
  (nn.EmbeddingBag, the global batch, SGD at 0.1 on the gradient TorchRec's comms divide by the
  ranks), table-wise, column-wise, row-wise and table-row-wise.
- virtual: a virtual table (``use_virtual_table``) with a CountBasedEvictionPolicy trigger trains
  under every sharding type the planner is allowed and evicts on every rank that holds a shard.

Writes <out>/routes-rank<r>.json.

    torchrun --standalone --nproc_per_node 2 tests/workers/routes_worker.py <out>
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.modules.embedding_configs import CountBasedEvictionPolicy, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import initial_rows
from mlkv_torch.ranks import exit_without_finalizing
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder
from mlkv_torch.torchrec.tables import table_seed

DIM, ROWS, BATCH, LR = 8, 64, 6, 0.1
SHARDINGS = ["table_wise", "column_wise", "row_wise", "table_row_wise"]


def batch_of(rank: int, step: int = 0, rows: int = ROWS) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (BATCH,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=values, lengths=lengths)


def coefficients(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(77 + rank))


def dmp_of(tables, sharding: str, storage_dir: str, **sharder_args):
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    sharder = DiskEmbeddingBagCollectionSharder(storage_dir, seed=0, **sharder_args)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=[DISK_KERNEL],
                                                min_partition=DIM // 2) for t in tables}
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu")
    plan = DiskAwarePlanner(topology=topology, batch_size=BATCH, constraints=constraints).collective_plan(
        ebc, [sharder])
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def fused_params_phase(rank: int, world: int, out: str) -> dict:
    """Each sharding type: the rows after one step of the disk tables against plain torch's."""
    table = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"])
    start = initial_rows(torch.arange(ROWS), DIM, seed=table_seed(0, "t"), num_embeddings=ROWS)
    # Plain torch on the global batch: every rank's bags, each rank's coefficients.
    reference = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", _weight=start.clone())
    loss = 0
    for r in range(world):
        kjt = batch_of(r)
        loss = loss + (reference(kjt.values(), kjt.offsets()[:-1]) * coefficients(r)).sum()
    loss.backward()
    with torch.no_grad():  # TorchRec's comms divide the tables' gradients by the ranks, as DDP averages
        expected = start - LR * reference.weight.grad / world
    results = {}
    for sharding in SHARDINGS:
        dmp = dmp_of([table], sharding, os.path.join(out, f"fused-{sharding}"),
                     fused_params={"learning_rate": LR})
        plan = dmp.plan.plan[""]["t"]
        (dmp(batch_of(rank)).values() * coefficients(rank)).sum().backward()
        rows = torch.full((ROWS, DIM), float("nan"))
        for shard in dmp.state_dict()["embedding_bags.t.weight"].local_shards():
            (r0, c0), (n, c) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            rows[r0:r0 + n, c0:c0 + c] = shard.tensor
        held = ~rows.isnan()
        results[sharding] = {"kernel": [plan.compute_kernel, plan.sharding_type],
                             "held": int(held.sum()),
                             "max_error": float((rows[held] - expected[held]).abs().max()) if held.any() else 0.0,
                             "max_update": float((start - expected).abs().max())}
        dmp.module.close()
    return results


def virtual_phase(rank: int, world: int, out: str) -> dict:
    """Each sharding type: a virtual table with a count trigger trains, and its shards evict."""
    space = 1 << 30  # raw ids: TorchRec's table-row-wise input distribution keeps block sizes in int32
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_threshold=2, decay_rate=0.9)
    results = {}
    for sharding in SHARDINGS:
        table = EmbeddingBagConfig(name="v", embedding_dim=DIM, num_embeddings=space, feature_names=["f"],
                                   use_virtual_table=True, virtual_table_eviction_policy=policy,
                                   total_num_buckets=4 * world)
        dmp = dmp_of([table], sharding, os.path.join(out, f"virtual-{sharding}"), fused_params={"learning_rate": LR})
        losses = []
        for step in range(12):  # new raw ids every step: far more than the trigger a rank keeps
            kjt = batch_of(rank, step, rows=space)
            loss = (dmp(kjt).values() * coefficients(rank)).sum()
            loss.backward()
            losses.append(float(loss))
        stats = dmp.module.stats()
        results[sharding] = {"kernel": dmp.plan.plan[""]["v"].sharding_type, "shards": len(stats),
                             "evicted": sum(s.get("evicted_ids", 0) for s in stats.values()),
                             "finite": all(torch.isfinite(torch.tensor(losses)).tolist())}
        dmp.module.close()
    return results


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"fused_params": fused_params_phase(rank, world, out), "virtual": virtual_phase(rank, world, out)}
    with open(os.path.join(out, f"routes-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
