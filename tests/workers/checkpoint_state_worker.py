"""A torchrun worker for tests/train/test_export.py: resumes a runner's checkpoint as the runner does
(`Experiment(config, resume=True).load()`, under the plan of the world that wrote it) and writes,
from each rank, its part of every table's rows and optimizer state as DistributedModelParallel's
state dicts give them to OUT.rank<r>: a ShardedTensor as its size and local shards, a replicated
tensor whole.

    torchrun --nproc_per_node N tests/workers/checkpoint_state_worker.py CONFIG OUT [overrides...]
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from mlkv_torch.config import load_config
from mlkv_torch.ranks import exit_without_finalizing
from mlkv_torch.train.experiment import Experiment


def local(value):
    """This rank's part of a state dict's value: {"size", "shards": [(offsets, tensor)]} of a
    ShardedTensor (no collective: ranks hold different tables), a plain tensor as it is."""
    if isinstance(value, dict):  # a disk table's optimizer state: {"rows": ShardedTensor, "step": int}
        return local(value["rows"])
    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    return {"size": list(value.size()),
            "shards": [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]}


def main() -> None:
    dist.init_process_group("gloo")
    config = load_config(sys.argv[1], sys.argv[3:])
    experiment = Experiment(config, resume=True)
    step = experiment.load()
    model = experiment.model.state_dict()
    optimizer = experiment.optimizer.state_dict()["state"]
    tables = {}
    for table in experiment.table_configs:
        suffix = f"embedding_bags.{table.name}.weight"
        weight = local(next(v for k, v in model.items() if k.endswith(suffix)))
        state = next((v for k, v in optimizer.items() if k.endswith(suffix)), {})
        tables[table.name] = {"weight": weight,
                              "state": {k: local(v) for k, v in sorted(state.items()) if k != "step"}}
    torch.save({"step": step, "tables": tables}, f"{sys.argv[2]}.rank{dist.get_rank()}")
    dist.barrier()
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
