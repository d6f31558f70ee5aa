#!/usr/bin/env bash
# Prepares a folder to carry to a GPU machine that has no Rust (the device machines of this
# project): builds the release binary and the GPU test binaries with `--features cuda` here,
# copies them (stripped) with gpu-env.sh, torch_baselines.py and a runner into gpu/suite/
# (git-ignored), then on the GPU machine, from the repository root:
#
#   bash gpu/suite/run.sh [tests|bench|schedule|calibrate|all]   # logs and JSON under $OUT (default /tmp/out)
#
# `tests` runs every GPU test binary (the kernels crate's as kernels_gpu, each transport alone
# from the root crate's unit tests as meshflow_lib; the fault matrix test by test) on the GPUs
# present (each test prints what it skipped); `bench` runs PyTorch's baselines and then, against
# them in the same call, `meshflow bench schedule` (in one process, and one process per GPU
# under `meshflow launch`; the rows merged into $OUT/<date>-<gpu>x<n>-schedule.json), `bench
# moe` (kernels and evaluator paths, $OUT/moe-<n>.json) and `bench permute` (a few minutes on 2
# GPUs); `schedule` runs only PyTorch's baselines and the two `bench schedule` runs, and prints
# each case's default row with its ratios to the bound, to the fastest variant and to PyTorch's
# async-TP (about 3 minutes on 2 GPUs, each run capped: at most about 6); `calibrate` writes the measured profile ($OUT/profile-<n>.json); `all` runs the tests
# and the benchmarks.
# `python` runs the Python package's GPU tests (python/gpu/run.sh) from the wheel that
# scripts/python-carry.sh packs into gpu/python/ (run it too, before carrying).
#
#   GPU_ENV=path/gpu-env.sh TORCH_BASELINES=path/torch_baselines.py scripts/gpu-carry.sh
#
# gpu-env.sh (library paths of the GPU machine) and torch_baselines.py (PyTorch's figures) are
# kept outside this repository; both default to the machine's shared folder next to the
# checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
shared="$(cd "$root/.." && pwd)/shared"
gpu_env="${GPU_ENV:-$shared/device/gpu-env.sh}"
torch_baselines="${TORCH_BASELINES:-$shared/bench/torch_baselines.py}"
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --release --features cuda
cargo build --release --features cuda -p meshflow-kernels --example peer_bandwidth --example gemm_timing
cargo test --release --features cuda --workspace --no-run 2>&1 | tee /tmp/gpu-carry-build.log |
  grep -E "^error" && exit 1
dest="$root/gpu/suite"
rm -rf "$dest"
mkdir -p "$dest/bin"
# The test build above rebuilt the binary with the test hooks (feature `fault-injection`,
# `MESHFLOW_FAULT_EXIT`) that the multi-process fault tests need; it is the one carried.
cp "$target/release/meshflow" "$target/release/examples/peer_bandwidth" "$target/release/examples/gemm_timing" "$dest/bin/"
# The GPU test binaries, by source (cargo names two of them `gpu`): the root crate's
# (tests/gpu/), the binary's (cli/tests/cli_gpu/), the benchmarks' (bench/tests/bench_gpu/), and
# the kernels crate's (kernels/tests/gpu.rs as kernels_gpu, gpu_moe.rs).
pick() { # SOURCE NAME
  local f
  f="$(grep -F " $1 (" /tmp/gpu-carry-build.log | grep -oE "\(.*/deps/[^)]+\)" | tr -d '()' | tail -1)"
  [ -n "$f" ] && cp "$f" "$dest/bin/$2"
}
pick tests/gpu/main.rs gpu
pick tests/cli_gpu/main.rs cli_gpu
pick tests/bench_gpu/main.rs bench_gpu
pick tests/gpu.rs kernels_gpu
pick tests/gpu_moe.rs gpu_moe
pick tests/gpu_moe_abort.rs gpu_moe_abort
# The root crate's unit tests: each GPU transport alone (src/runtime/cuda/transport/tests.rs).
f="$(grep "unittests src/lib.rs" /tmp/gpu-carry-build.log | grep -oE "\(.*/deps/meshflow-[0-9a-f]+\)" |
  tr -d '()' | tail -1)"
