#!/usr/bin/env bash
set -o pipefail
ROOT=$(pwd); G=$ROOT/gpu/b
source gpu/gpu-env.sh true >/dev/null 2>&1
CUBLAS=$(find /opt /usr/local /usr/lib -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "$CUBLAS"):$LD_LIBRARY_PATH
mkdir -p /work /work/target-main/release
[ -e /work/main ] || ln -s "$ROOT" /work/main
ln -sf "$G/meshflow" /work/target-main/release/meshflow
log() { echo "=== $* ($(date +%T))"; }
step() { local t=$1; shift; log "$*"; timeout $t "$@"; echo "rc=$? for $1"; }
TJ=$OUT/torch_baselines_2.json
{
log start; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
step 160 env PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node 2 $G/torch_baselines.py
ls $OUT
export RUST_LOG=meshflow=info
step 150 $G/meshflow bench agmm --torch $TJ --json $OUT/agmm.json --trace-dir /tmp/traces
tar czf $OUT/traces.tgz -C /tmp traces
step 120 $G/meshflow bench rsmm --torch $TJ --json $OUT/rsmm.json
unset RUST_LOG
step 30 $G/gpu_proxy --test-threads 1 --nocapture
step 60 $G/gpu_overlap --test-threads 1 --nocapture
log end
} 2>&1 | tee $OUT/log
