#!/usr/bin/env bash
# This session's device calls: `bash gpu/suite/session.sh A` (tests + permute + probe) or `B`
# (PyTorch baselines + bench agmm).
set -uo pipefail
root="$(pwd)"; S="$root/gpu/suite"; B="$S/bin"; OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source "$S/gpu-env.sh" true >/dev/null 2>&1
cublas="$(find /opt /usr/local /usr/lib -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
src="$(cat "$S/built-root")"
if [ "$src" != "$root" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")"; ln -s "$root" "$src"; fi
exe="$(cat "$S/built-exe")"
if [ ! -e "$exe" ]; then mkdir -p "$(dirname "$exe")"; ln -s "$B/meshflow" "$exe"; fi
log() { echo "=== $* ($(date +%T))"; }
step() { local t=$1; shift; log "$*"; timeout "$t" "$@"; echo "rc=$? for $*"; }
{
log "start $1"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
case "$1" in
A)
  for t in kernels_gpu gpu_comm gpu_determinism gpu_errors gpu_examples gpu_multiprocess \
           gpu_programs gpu_proxy gpu_transport embed_gpu gpu_moe gpu_overlap; do
    [ -x "$B/$t" ] && step 300 "$B/$t" --test-threads 1 --nocapture
  done
  for t in gpu_faults_mid_collective gpu_faults_mid_collective_permute gpu_faults_mid_moe_dispatch; do
    step 300 "$B/gpu_faults" "$t" --exact --test-threads 1 --nocapture
  done
  for s in 10 50; do step 120 "$B/meshflow" bench permute --steps $s --json "$OUT/permute-s$s.json"; done
  step 120 "$B/peer_bandwidth" 64 256
  ;;
B)
  step 160 env PYTHONUNBUFFERED=1 OUT="$OUT" torchrun --standalone --nproc-per-node 2 "$S/torch_baselines.py"
  step 300 "$B/meshflow" bench agmm --torch "$OUT/torch_baselines_2.json" --json "$OUT/agmm.json"
  ;;
esac
log end
} 2>&1 | tee "$OUT/session-$1.log"
