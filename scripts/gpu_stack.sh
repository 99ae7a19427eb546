#!/usr/bin/env bash
# The stack a GPU machine without a network lacks, carried in the ignored folder .gpu-stack/:
# torchrec, the fbgemm-gpu-cpu release that pairs with that machine's torch, their pure-Python
# needs, pydantic and torchdata (the runner's), and fio (for benchmarks/disk_limits.py).
#
#   bash scripts/gpu_stack.sh download [PYTHON_VERSION TORCH_MINOR]   # here, with a network (default 3.12 11)
#   bash scripts/gpu_stack.sh install                                 # there: into .gpu-stack/site
#
# `install` prints the PYTHONPATH and PATH lines to export; MLKV_GPU_STACK names another folder. TorchRec's releases track torch's
# (torch 2.N pairs with fbgemm-gpu and torchrec 1.(N-5)); the CPU build of fbgemm is enough for the
# collection and the runner, whose kernels are ours. fio is built from source (FIO_SRC: a checkout
# to build from, else FIO_GIT is cloned), with io_uring, linked only to libc, libm and zlib.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK=$(realpath -m "${MLKV_GPU_STACK:-.gpu-stack}")  # where the wheels, fio and the installed packages go
what=${1:-}

download() {
  local python_version=${1:-3.12} minor=${2:-11}
  local wheels=$STACK/wheels
  rm -rf "$wheels" && mkdir -p "$wheels"
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  local pinned=("fbgemm-gpu-cpu==1.$((minor - 5)).*" "torchrec==1.$((minor - 5)).*" "tensordict==0.$minor.*"
    "pyvers<0.3" orjson importlib_metadata portalocker "torchdata==0.11.0")
  for requirement in "${pinned[@]}"; do
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$python_version" --implementation cp "${platforms[@]}" -d "$wheels" "$requirement"
  done
  # pydantic (the runner's config) with its needs: pydantic-core is pinned by pydantic's own metadata.
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d "$wheels" "pydantic>=2,<3"
  # iopath publishes no wheel: build one from its source distribution (pure Python).
  python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" "iopath==0.1.10"
  local fio_src=${FIO_SRC:-}
  if [[ -z $fio_src ]]; then
    fio_src=$(mktemp -d)
    git clone -q --depth 1 "${FIO_GIT:-https://github.com/axboe/fio}" "$fio_src"
  fi
  (cd "$fio_src" && ./configure --disable-native >/dev/null && make -s -j"$(nproc)" fio >/dev/null)
  mkdir -p "$STACK/bin" && cp "$fio_src/fio" "$STACK/bin/fio"
  du -sh "$STACK"
  ls "$wheels"
}

install() {
  [[ -d $STACK/wheels ]] || { echo "no $STACK/wheels: run 'bash scripts/gpu_stack.sh download' first" >&2; exit 1; }
  # The machine's own packages (torch, numpy, torchmetrics...) stay; only what it lacks is added.
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
    --target "$STACK/site" "$STACK"/wheels/*.whl
  echo "export PYTHONPATH=$STACK/site\${PYTHONPATH:+:\$PYTHONPATH} PATH=$STACK/bin:\$PATH"
}

case $what in
  download) shift; download "$@" ;;
  install) install ;;
  *) echo "usage: bash scripts/gpu_stack.sh download [PYTHON_VERSION TORCH_MINOR] | install" >&2; exit 2 ;;
esac
