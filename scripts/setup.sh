#!/usr/bin/env bash
# Sets up mlkv-torch from a fresh clone and runs the quickstart.
#   bash scripts/setup.sh                 # venv in .venv, pinned CPU stack, build, quickstart
#   bash scripts/setup.sh --no-quickstart
# A CUDA build of torch already installed is kept (the venv sees system packages);
# the script then says which fbgemm-gpu / torchrec release pairs with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${MLKV_VENV:-.venv}
TORCH_CPU_VERSION=2.13.0

apt_packages=()
command -v g++ >/dev/null 2>&1 || apt_packages+=(g++)
# clang checks the lock annotations (scripts/sanitize.sh threads); g++ builds everything.
command -v clang++ >/dev/null 2>&1 || apt_packages+=(clang)
# RocksDB's headers and library: the rocksdb storage kind (the offloading baseline) is built with them.
[[ -e /usr/include/rocksdb/db.h || ${MLKV_WITHOUT_ROCKSDB:-0} == 1 ]] || apt_packages+=(librocksdb-dev)
if ((${#apt_packages[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${apt_packages[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  else
    echo "[setup] please install ${apt_packages[*]} (Debian/Ubuntu package names); without librocksdb-dev the"
    echo "        package builds without the rocksdb storage kind"
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV (with access to system site-packages, so an installed torch is reused)"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
py="$VENV/bin/python"
pip() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

torch_line=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")' 2>/dev/null || true)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if [[ -n $torch_line && ${torch_line#* } != cpu ]]; then
  torch_version=${torch_line%% *}
  echo "[setup] keeping the installed CUDA torch $torch_version (CUDA ${torch_line#* })"
  minor=$(echo "$torch_version" | cut -d. -f2)
  echo "[setup] torch 2.$minor pairs with fbgemm-gpu 1.$((minor - 5)).x and torchrec 1.$((minor - 5)).x (their releases track torch's);"
  echo "        install them with: $py -m pip install fbgemm-gpu==1.$((minor - 5)).* && $py -m pip install --no-deps torchrec==1.$((minor - 5)).*"
  echo "torch==${torch_version}" >"$constraints"
else
  echo "[setup] installing the pinned CPU stack: torch==$TORCH_CPU_VERSION, fbgemm-gpu-cpu==1.8.0, torchrec==1.8.0"
  pip "torch==$TORCH_CPU_VERSION"
  echo "torch==$TORCH_CPU_VERSION" >"$constraints"
  pip -c "$constraints" "fbgemm-gpu-cpu==1.8.0"
  # torchrec's metadata asks for the CUDA fbgemm-gpu: install it without deps, then its real needs.
  # pip then warns "torchrec 1.8.0 requires fbgemm-gpu, which is not installed": expected,
  # fbgemm-gpu-cpu provides the same modules.
  pip --no-deps "torchrec==1.8.0"
  echo "[setup] (pip's \"torchrec 1.8.0 requires fbgemm-gpu, which is not installed\" is expected: fbgemm-gpu-cpu provides it)"
  pip -c "$constraints" "tensordict==0.15.3" "torchmetrics==1.0.3" tqdm "pyre-extensions==0.0.32" "iopath==0.1.10"
fi
echo "[setup] installing tools for tests and benchmarks"
pip -c "$constraints" numpy pyyaml "pydantic>=2,<3" "pyarrow>=25" "torchdata==0.11.0" tensorboard matplotlib pytest \
  hypothesis ninja rocksdict lmdb "ruff==0.17.6" "clang-format==23.1.5" "ray[data]==2.60.0"
echo "[setup] building mlkv_torch (C++ extension, no build isolation so the installed torch is used)"
pip -c "$constraints" --no-build-isolation -e .
"$py" -c 'import mlkv_torch, torch; rocks = "with" if mlkv_torch._C.with_rocksdb else "without"
print(f"[setup] mlkv_torch {mlkv_torch.__version__} built against torch {torch.__version__}, {rocks} RocksDB")'
if [[ ${1:-} != --no-quickstart ]]; then
  if [[ -e runs/quickstart ]]; then  # setup run again: the quickstart starts over, not from its tables
    echo "[setup] removing the earlier quickstart run in runs/quickstart"
    rm -rf runs/quickstart
  fi
  echo "[setup] running the quickstart: $py -m mlkv_torch.train configs/quickstart.yaml"
  "$py" -m mlkv_torch.train configs/quickstart.yaml --no-progress
fi
