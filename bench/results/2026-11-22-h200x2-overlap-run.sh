#!/usr/bin/env bash
# The device run behind 2026-11-22-h200x2-overlap.md, as run (from the repository root, with the
# release binaries, test binaries, gpu-env.sh and torch_baselines.py copied into gpu/overlap/).
set -o pipefail
G=gpu/overlap
source $G/gpu-env.sh true >/dev/null 2>&1
CUBLAS=$(find /opt /usr/local /usr/lib -xdev -name libcublas.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "$CUBLAS"):$LD_LIBRARY_PATH
# Tests built in /work/wt-overlap read examples/programs under their manifest dir.
[ -e /work/wt-overlap ] || { mkdir -p /work && ln -s "$(pwd)" /work/wt-overlap; }
log() { echo "=== $* ($(date +%T))"; }
step() { local t=$1; shift; log "$*"; timeout $t "$@"; echo "rc=$? for $1"; }
TJ=$OUT/torch_baselines_2.json
{
log start; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv; nvidia-smi topo -m
step 40 $G/gpu_transport --test-threads 1 --nocapture
step 150 env PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node 2 $G/torch_baselines.py
export RUST_LOG=meshflow=info
step 70 $G/meshflow bench agmm --torch $TJ --json $OUT/agmm.json --trace-dir /tmp/traces
tar czf $OUT/traces.tgz -C /tmp traces
step 25 $G/meshflow bench permute --torch $TJ --json $OUT/permute.json
unset RUST_LOG
step 40 $G/gpu_overlap --test-threads 1 --nocapture
export RUST_LOG=meshflow=info
step 70 $G/meshflow bench rsmm --torch $TJ --json $OUT/rsmm.json
step 25 $G/meshflow bench agmm --graph-only --shape 8192x8192x8192 --torch $TJ --json $OUT/agmm_graph.json
unset RUST_LOG
step 30 $G/embed_frontend
step 15 $G/gpu_comm --test-threads 1
step 15 $G/gpu_programs --test-threads 1
step 15 $G/gpu_examples --test-threads 1
step 20 $G/gpu_errors --test-threads 1
step 20 $G/embed_gpu --test-threads 1
log end
} 2>&1 | tee $OUT/log
