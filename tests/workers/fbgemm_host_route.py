"""For CUDA tests on a machine with fbgemm-gpu's CPU build (the carried GPU stack): gives each fbgemm op
that has a CPU kernel and no CUDA kernel a CUDA kernel that runs the CPU one on host copies of its
tensors. TorchRec's row-wise input dist calls fbgemm::block_bucketize_sparse_features (and table-row-wise
fbgemm::permute_2D_sparse_data too), which only fbgemm-gpu's CUDA build has on the GPU; with them routed
through the host, our row-wise path runs under NCCL. On a full fbgemm-gpu nothing is routed."""
import torch
import torchrec  # noqa: F401  (loads fbgemm's ops)
from torch.utils._pytree import tree_map

ROUTED: set = set()  # the ops a run called through the host
_library = None


def _to_host(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _kernel_through_host(op, qualified_name: str):
    def kernel(*args, **kwargs):
        ROUTED.add(qualified_name)
        out = op(*tree_map(_to_host, args), **tree_map(_to_host, kwargs))
        return tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, out)
    return kernel


def route_fbgemm_ops_without_cuda_kernels() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("fbgemm", "IMPL")
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for qualified_name in torch._C._dispatch_get_all_op_names():
        if (not qualified_name.startswith("fbgemm::") or has_kernel(qualified_name, "CUDA")
                or not has_kernel(qualified_name, "CPU")):
            continue
        name, _, overload = qualified_name[len("fbgemm::"):].partition(".")
        op = getattr(getattr(torch.ops.fbgemm, name), overload or "default")
        _library.impl(qualified_name[len("fbgemm::"):], _kernel_through_host(op, qualified_name), "CUDA")
