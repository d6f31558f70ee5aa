#!/usr/bin/env bash
# The MoE check on 2 GPUs (about 20 minutes: the fused kernels' test runs its covering set of eight
# variant combinations, twice), from the repository root on the GPU machine,
# with the folder scripts/gpu-carry.sh prepared:
#
#   bash scripts/moe-gpu-check.sh gpu/suite      # logs and JSON under $OUT (default /tmp/out)
#
# 1. The essential MoE GPU tests at W=2 (MESHFLOW_MOE_WORLDS=2): NVLink fused (v2, every
#    variant, also with odd chunk sizes per phase) and split (v1) kernels, NCCL, the CUDA graph
#    replay, the abort word, the IPC pair, the runtime's MoE tests (the evaluator handing the
#    top-k weights to the dispatch or to the combine included), each MoE transport alone.
# 2. PyTorch's figures, then `meshflow bench moe` (kernels and evaluator paths, NVLink and NCCL,
#    native and fp8-block128, T=128 and 4096) against them: $OUT/moe-2.json.
# 3. A diagnostic matrix (kernels path, NVLink): v1 against v2, the weights at the dispatch or
#    at the combine (as the evaluator gives them), the sub-phases of a step, the fused
#    kernels' chunk per phase at T=4096, and the variants of the fused kernels
#    (MESHFLOW_MOE_FUSED_DISPATCH=auto|generic|wire|warp, MESHFLOW_MOE_FUSED_COMBINE=
#    twopass|onepass|warp) at T=128 and 4096, bf16 and fp8, the warp combine also with 1, 2,
#    4 and 8 tokens per chunk at T=4096, and every block shape of the block combine
#    (MESHFLOW_MOE_COMBINE_BLOCK) at T=4096 and 128; $OUT/diag.tsv sums it up.
set -uo pipefail
S="${1:-gpu/suite}"
root="$(pwd)"; S="$(cd "$S" && pwd)"; B="$S/bin"; OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# The environment of gpu/suite/run.sh: library paths, and the build paths the tests expect.
source "$S/gpu-env.sh" true >/dev/null 2>&1
cublas="$(find /opt /usr/local /usr/lib -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
src="$(cat "$S/built-root")"
if [ "$src" != "$root" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")"; ln -s "$root" "$src"; fi
exe="$(cat "$S/built-exe")"
if [ ! -e "$exe" ]; then mkdir -p "$(dirname "$exe")"; ln -s "$B/meshflow" "$exe"; fi
n="$(nvidia-smi -L | wc -l)"
log() { echo "=== $* ($(date +%T))"; }
step() { local t=$1; shift; log "$*"; timeout "$t" "$@"; echo "rc=$? for $*"; }
M="$B/meshflow"
# One diagnostic row: LABEL, then env assignments and `bench moe` arguments (one case each).
diag() {
  local label=$1; shift
  local envs=() args=()
  for a in "$@"; do
    if [[ "$a" == *=* && "$a" != --* ]]; then envs+=("$a"); else args+=("$a"); fi
  done
  log "diag $label: ${envs[*]} bench moe ${args[*]}"
  local txt
  txt="$(timeout 60 env ${envs[@]+"${envs[@]}"} "$M" bench moe --warmup 5 --iters 30 --steps 10 "${args[@]}" 2>&1)"
  echo "$txt"
  # The result lines: transport, W, T, ..., dispatch_us (col 10), ..., combine_us (col 13).
  echo "$txt" | awk -v l="$label" '$2 ~ /^[0-9]+$/ && NF >= 15 { printf "%s\t%s\t%s\t%s\t%s\t%s\n", l, $1, $3, $9, $10, $13 }' \
    >> "$OUT/diag.tsv"
}
{
  log "start on $n GPU(s)"; nvidia-smi --query-gpu=name,driver_version --format=csv
  q=(--test-threads 1 --nocapture)
  # 1. Tests.
  # The fused kernels' test runs the covering set of variant combinations (eight; it prints
  # them; MESHFLOW_MOE_ALL_VARIANTS=1 runs all 63), about 35 s each on 2 H200s.
  step 360 env MESHFLOW_MOE_WORLDS=2 "$B/gpu_moe" "${q[@]}" nvlink_fused_kernels_match_reference
  step 150 env MESHFLOW_MOE_WORLDS=2 "$B/gpu_moe" "${q[@]}" nvlink_split_kernels_match_reference \
    nccl_transport_matches_reference nvlink_step_replays_in_a_cuda_graph overflow_and_bad_ids_are_flagged_without_corruption \
    phases_out_of_order nvlink_ipc_two_processes
  step 360 env MESHFLOW_MOE_WORLDS=2 MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_DISPATCH_CHUNK=3 \
    MESHFLOW_MOE_COMBINE_CHUNK=5 "$B/gpu_moe" "${q[@]}" nvlink_fused_kernels_match_reference
  # The warp combine in a CUDA graph and across processes (CUDA IPC).
  step 90 env MESHFLOW_MOE_WORLDS=2 MESHFLOW_MOE_FUSED_COMBINE=warp "$B/gpu_moe" "${q[@]}" \
    nvlink_step_replays_in_a_cuda_graph nvlink_ipc_two_processes
  step 60 "$B/gpu_moe_abort" "${q[@]}"
  step 90 "$B/gpu" "${q[@]}" moe --skip faults::
  # Each MoE transport alone, the weights given at the dispatch, at the combine, cast from
  # bf16, and a combine naming other weights than its dispatch carried (an error).
  [ -x "$B/meshflow_lib" ] && step 90 "$B/meshflow_lib" "${q[@]}" runtime::cuda::transport::tests::moe
  # 2. PyTorch's figures, then the benchmark rows.
  tj="$OUT/torch_baselines_$n.json"
  step 120 env PYTHONUNBUFFERED=1 OUT="$OUT" torchrun --standalone --nproc-per-node "$n" "$S/torch_baselines.py"
  step 180 "$M" bench moe --torch "$tj" --json "$OUT/moe-$n.json" --warmup 5 --iters 20 --steps 10
  # 3. Diagnostics at T=128 (kernels path over NVLink unless named).
  : > "$OUT/diag.tsv"
  k128=(--path kernels --transport nvlink --tokens 128 --wire native)
  diag v1 MESHFLOW_MOE_KERNELS=v1 "${k128[@]}"
  diag v2 MESHFLOW_MOE_KERNELS=v2 "${k128[@]}"
  diag v2-late MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_BENCH_LATE_WEIGHTS=1 "${k128[@]}"
  diag v2-late-phases MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_BENCH_LATE_WEIGHTS=1 \
    MESHFLOW_MOE_BENCH_PHASES=1 RUST_LOG=meshflow_bench=info "${k128[@]}"
  diag eval-v1 MESHFLOW_MOE_KERNELS=v1 --path evaluator --transport nvlink --tokens 128 --wire native
  diag eval-v2 MESHFLOW_MOE_KERNELS=v2 --path evaluator --transport nvlink --tokens 128 --wire native
  diag eval-warp MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_DISPATCH=warp --path evaluator \
    --transport nvlink --tokens 128 --wire native
  # FP8 at T=4096 (the fused dispatch was pathological) and the chunk per phase.
  k4k=(--path kernels --transport nvlink --tokens 4096)
  diag fp8-v1 MESHFLOW_MOE_KERNELS=v1 "${k4k[@]}" --wire fp8-block128
  diag fp8-v2-d1 MESHFLOW_MOE_DISPATCH_CHUNK=1 "${k4k[@]}" --wire fp8-block128
  diag chunk-d1-c8 MESHFLOW_MOE_DISPATCH_CHUNK=1 MESHFLOW_MOE_COMBINE_CHUNK=8 "${k4k[@]}" --wire native
  diag chunk-d2-c4 MESHFLOW_MOE_DISPATCH_CHUNK=2 MESHFLOW_MOE_COMBINE_CHUNK=4 "${k4k[@]}" --wire native
  diag chunk-v1 MESHFLOW_MOE_KERNELS=v1 "${k4k[@]}" --wire native
  # The variants of the fused kernels (generic = the dispatch kernel before the per-wire ones).
  gen=(MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_DISPATCH=generic MESHFLOW_MOE_FUSED_COMBINE=twopass)
  wire=(MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_DISPATCH=wire MESHFLOW_MOE_FUSED_COMBINE=twopass)
  one=(MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_DISPATCH=wire MESHFLOW_MOE_FUSED_COMBINE=onepass)
  # The warp dispatch (a warp per item, no block barrier per token, rows loaded before routing).
  warp=(MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_DISPATCH=warp MESHFLOW_MOE_FUSED_COMBINE=twopass)
  for w in native fp8-block128; do
    diag "var-generic-$w-128" "${gen[@]}" "${k128[@]/native/$w}"
    diag "var-wire-$w-128" "${wire[@]}" "${k128[@]/native/$w}"
    diag "var-warp-$w-128" "${warp[@]}" "${k128[@]/native/$w}"
    diag "var-generic-$w-4k" "${gen[@]}" "${k4k[@]}" --wire "$w"
    diag "var-wire-$w-4k" "${wire[@]}" "${k4k[@]}" --wire "$w"
    diag "var-warp-$w-4k" "${warp[@]}" "${k4k[@]}" --wire "$w"
  done
  # The warp dispatch with other chunks at T=4096 (more tokens per warp item, fewer fences).
  diag var-warp-4k-d4 "${warp[@]}" MESHFLOW_MOE_DISPATCH_CHUNK=4 "${k4k[@]}" --wire native
  diag var-warp-4k-d1 "${warp[@]}" MESHFLOW_MOE_DISPATCH_CHUNK=1 "${k4k[@]}" --wire native
  diag var-onepass-128 "${one[@]}" "${k128[@]}"
  diag var-onepass-4k "${one[@]}" "${k4k[@]}" --wire native
  diag var-onepass-4k-c8 "${one[@]}" MESHFLOW_MOE_COMBINE_CHUNK=8 "${k4k[@]}" --wire native
  # The warp combine (a warp per item, one-pass consumer; the default dispatch), then its chunk
  # at T=4096 (the default there is 1).
  wcomb=(MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_FUSED_COMBINE=warp)
  for w in native fp8-block128; do
    diag "var-wcomb-$w-128" "${wcomb[@]}" "${k128[@]/native/$w}"
    diag "var-wcomb-$w-4k" "${wcomb[@]}" "${k4k[@]}" --wire "$w"
  done
  for c in 1 2 4 8; do
    diag "var-wcomb-4k-c$c" "${wcomb[@]}" MESHFLOW_MOE_COMBINE_CHUNK=$c "${k4k[@]}" --wire native
  done
  # The block combine's shapes (the default combine: one pass at T=4096, two at T=128).
  for b in 256x2 256x2p 448x1 448x1p 448x2n1 896x1n1 512x1 512x1p 224x4n1 128x8n1; do
    diag "var-block-$b-4k" MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_COMBINE_BLOCK=$b "${k4k[@]}" --wire native
    diag "var-block-$b-128" MESHFLOW_MOE_KERNELS=v2 MESHFLOW_MOE_COMBINE_BLOCK=$b "${k128[@]}"
  done
  log "diagnostics (label, transport, T, wire, dispatch_us, combine_us)"
  cat "$OUT/diag.tsv"
  # The bench rows against the goals (evaluator path, bf16, 2 GPUs).
  python3 - "$OUT/moe-$n.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no bench rows: {e}")
goal = {128: 30.0, 4096: 250.0}
print(f"{'path':<10}{'transport':<14}{'dtype':<14}{'T':>6}{'disp_us':>10}{'comb_us':>10}{'torch d/c':>18}  goal")
for r in rows:
    g = goal.get(r["tokens"])
    ok = ""
    tr = r["transport"] + ("+graph" if r.get("graph") else "")
    if r["path"] == "evaluator" and r["dtype"] == "bf16" and tr.startswith("nvlink") and g:
        ok = "MET" if r["dispatch_us"] <= g and r["combine_us"] <= g else f"missed (<= {g:.0f})"
    td, tc = r.get("torch_dispatch_us"), r.get("torch_combine_us")
    t = f"{td:.1f}/{tc:.1f}" if td is not None and tc is not None else "-"
    print(f"{r['path']:<10}{tr:<14}{r['dtype']:<14}{r['tokens']:>6}"
          f"{r['dispatch_us']:>10.1f}{r['combine_us']:>10.1f}{t:>18}  {ok}")
PY
  log end
} 2>&1 | tee "$OUT/moe-check.log"
