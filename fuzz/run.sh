#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) and prints one table row per target:
#   | target | seconds | executions | crashes | machine |
# Needs cargo-fuzz (`cargo install cargo-fuzz`). cargo-fuzz needs a nightly compiler (it
# passes -Zsanitizer=address); on a stable toolchain RUSTC_BOOTSTRAP=1 unlocks it.
# A crash leaves its input in fuzz/artifacts/<target>/ (reproduce with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> <file>`); the row then says which.
# Targets can be chosen: fuzz/run.sh 60 parse_host verify
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
secs="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(parse_program parse_host verify lower_check_run)
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$here/target}"
cd "$here"
./seed.sh >/dev/null
machine="$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
logs="$here/logs"
mkdir -p "$logs"
cargo fuzz build -O >"$logs/build.txt" 2>&1 || {
  echo "building the fuzz targets failed, see $logs/build.txt" >&2; exit 1; }
echo "| target | seconds | executions | crashes | machine |"
echo "|---|---|---|---|---|"
status=0
for t in "${targets[@]}"; do
  log="$logs/$t.txt"
  # -rss_limit_mb / -malloc_limit_mb: an absurd allocation is a crash (OOM).
  # -timeout: one input running longer than 10 s is a hang.
  cargo fuzz run -O "$t" "corpus/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -print_final_stats=1 >"$log" 2>&1
  rc=$?
  execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$')"
  [ -z "$execs" ] && execs="$(grep -o '#[0-9]*' "$log" | tail -1 | tr -d '#')"
  crashes=0
  found="$(grep -o 'Test unit written to [^ ]*' "$log" | sed 's/Test unit written to //' || true)"
  if [ "$rc" -ne 0 ] || [ -n "$found" ]; then
    crashes=1
    status=1
    kind="$(grep -m1 -oE 'ERROR: libFuzzer: [a-z-]+|panicked at [^:]*:[0-9]+|deadly signal' "$log" || echo "exit $rc")"
    crashes="1 ($kind: ${found:-see $log})"
  fi
  echo "| $t | $secs | ${execs:-?} | $crashes | $machine |"
done
exit $status
