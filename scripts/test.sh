#!/usr/bin/env bash
# The test suite, then its comparisons with torch, TorchRec and fbgemm again under each CPU
# capability torch can dispatch to here (ATEN_CPU_CAPABILITY): torch rounds differently on each,
# and a claim must hold on every CPU a user runs it on (docs/testing.md, "How exact").
#
#   bash scripts/test.sh [pytest arguments for the whole suite]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
comparisons=(tests/core/test_optim.py tests/core/test_table_batch_exact.py
  tests/torchrec_integration/test_torchrec_collection.py tests/core/test_disk_embedding_bag.py tests/core/test_table_batch.py
  tests/torchrec_integration/test_model_zoo.py tests/torchrec_integration/test_torchrec_sequence.py)
"$py" -m pytest -q --durations=20 tests "$@"
capabilities=(default avx2)
grep -q avx512f /proc/cpuinfo 2>/dev/null && capabilities+=(avx512)
for capability in "${capabilities[@]}"; do
  echo "[test] the comparisons under ATEN_CPU_CAPABILITY=$capability"
  ATEN_CPU_CAPABILITY=$capability "$py" -m pytest -q -p no:cacheprovider "${comparisons[@]}"
done
