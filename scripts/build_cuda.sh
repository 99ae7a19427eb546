#!/usr/bin/env bash
# Builds the complete extension as a CUDAExtension (the CUDA kernels and every CUDA path of the
# C++ cache) against a CUDA build of torch, with this machine's nvcc, no GPU needed, then runs the
# CPU tests of the core (what needs torch alone) against that build. What a lent GPU machine
# would build, checked here first so its minutes go to running, not to fixing syntax.
#
#   bash scripts/build_cuda.sh            # venv in .venv-cuda (torch with CUDA), build in build-cuda/
#
# Environment: MLKV_CUDA_VENV (default .venv-cuda), TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200),
# CUDA_HOME (default /usr/local/cuda), MLKV_CUDA_TORCH (default torch==2.13.0, the CPU stack's release).
# The first run downloads torch with CUDA (about 530 MB plus NVIDIA's libraries); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MLKV_CUDA_VENV:-.venv-cuda}
TORCH_SPEC=${MLKV_CUDA_TORCH:-torch==2.13.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PATH="$CUDA_HOME/bin:$PATH"
command -v nvcc >/dev/null || { echo "[build_cuda] nvcc not found under $CUDA_HOME/bin: install the CUDA toolkit"; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[build_cuda] creating $VENV"
  python3 -m venv "$VENV"
fi
py="$VENV/bin/python"
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "[build_cuda] installing $TORCH_SPEC with CUDA (this machine's pip configuration pins the CPU wheel: bypassed)"
  # The default index serves the CUDA build on Linux; the local pip configuration would pick the CPU one.
  PIP_CONFIG_FILE=/dev/null "$py" -m pip install -q --isolated --disable-pip-version-check "$TORCH_SPEC" numpy \
    pytest hypothesis ninja setuptools
fi
"$py" -c 'import torch; print(f"[build_cuda] torch {torch.__version__}, CUDA {torch.version.cuda}")'

# Built in a copy of the sources, so the CPU build in the work tree (mlkv_torch/_C*.so) is untouched.
work=build-cuda
rm -rf "$work"
mkdir -p "$work"
cp -r setup.py csrc cuda mlkv_torch tests pytest.ini "$work"/
rm -f "$work"/mlkv_torch/_C*.so
start=$(date +%s)
(cd "$work" && MLKV_WITHOUT_ROCKSDB=1 "$OLDPWD/$py" setup.py -q build_ext --inplace >build.log 2>&1) || {
  tail -50 "$work/build.log"; echo "[build_cuda] build FAILED (log: $work/build.log)"; exit 1; }
echo "[build_cuda] built $(ls "$work"/mlkv_torch/_C*.so) in $(( $(date +%s) - start )) s"
"$py" - "$work" <<'EOF'
import os, sys
sys.path.insert(0, sys.argv[1])
import mlkv_torch, torch
assert mlkv_torch._C.__file__.startswith(os.path.abspath(sys.argv[1])), mlkv_torch._C.__file__
names = open(mlkv_torch._C.__file__, "rb").read()
assert b"LaunchSlotUpdate" in names, "the CUDA kernels are not in the build"
print(f"[build_cuda] imports without a GPU (cuda available: {torch.cuda.is_available()}); CUDA kernels linked")
EOF
# The core's tests (torch alone: no torchrec in this venv); the CUDA twins skip without a GPU.
# PYTHONPATH: the tests' worker processes import the package from the build (this venv has none installed).
(cd "$work" && PYTHONPATH="$PWD" "$OLDPWD/$py" -m pytest -q -p no:cacheprovider tests/core/test_disk_embedding_bag.py \
  tests/core/test_embedding_cache.py tests/core/test_table_snapshot.py tests/core/test_optim.py \
  tests/core/test_initial_rows_and_lookup.py tests/core/test_table_batch.py tests/core/test_threads_per_process.py)
