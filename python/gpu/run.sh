#!/usr/bin/env bash
# Runs the Python package's GPU tests (python/gpu/test_*.py) on this machine's GPUs, one process
# per GPU under torchrun, from a wheel built elsewhere (scripts/python-carry.sh packs it with
# the wheels of pytest and numpy into gpu/python/). From the repository root:
#
#   bash python/gpu/run.sh [CARRY_DIR] [-- PYTEST_ARGS...]   # default CARRY_DIR: gpu/python
#
# Installs the wheel (and pytest/numpy when the interpreter lacks them) into a temporary
# directory with `pip install --no-index --no-deps --target`, keeps NVLink multicast off, runs
# `torchrun --standalone --nproc-per-node N` (N: $NPROC, default 2) and writes under $OUT
# (default /tmp/out): python-gpu.log, python-gpu-rank<R>.xml (JUnit) and python_agmm_<N>.json
# (the timings next to torch async-TP). Exits with torchrun's status.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
carry="$root/gpu/python"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then carry="$(cd "$1" && pwd)"; shift; fi
[ "${1:-}" = "--" ] && shift
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export OUT

PY=""
for c in "${PYTHON:-}" /opt/torch/.venv/bin/python3 python3; do
  [ -n "$c" ] || continue
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then PY="$c"; break; fi
done
if [ -z "$PY" ]; then echo "run.sh: no python with torch found (set PYTHON)" >&2; exit 2; fi

site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
wheel="$(ls "$carry"/meshflow-*.whl 2>/dev/null | head -1)"
if [ -z "$wheel" ]; then echo "run.sh: no meshflow wheel in $carry" >&2; exit 2; fi
"$PY" -m pip install -q --no-index --no-deps --target "$site" "$wheel" || exit 2
if ! "$PY" -c "import numpy" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target "$site" "$carry"/wheels/numpy-*.whl || exit 2
fi
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  others="$(ls "$carry"/wheels/*.whl | grep -v '/numpy-')"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --target "$site" $others || exit 2
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}" PYTHONUNBUFFERED=1
n="${NPROC:-2}"

cd "$root"
{
  echo "=== python GPU tests on $n GPU(s) ($(date +%T)), wheel $(basename "$wheel"), $("$PY" -c 'import torch; print("torch", torch.__version__)')"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  timeout "${TIMEOUT:-1500}" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
    python/gpu/rank_pytest.py "$@"
  rc=$?
  echo "=== rc=$rc ($(date +%T))"
  exit $rc
} 2>&1 | tee "$OUT/python-gpu.log"
exit "${PIPESTATUS[0]}"
