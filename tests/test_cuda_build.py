"""cuda/ compiles with nvcc wherever nvcc is installed, GPU or not (the kernels run in the
CUDA twins of the DiskEmbeddingBag tests, which skip without a GPU)."""
import glob
import os
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                if "CUDA_HOME" in os.environ else None)


@pytest.mark.skipif(NVCC is None or not os.path.exists(NVCC), reason="nvcc is not installed")
@pytest.mark.parametrize("source", sorted(glob.glob(os.path.join(ROOT, "cuda", "*.cu"))), ids=os.path.basename)
def test_cuda_sources_compile(tmp_path, source):
    includes = [f"-I{p}" for p in include_paths() + [os.path.join(ROOT, "csrc"), sysconfig.get_paths()["include"]]]
    command = [NVCC, "-c", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", *includes, source,
               "-o", str(tmp_path / "kernel.o")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "kernel.o").stat().st_size > 0
