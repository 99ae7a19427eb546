"""A torchrun worker for tests/torchrec_integration/test_job_budget.py: an EmbeddingBagCollection under
DistributedModelParallel (gloo, CPU), planned by DiskAwarePlanner with a job budget from a sample of
Zipf-skewed and uniform ids and this machine's calibration; trains on more batches of the same ids.

    torchrun --nproc_per_node N tests/workers/job_budget_worker.py OUT_DIR

Rank 0 writes OUT_DIR/result.json: the planner's choice per table (in memory or not, load factor,
memory, predicted hit rate of a step's rows and reads a step), the plan's kernels, and per disk
table the disk kernels' budgets (all ranks' together) and the hit rate and reads a step measured over
the second half of training.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import optim
from mlkv_torch.planning import access_from_batches, calibration_for
from mlkv_torch.ranks import all_gather_objects
from mlkv_torch.torchrec import DiskAwarePlanner, DiskEmbeddingBagCollectionSharder

DIM, BATCH, STEPS, SAMPLE = 16, 2048, 60, 8
BUDGET = 6 << 20  # the job's, for all ranks
TABLES = {"skewed": (200_000, 1.1), "flat": (200_000, 0.0), "small": (1_000, 1.05)}  # rows, Zipf exponent


def ids(rows: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    if exponent == 0:
        return torch.randint(0, rows, (BATCH,), generator=generator)
    weight = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    scatter = torch.randperm(rows, generator=torch.Generator().manual_seed(rows))  # hot ids are not the small ones
    return scatter[torch.multinomial(weight.float(), BATCH, replacement=True, generator=generator)]


def batch_ids(number: int):
    generator = torch.Generator().manual_seed(number)
    return {name: ids(rows, a, generator) for name, (rows, a) in TABLES.items()}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                                                     feature_names=[name]) for name, (rows, _) in TABLES.items()],
                                 device=torch.device("meta"))
    access = access_from_batches((batch_ids(n) for n in range(SAMPLE)), {n: r for n, (r, _) in TABLES.items()})
    tables_dir = os.path.join(out_dir, "tables")
    calibration = calibration_for(tables_dir, needs_wire=world > 1)
    sharder = DiskEmbeddingBagCollectionSharder(tables_dir, optimizer=optim.SGD(lr=0.01))
    planner = DiskAwarePlanner(topology=Topology(world_size=world, compute_device="cpu"), batch_size=BATCH,
                               access=access, calibration=calibration, memory_budget_bytes=BUDGET)
    plan = planner.collective_plan(ebc, [sharder])
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    counts = {}
    for step in range(STEPS):
        if step == STEPS // 2:
            counts = {k: dict(v) for k, v in dmp.module.stats().items()}
        features = batch_ids(SAMPLE + step * world + rank)  # batches the sample did not see
        kjt = KeyedJaggedTensor.from_lengths_sync(list(TABLES), torch.cat(list(features.values())),
                                                  torch.ones(BATCH * len(TABLES), dtype=torch.int32))
        sum(v.sum() for v in dmp(kjt).to_dict().values()).backward()
    end = dmp.module.stats()
    measured = {}
    for shard, stats in end.items():
        table = shard.split("_rows")[0]
        row = measured.setdefault(table, {"hits": 0, "misses": 0})
        row["hits"] += stats["cache_hits"] - counts[shard]["cache_hits"]
        row["misses"] += stats["cache_misses"] - counts[shard]["cache_misses"]
    budget = sum(kernel.memory_budget_bytes for kernel in dmp.module.disk_kernels())
    measured_all, budgets_all = all_gather_objects(measured), all_gather_objects(budget)
    if rank == 0:
        tables = {}
        for part in measured_all:
            for table, row in part.items():
                total = tables.setdefault(table, {"hits": 0, "misses": 0})
                total["hits"] += row["hits"]
                total["misses"] += row["misses"]
        result = {"chosen": {n: m.__dict__ for n, m in planner.table_memory.items()},
                  "kernels": {n: ps.compute_kernel for n, ps in plan.plan[""].items()},
                  "measured": {t: {"row_hit_rate": r["hits"] / max(1, r["hits"] + r["misses"]),
                                   "reads_per_step": r["misses"] / (STEPS - STEPS // 2)} for t, r in tables.items()},
                  "disk_budget": sum(budgets_all),
                  "explain": planner.explain()}
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
