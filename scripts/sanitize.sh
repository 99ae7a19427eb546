#!/usr/bin/env bash
# The torch-free C++ (the engine, and the cache's parts that need no torch) checked three ways:
#   asan     each stress program under AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan     each stress program under ThreadSanitizer
#   threads  clang's thread-safety analysis of the lock annotations (-Wthread-safety as errors),
#            and of the embedding cache's torch files when $PYTHON (default python3) has torch
# Usage: scripts/sanitize.sh [asan|tsan|threads|all]   (needs g++; threads needs clang++)
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
out=${TMPDIR:-/tmp}/mlkv-sanitize
mkdir -p "$out"
# Sources each stress program is built from besides its own file in csrc/tests/.
torch_free_srcs="csrc/engine/*.cc csrc/id_map.cpp csrc/cache/write_back_buffer.cpp csrc/cache/admission_policy.cpp
  csrc/cache/slot_index.cpp csrc/cache/staging_area.cpp csrc/cache/slot_transfer.cpp csrc/cache/read_ahead_queue.cpp"
# The cache's files that include torch (the CUDA ones only with MLKV_WITH_CUDA, checked by scripts/build_cuda.sh).
cache_torch_srcs="csrc/cache/embedding_cache.cpp csrc/cache/fetch.cpp csrc/cache/applier.cpp csrc/cache/update_queue.cpp
  csrc/cache/read_ahead.cpp csrc/cache/write_back.cpp csrc/cache/cut.cpp csrc/cache/delete.cpp csrc/cache/device.cpp"
stress_programs=(store_stress cache_stress base_run_test)
jobs=$(nproc 2>/dev/null || echo 2)
build_and_run() {  # name, optimisation, store_stress's model seeds, sanitizer flags...
  local name=$1 optimisation=$2 seeds=$3; shift 3
  local program objects="$out/objects-$name"
  # Each source compiled once for both programs, on every core.
  mkdir -p "$objects"
  # shellcheck disable=SC2086
  printf '%s\n' $torch_free_srcs csrc/tests/*.cc | xargs -P "$jobs" -I{} sh -c \
    'g++ -std=c++17 -g1 '"$optimisation"' -fno-omit-frame-pointer -Icsrc "$@" -c "{}" -o "'"$objects"'/$(echo "{}" | tr / _).o"' \
    sh "$@"
  for program in "${stress_programs[@]}"; do
    g++ "$@" $(ls "$objects"/*.o | grep -v '_tests_') "$objects/csrc_tests_$program.cc.o" \
      -o "$out/${program}_$name" -lpthread
    echo "== $program $name"
    if [[ $program == store_stress ]]; then
      "$out/${program}_$name" "$out/data-$program-$name" "$seeds"
    else
      "$out/${program}_$name" "$out/data-$program-$name"
    fi
  done
}
# -Og for ASan: it builds in half -O1's time, and its programs run about as fast. ThreadSanitizer's
# programs spend their time running, where -O1 is faster; a race needs threads, not another random
# sequence against the model, so it runs one seed of them where ASan runs three.
if [[ $which == asan || $which == all ]]; then
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    build_and_run asan -Og 3 -fsanitize=address,undefined -fno-sanitize-recover=undefined
fi
if [[ $which == tsan || $which == all ]]; then
  TSAN_OPTIONS=halt_on_error=1 build_and_run tsan -O1 1 -fsanitize=thread
fi
if [[ $which == threads || $which == all ]]; then
  echo "== thread-safety analysis"
  # shellcheck disable=SC2086
  printf '%s\n' $torch_free_srcs csrc/tests/*.cc |
    xargs -P "$jobs" -n 1 clang++ -std=c++17 -fsyntax-only -Icsrc -Wthread-safety -Werror=thread-safety
  # The cache's files that include torch, with the include paths of the torch $PYTHON imports.
  python=${PYTHON:-python3}
  if torch_includes=$("$python" -c "import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-isystem ' + p for p in include_paths() + [sysconfig.get_paths()['include']]))" 2>/dev/null); then
    # One translation unit of them all: torch's headers, most of the time, are parsed once.
    # shellcheck disable=SC2086
    printf "#include \"$PWD/%s\"\n" $cache_torch_srcs >"$out/cache_files.cpp"
    # shellcheck disable=SC2086
    clang++ -std=c++17 -fsyntax-only -Icsrc $torch_includes -Wthread-safety -Werror=thread-safety "$out/cache_files.cpp"
    echo "thread-safety analysis of the cache's torch files: clean"
  else
    echo "thread-safety analysis of the cache's torch files: skipped ($python cannot import torch; set PYTHON)"
  fi
  echo "thread-safety analysis: clean"
fi
