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
torch_free_srcs="csrc/engine/*.cc csrc/id_map.cpp csrc/write_back_buffer.cpp csrc/admission_policy.cpp
  csrc/slot_index.cpp csrc/staging_area.cpp csrc/slot_transfer.cpp"
stress_programs=(store_stress cache_stress)
build_and_run() {  # sanitizer flags...
  local name=$1; shift
  local program
  for program in "${stress_programs[@]}"; do
    g++ -std=c++17 -g -O1 -fno-omit-frame-pointer -Icsrc "$@" $torch_free_srcs "csrc/tests/$program.cc" \
      -o "$out/${program}_$name" -lpthread
    echo "== $program $name"
    "$out/${program}_$name" "$out/data-$program-$name"
  done
}
if [[ $which == asan || $which == all ]]; then
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    build_and_run asan -fsanitize=address,undefined -fno-sanitize-recover=undefined
fi
if [[ $which == tsan || $which == all ]]; then
  TSAN_OPTIONS=halt_on_error=1 build_and_run tsan -fsanitize=thread
fi
if [[ $which == threads || $which == all ]]; then
  echo "== thread-safety analysis"
  for src in $torch_free_srcs csrc/tests/*.cc; do
    clang++ -std=c++17 -fsyntax-only -Icsrc -Wthread-safety -Werror=thread-safety "$src"
  done
  # The cache's files that include torch, with the include paths of the torch $PYTHON imports.
  python=${PYTHON:-python3}
  if torch_includes=$("$python" -c "import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-isystem ' + p for p in include_paths() + [sysconfig.get_paths()['include']]))" 2>/dev/null); then
    for src in csrc/embedding_cache.cpp csrc/cache_*.cpp; do
      clang++ -std=c++17 -fsyntax-only -Icsrc $torch_includes -Wthread-safety -Werror=thread-safety "$src"
    done
    echo "thread-safety analysis of the cache's torch files: clean"
  else
    echo "thread-safety analysis of the cache's torch files: skipped ($python cannot import torch; set PYTHON)"
  fi
  echo "thread-safety analysis: clean"
fi
