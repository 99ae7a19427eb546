"""A torchrun worker: the runner's `run` under a process group this launcher joins itself, as a user's
own launcher calls it (`mlkv_torch.train.run` trains through DistributedModelParallel whenever a
process group is up, whatever its world), on the placement the runner chooses for `device`:
cuda:LOCAL_RANK with NCCL, or the CPU with gloo. Used by tests/test_cuda_training.py (NCCL on one GPU
beside the one-process CUDA run; gloo on the CPU beside the one-process CPU run) and
scripts/gpu_check.sh.

    torchrun --nproc_per_node 1 tests/workers/runner_on_ranks.py CONFIG [dotted.key=value ...]

Prints the run's summary as JSON; on CUDA with fbgemm-gpu's CPU build, the fbgemm ops TorchRec's
input distribution needs run through the host (fbgemm_host_route)."""
import json
import sys

import torch.distributed as dist

from mlkv_torch.config import load_config
from mlkv_torch.train import run
from mlkv_torch.train.placement import join_process_group, this_process_placement


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    placement = this_process_placement(config.device, distributed=True)
    if placement.device.type == "cuda":
        from fbgemm_host_route import route_fbgemm_ops_without_cuda_kernels

        route_fbgemm_ops_without_cuda_kernels()
    join_process_group(placement)
    try:
        summary = run(config, progress=False)
        summary["backend"], rank = dist.get_backend(), dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
