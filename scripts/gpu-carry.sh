#!/usr/bin/env bash
# Prepares a folder to carry to a GPU machine that has no Rust (the device machines of this
# project): builds the release binary and the GPU test binaries with `--features cuda` here,
# copies them (stripped) with gpu-env.sh, torch_baselines.py and a runner into gpu/suite/
# (git-ignored), then on the GPU machine, from the repository root:
#
#   bash gpu/suite/run.sh [tests|bench|all]      # logs and JSON under $OUT (default /tmp/out)
#
# `tests` runs every GPU test binary (the kernels crate's as kernels_gpu, each transport alone
# from the root crate's unit tests as meshflow_lib; the fault matrix test by test) on the GPUs
# present (each test prints what it skipped); `bench` runs PyTorch's
# baselines and then `meshflow bench agmm, rsmm, permute, moe` against them in the same call,
# then the copy-engine probe (`kernels/examples/peer_bandwidth.rs`); `all` does both.
# `python` runs the Python package's GPU tests (python/gpu/run.sh) from the wheel that
# scripts/python-carry.sh packs into gpu/python/ (run it too, before carrying).
#
#   scripts/gpu-carry.sh            # needs ../shared/device/gpu-env.sh and
#                                   # ../shared/bench/torch_baselines.py beside the checkout
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --release --features cuda
cargo build --release --features cuda -p meshflow-kernels --example peer_bandwidth
cargo test --release --features cuda --workspace --no-run 2>&1 | tee /tmp/gpu-carry-build.log |
  grep -E "^error" && exit 1
dest="$root/gpu/suite"
rm -rf "$dest"
mkdir -p "$dest/bin"
cp "$target/release/meshflow" "$target/release/examples/peer_bandwidth" "$dest/bin/"
for t in gpu_comm gpu_determinism gpu_errors gpu_examples gpu_faults gpu_ipc gpu_multiprocess \
         gpu_overlap gpu_programs gpu_proxy gpu_transport embed_gpu gpu_moe; do
  f="$(grep -oE "\(.*/deps/$t-[0-9a-f]+\)" /tmp/gpu-carry-build.log | tr -d '()' | tail -1)"
  [ -n "$f" ] && cp "$f" "$dest/bin/$t"
done
# The kernels crate's own GPU tests (kernels/tests/gpu.rs).
f="$(grep -oE "\(.*/deps/gpu-[0-9a-f]+\)" /tmp/gpu-carry-build.log | tr -d '()' | tail -1)"
[ -n "$f" ] && cp "$f" "$dest/bin/kernels_gpu"
# The root crate's unit tests: each GPU transport alone (src/runtime/cuda/transport/tests.rs).
f="$(grep "unittests src/lib.rs" /tmp/gpu-carry-build.log | grep -oE "\(.*/deps/meshflow-[0-9a-f]+\)" |
  tr -d '()' | tail -1)"
[ -n "$f" ] && cp "$f" "$dest/bin/meshflow_lib"
strip "$dest"/bin/* 2>/dev/null || true
cp "$root/../shared/device/gpu-env.sh" "$dest/"
# Where the tests look for examples/ (their build root) and for the meshflow binary.
echo "$root" > "$dest/built-root"
echo "$target/release/meshflow" > "$dest/built-exe"
cp "$root/../shared/bench/torch_baselines.py" "$dest/"
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
  for t in kernels_gpu gpu_comm gpu_determinism gpu_errors gpu_examples gpu_ipc gpu_multiprocess \
           gpu_programs gpu_proxy gpu_transport embed_gpu gpu_moe gpu_overlap; do
    [ -x "$B/$t" ] && step 300 "$B/$t" --test-threads 1 --nocapture
  done
  [ -x "$B/meshflow_lib" ] && step 300 "$B/meshflow_lib" runtime::cuda --test-threads 1 --nocapture
  for t in gpu_faults_mid_collective gpu_faults_mid_collective_permute gpu_faults_mid_moe_dispatch; do
    step 300 "$B/gpu_faults" "$t" --exact --test-threads 1 --nocapture
  done
}
bench() {
  step 200 env PYTHONUNBUFFERED=1 OUT="$OUT" torchrun --standalone --nproc-per-node "$n" "$S/torch_baselines.py"
  local tj="$OUT/torch_baselines_$n.json"
  for b in agmm rsmm permute moe; do
    step 400 "$B/meshflow" bench "$b" --torch "$tj" --json "$OUT/$b-$n.json"
  done
  [ "$n" -ge 2 ] && step 200 "$B/peer_bandwidth" 64 256
}
{
  log "start on $n GPU(s)"; nvidia-smi --query-gpu=name,driver_version --format=csv
  case "${1:-all}" in
    tests) tests ;;
    bench) bench ;;
    python) OUT="$OUT" bash "$root/python/gpu/run.sh" "$root/gpu/python" ;;
    *) tests; bench ;;
  esac
  log end
} 2>&1 | tee "$OUT/suite.log"
RUN
du -sh "$dest"
echo "carry gpu (or gpu/suite) to the GPU machine and run: bash gpu/suite/run.sh [tests|bench|all]"
