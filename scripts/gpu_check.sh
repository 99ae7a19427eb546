#!/usr/bin/env bash
# What a lent GPU machine runs (the `device` tool): builds the CUDA extension, runs the core's tests
# (the CUDA twins run there), benchmarks/bench_gpu.py, the quickstart on CUDA beside the CPU, and the
# disk's limits (fio) beside the stores' read rates. Logs and reports go to $OUT (or bench-out/);
# MLKV_TESTS_TIMEOUT caps each test run (default 420 s). The stack that machine lacks (torchrec,
# fbgemm-gpu-cpu, fio) comes from .gpu-stack/ (`bash scripts/gpu_stack.sh download` here, carried there).
#
#   bash scripts/gpu_check.sh [all|PARTS] [extra bench_gpu.py arguments]
# PARTS: a comma-separated list of quick (the quick CUDA twins), bench, train, disk, tests (every twin).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
has() { [[ $what == all || ,$what, == *,$1,* ]]; }
export PYTHONUNBUFFERED=1 MLKV_WITHOUT_ROCKSDB=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
# The system compiler where there is one: the GPU machine's /opt/gcc links libstdc++ statically,
# and a second libstdc++ in the process crashed the first C++ exception (in its iostream locale).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
if [ -d .gpu-stack/wheels ]; then
  eval "$(bash scripts/gpu_stack.sh install)" || echo "[gpu_check] installing .gpu-stack FAILED"
fi
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
quick="tests/core/test_read_ahead_into_slots.py tests/core/test_table_batch.py"
rest="tests/core/test_disk_embedding_bag.py tests/core/test_embedding_cache.py tests/core/test_optim.py
  tests/core/test_initial_rows_and_lookup.py tests/core/test_table_snapshot.py tests/engine/test_store_bad_input.py"
run_tests() {  # log name, files...
  local log=$1; shift
  timeout "${MLKV_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfEs "$@" 2>&1 \
    | tee "$OUT/$log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
if has quick || has tests; then
  run_tests tests-quick.log $quick
fi
if has bench; then
  echo "[gpu_check] bench at $(( $(date +%s) - start )) s"
  timeout 400 python3 benchmarks/bench_gpu.py --out "$OUT/gpu.json" "$@" 2>&1 | grep --line-buffered -v USDT | tee "$OUT/bench.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has train; then
  echo "[gpu_check] training on CUDA at $(( $(date +%s) - start )) s"
  run_tests tests-train.log tests/test_cuda_training.py tests/torchrec_integration/test_torchrec_collection.py \
    tests/core/test_virtual_tables.py
  for device in cuda cpu; do  # the quickstart, 100 steps, on each device: samples/s and AUC side by side
    run=/tmp/quickstart-$device
    rm -rf "$run"
    timeout 240 python3 -m mlkv_torch.train configs/quickstart.yaml device=$device output_dir="$run" \
      train.steps=100 eval.every=100 --no-progress >"$run.log" 2>&1 || { status=1; tail -20 "$run.log"; }
    cp "$run/summary.json" "$OUT/quickstart-$device.json" 2>/dev/null
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('[gpu_check] quickstart', s['device'], \
      f\"{s['samples_per_s']:.0f} samples/s auc {s['auc']:.4f} hit rate {s['hit_rate']:.3f}\")" "$run/summary.json"
  done
  # The same under torchrun on NCCL: one rank of DistributedModelParallel on the GPU, every table on
  # disk (fbgemm-gpu's CPU build here has no GPU kernels for TorchRec's in-memory tables).
  run=/tmp/quickstart-nccl
  rm -rf "$run"
  PYTHONPATH="tests/workers${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 -m torch.distributed.run --standalone \
    --nproc_per_node 1 tests/workers/runner_on_ranks.py configs/quickstart.yaml device=cuda output_dir="$run" \
    storage.in_memory_tables=false train.steps=100 eval.every=100 >"$run.log" 2>&1 || { status=1; tail -20 "$run.log"; }
  cp "$run/summary.json" "$OUT/quickstart-nccl.json" 2>/dev/null
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('[gpu_check] quickstart under torchrun, NCCL', \
    f\"{s['samples_per_s']:.0f} samples/s auc {s['auc']:.4f}\")" "$run/summary.json"
fi
if has disk; then
  echo "[gpu_check] the disk's limits at $(( $(date +%s) - start )) s"
  timeout 120 python3 benchmarks/disk_limits.py /tmp/mlkv-fio --seconds 4 | tee "$OUT/fio.tsv" || status=1
  for dir in /tmp/mlkv-gpu-bench /dev/shm/mlkv-gpu-bench; do  # the stores' rows/s from the disk, then memory
    mkdir -p "$dir"
    timeout 200 python3 benchmarks/bench_gpu.py --configs sgd:0.1:2 --steps 8 --warmup 4 --dir "$dir" \
      --out "$OUT/read-$(basename "$(dirname "$dir")").json" 2>&1 | grep -v USDT | tail -4 || status=1
    rm -rf "$dir"
  done
fi
if has tests; then
  echo "[gpu_check] the other tests at $(( $(date +%s) - start )) s"
  run_tests tests.log $rest
fi
echo "[gpu_check] done at $(( $(date +%s) - start )) s, status $status"
exit $status
