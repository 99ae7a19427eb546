"""Builds mlkv_torch._C: a CppExtension, or a CUDAExtension (adding cuda/*.cu)
when torch has CUDA and nvcc is present. MLKV_FORCE_CPU=1 forces the CPU build.
With RocksDB's headers and library present (Debian: librocksdb-dev; scripts/setup.sh
installs it), the RocksDB baseline store is built in; MLKV_WITHOUT_ROCKSDB=1 leaves it out.
On a CPU with FMA the C++ is built with -mfma (see fma_flags); MLKV_PORTABLE=1 leaves it out.

Build with `pip install --no-build-isolation .`: an isolated build would fetch
the newest torch (with CUDA) instead of using the one installed.
"""
import ctypes.util
import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # an isolated build (plain `pip install .`) has no torch to build against
    raise SystemExit("mlkv-torch builds against the torch installed in this environment: install torch first, "
                     "then `pip install --no-build-isolation .` (see scripts/setup.sh)") from e

ROOT = os.path.dirname(os.path.abspath(__file__))


def rocksdb_found() -> bool:
    """RocksDB's header and shared library, where the system's compiler finds them."""
    if os.environ.get("MLKV_WITHOUT_ROCKSDB", "0") == "1":
        return False
    prefix = os.environ.get("ROCKSDB_PREFIX")
    if prefix:
        return os.path.exists(os.path.join(prefix, "include/rocksdb/db.h"))
    return os.path.exists("/usr/include/rocksdb/db.h") and ctypes.util.find_library("rocksdb") is not None


def fma_flags() -> list:
    """The optimizer rules round as torch's and fbgemm's kernels do, with fused multiply-adds
    (csrc/row_ops.h calls fmaf): where this machine has FMA, fmaf is one instruction instead of a
    library call (2.3x faster SGD updates); contraction stays off, so no other expression changes
    its rounding. The extension is built where it runs; MLKV_PORTABLE=1 leaves the flag out."""
    if os.environ.get("MLKV_PORTABLE", "0") == "1":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            has_fma = any(line.startswith("flags") and " fma " in line + " " for line in f)
    except OSError:
        has_fma = False
    return ["-mfma", "-ffp-contract=off"] if has_fma else ["-ffp-contract=off"]


def extension():
    sources = sorted(glob.glob("csrc/engine/*.cc") + glob.glob("csrc/*.cpp") + glob.glob("csrc/cache/*.cpp") +
                     glob.glob("csrc/bindings/*.cpp"))
    cuda_sources = sorted(glob.glob("cuda/*.cu"))
    force_cpu = os.environ.get("MLKV_FORCE_CPU", "0") == "1"
    with_cuda = bool(cuda_sources) and not force_cpu and torch.version.cuda is not None and CUDA_HOME is not None
    cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter", *fma_flags()]
    include_dirs = [os.path.join(ROOT, "csrc")]
    macros, libraries, library_dirs = [], [], []
    if rocksdb_found():
        macros.append(("MLKV_WITH_ROCKSDB", "1"))
        libraries.append("rocksdb")
        prefix = os.environ.get("ROCKSDB_PREFIX")
        if prefix:
            include_dirs.append(os.path.join(prefix, "include"))
            library_dirs.append(os.path.join(prefix, "lib"))
    if with_cuda:
        return CUDAExtension(
            "mlkv_torch._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=macros + [("MLKV_WITH_CUDA", "1")],
            libraries=libraries,
            library_dirs=library_dirs,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        )
    return CppExtension("mlkv_torch._C", sources, include_dirs=include_dirs, define_macros=macros,
                        libraries=libraries, library_dirs=library_dirs, extra_compile_args={"cxx": cxx_flags})


setup(
    name="mlkv-torch",
    version="0.1.0",
    description="Larger-than-memory embedding tables for PyTorch and TorchRec, on a log-structured disk store",
    license="BSD-3-Clause",
    packages=find_packages(include=["mlkv_torch", "mlkv_torch.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    # torch is deliberately not listed: an unpinned torch requirement would pull the newest CUDA build.
    # The runner's needs are (the core imports torch alone; the TorchRec layer needs torchrec, which
    # scripts/setup.sh installs with its CPU fbgemm).
    install_requires=["numpy", "pyyaml", "pydantic>=2,<3", "tqdm", "pyarrow>=25", "torchdata==0.11.0"],
    extras_require={"torchrec": ["torchrec"], "test": ["pytest", "hypothesis", "tensorboard", "torchrec"],
                    "bench": ["matplotlib", "rocksdict", "lmdb"], "tensorboard": ["tensorboard"],
                    # data.engine ray and `criteo convert --ray`: batches and conversions on a Ray cluster.
                    "ray": ["ray[data]==2.60.0"]},
    zip_safe=False,
)
