#!/usr/bin/env bash
# Builds the torch-free engine with its stress test under AddressSanitizer +
# UndefinedBehaviorSanitizer and under ThreadSanitizer, and runs both.
# Usage: scripts/sanitize.sh [asan|tsan|all]   (needs only g++)
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
out=${TMPDIR:-/tmp}/mlkv-sanitize
mkdir -p "$out"
srcs="csrc/engine/*.cc csrc/tests/store_stress.cc"
build_and_run() {  # name flags...
  local name=$1; shift
  g++ -std=c++17 -g -O1 -fno-omit-frame-pointer -Icsrc "$@" $srcs -o "$out/store_stress_$name" -lpthread
  echo "== $name"
  "$out/store_stress_$name" "$out/data-$name"
}
if [[ $which == asan || $which == all ]]; then
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    build_and_run asan -fsanitize=address,undefined -fno-sanitize-recover=undefined
fi
if [[ $which == tsan || $which == all ]]; then
  TSAN_OPTIONS=halt_on_error=1 build_and_run tsan -fsanitize=thread
fi
