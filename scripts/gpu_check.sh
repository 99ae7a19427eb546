#!/usr/bin/env bash
# What a lent GPU machine runs (the `device` tool): builds the CUDA extension, runs the core's tests
# (the CUDA twins run there) and benchmarks/bench_gpu.py. Logs and reports go to $OUT (or bench-out/);
# MLKV_TESTS_TIMEOUT caps each test run (default 420 s).
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
# The read-ahead into device slots and the table batch first (their twins are quick), then the benchmark, then
# the rest of the core's twins: a call that runs out of time has the figures.
quick="tests/test_read_ahead_into_slots.py tests/test_table_batch.py"
rest="tests/test_disk_embedding_bag.py tests/test_embedding_cache.py tests/test_optim.py
  tests/test_initial_rows_and_lookup.py tests/test_table_snapshot.py tests/test_store_bad_input.py"
run_tests() {  # log name, files...
  local log=$1; shift
  timeout "${MLKV_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs "$@" 2>&1 \
    | tee "$OUT/$log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  run_tests tests-quick.log $quick
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "[gpu_check] bench at $(( $(date +%s) - start )) s"
  timeout 400 python3 benchmarks/bench_gpu.py --out "$OUT/gpu.json" "$@" 2>&1 | grep -v USDT | tee "$OUT/bench.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "[gpu_check] the other tests at $(( $(date +%s) - start )) s"
  run_tests tests.log $rest
fi
echo "[gpu_check] done at $(( $(date +%s) - start )) s, status $status"
exit $status