[ -n "$f" ] && cp "$f" "$dest/bin/meshflow_lib"
strip "$dest"/bin/* 2>/dev/null || true
cp "$gpu_env" "$dest/gpu-env.sh"
# Where the tests look for examples/ (their build root) and for the meshflow binary.
echo "$root" > "$dest/built-root"
echo "$target/release/meshflow" > "$dest/built-exe"
cp "$torch_baselines" "$dest/torch_baselines.py"
cat > "$dest/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the carried GPU tests and/or benchmarks (see scripts/gpu-carry.sh).
set -uo pipefail
root="$(pwd)"; S="$root/gpu/suite"; B="$S/bin"; OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source "$S/gpu-env.sh" true >/dev/null 2>&1
cublas="$(find /opt /usr/local /usr/lib -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)"
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
# The tests read examples/ under the path they were built in, and gpu_proxy starts the
# meshflow binary from the build's target directory: make both resolve here.
src="$(cat "$S/built-root")"
if [ "$src" != "$root" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")"; ln -s "$root" "$src"; fi
exe="$(cat "$S/built-exe")"
if [ ! -e "$exe" ]; then mkdir -p "$(dirname "$exe")"; ln -s "$B/meshflow" "$exe"; fi
n="$(nvidia-smi -L | wc -l)"
log() { echo "=== $* ($(date +%T))"; }
step() { local t=$1; shift; log "$*"; timeout "$t" "$@"; echo "rc=$? for $*"; }
tests() {
  [ -x "$B/kernels_gpu" ] && step 300 "$B/kernels_gpu" --test-threads 1 --nocapture
  # Every GPU test of the root crate but the fault matrix and the multi-process CUDA IPC
  # tests, then those, each fault case in a process of its own.
  [ -x "$B/gpu" ] && step 600 "$B/gpu" --skip faults:: --skip ipc:: --test-threads 1 --nocapture
  # The ranks in processes of their own (CUDA IPC): copy engine and NVLink MoE.
  [ -x "$B/gpu" ] && step 400 "$B/gpu" ipc:: --test-threads 1 --nocapture
  # gpu_moe's fused-kernel test runs its covering set of eight variant combinations (about 35 s
  # each on 2 H200s; the other gpu_moe tests about 100 s).
  for t in cli_gpu gpu_moe gpu_moe_abort bench_gpu; do
    [ -x "$B/$t" ] && step "$([ "$t" = gpu_moe ] && echo 480 || echo 300)" "$B/$t" --test-threads 1 --nocapture
  done
  [ -x "$B/meshflow_lib" ] && step 300 "$B/meshflow_lib" runtime::cuda --test-threads 1 --nocapture
  for t in gpu_faults_mid_collective gpu_faults_mid_collective_permute gpu_faults_mid_moe_dispatch; do
    step 300 "$B/gpu" "faults::$t" --exact --test-threads 1 --nocapture
  done
}
torch_figures() {
  # PyTorch's figures first, in the same call; then every benchmark reads them (--torch).
  step 60 env PYTHONUNBUFFERED=1 OUT="$OUT" torchrun --standalone --nproc-per-node "$n" "$S/torch_baselines.py"
}
schedule() {
  # Each case is set up once, every variant checked once, then timed in interleaved rounds
  # (3 untimed + 40 timed rounds of 5 steps each: with 10 rounds, two variants that lower to
  # the same program measured up to 3.4 % apart at 8192^3 on 2x H200). A rank that makes no progress for
  # --timeout + 10 s ends its case as an error naming the program and the phase (or, blocked
  # inside NCCL, its process); `step` caps each run on top.
  local tj="$OUT/torch_baselines_$n.json" q=(--warmup 3 --iters 40 --steps 5 --skip-parts --timeout 15)
  # Ranks as threads of one process (procs = 1): a fresh process per shape, each running that
  # shape's AG+GEMM and GEMM+RS cases (about 30 s each on 2 GPUs) ...
  for s in 16384x8192x8192 8192x8192x8192; do
    step 90 env RUST_LOG=meshflow_bench=info "$B/meshflow" bench schedule --torch "$tj" \
      --shape "$s" --json "$OUT/schedule-threads-$n-$s.json" "${q[@]}"
  done
  # ... and one process per GPU (procs = n; rank 0 writes the rows): every case, about 50 s.
  [ "$n" -ge 2 ] && step 150 env RUST_LOG=meshflow_bench=info "$B/meshflow" launch --nproc "$n" -- \
    "$B/meshflow" bench schedule --torch "$tj" --json "$OUT/schedule-procs-$n.json" "${q[@]}"
  python3 - "$OUT" "$n" <<'PY'
import json, sys, os, datetime
out, n = sys.argv[1], sys.argv[2]
rows = []
threads = [f"schedule-threads-{n}-{s}.json" for s in ("16384x8192x8192", "8192x8192x8192")]
for f in threads + [f"schedule-procs-{n}.json"]:
    p = os.path.join(out, f)
    if os.path.exists(p):
        rows += json.load(open(p))
dev = (rows[0]["device"] if rows else "gpu").split()
model = next((w.lower() for w in dev if any(c.isdigit() for c in w)), "gpu")
name = f"{datetime.date.today()}-{model}x{n}-schedule.json"
json.dump(rows, open(os.path.join(out, name), "w"), indent=1)
print(f"{len(rows)} schedule rows in {name}")
groups = {}
for r in rows:
    groups.setdefault((r["case"], r["procs"]), []).append(r)
for (case, procs), rs in sorted(groups.items()):
    timed = [r for r in rs if r["us"] is not None]
    d = next((r for r in rs if r["default"]), None)
    if not timed or d is None or d["us"] is None:
        print(f"  {case} procs={procs}: no default figure")
        continue
    best = min(timed, key=lambda r: r["us"])
    t = d["torch_async_tp_us"]
    print(f"  {case} procs={procs}: {d['variant']} {d['us']} us = {d['us'] / d['bound_us']:.3f}x bound"
          f" ({d['bound_us']} us), {d['us'] / best['us']:.3f}x fastest ({best['variant']} {best['us']} us)"
          + (f", {d['us'] / t:.2f}x torch async-TP" if t else ""))
PY
}
bench() {
  torch_figures
  schedule
  local tj="$OUT/torch_baselines_$n.json"
  # MoE: the kernels alone and the lowered program through the evaluator.
  step 300 "$B/meshflow" bench moe --torch "$tj" --json "$OUT/moe-$n.json" --warmup 5 --iters 20 --steps 10
  [ "$n" -ge 2 ] && step 120 "$B/meshflow" bench permute --torch "$tj" --json "$OUT/permute-$n.json" --mib 256
}
calibrate() {
  step 600 "$B/meshflow" calibrate --backend cuda --out "$OUT/profile-$n.json"
}
{
  log "start on $n GPU(s)"; nvidia-smi --query-gpu=name,driver_version --format=csv
  case "${1:-all}" in
    tests) tests ;;
    bench) bench ;;
    schedule) torch_figures; schedule ;;
    calibrate) calibrate ;;
    python) OUT="$OUT" bash "$root/python/gpu/run.sh" "$root/gpu/python" ;;
    *) tests; bench ;;
  esac
  log end
} 2>&1 | tee "$OUT/suite.log"
RUN
du -sh "$dest"
echo "carry gpu (or gpu/suite) to the GPU machine and run: bash gpu/suite/run.sh [tests|bench|schedule|calibrate|all]"
