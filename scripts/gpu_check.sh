#!/usr/bin/env bash
# What a lent GPU machine runs (the `device` tool): builds the CUDA extension, runs the core's tests
# (the CUDA twins run there), then benchmarks/bench_gpu.py. Logs and reports go to $OUT (or bench-out/).
#
#   bash scripts/gpu_check.sh [tests|bench|all] [extra bench_gpu.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
export PYTHONUNBUFFERED=1 MLKV_WITHOUT_ROCKSDB=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
# The system compiler where there is one: the GPU machine's /opt/gcc links libstdc++ statically,
# and a second libstdc++ in the process crashed the first C++ exception (in its iostream locale).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
rm -rf build mlkv_torch/_C*.so
start=$(date +%s)
if ! python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; echo "[gpu_check] build FAILED"; exit 1
fi
echo "[gpu_check] built in $(( $(date +%s) - start )) s"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs tests/test_disk_embedding_bag.py \
    tests/test_table_batch.py tests/test_embedding_cache.py tests/test_optim.py tests/test_initial_rows_and_lookup.py \
    tests/test_table_snapshot.py tests/test_store_bad_input.py 2>&1 | tee "$OUT/tests.log" | tail -15
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 400 python3 benchmarks/bench_gpu.py --out "$OUT/gpu.json" "$@" 2>&1 | grep -v USDT | tee "$OUT/bench.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
