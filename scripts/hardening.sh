#!/usr/bin/env bash
# Produces the tables of docs/hardening.md: fuzzing, fault injection, memory, determinism,
# the mutation corpus, bad inputs and the race checker's run time.
#
#   scripts/hardening.sh                 # CPU rows; fuzzing 60 s per target
#   FUZZ_SECONDS=300 scripts/hardening.sh
#   NO_FUZZ=1 scripts/hardening.sh       # skip fuzzing (needs cargo-fuzz otherwise)
#   scripts/hardening.sh --gpu           # also the GPU rows (needs GPUs and the CUDA libraries)
#
# Every row comes from a test or the fuzz script; the tests assert what the rows say:
#   fuzz/run.sh SECONDS                                   fuzzing rows
#   cargo test --release --test hardening fault_matrix    fault rows (CPU)
#   cargo test --release --test hardening resources       memory rows (CPU)
#   cargo test --release --test hardening determinism     determinism rows (CPU)
#   cargo test --release --test check mutations           mutations rejected / total
#   cargo test --release --test check bad_inputs          bad inputs tried, panics
#   cargo test --release --test runtime -- --ignored race_check_timings   race-check time
#   cargo test --release --features cuda --test gpu -- faults:: determinism::   GPU rows
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
gpu=0
[ "${1:-}" = "--gpu" ] && gpu=1
status=0
rows="$(mktemp)"
trap 'rm -f "$rows"' EXIT

echo "## Fuzzing"
echo
if [ -n "${NO_FUZZ:-}" ]; then
  echo "(skipped: NO_FUZZ is set)"
elif ! cargo fuzz --version >/dev/null 2>&1; then
  echo "(not run: cargo-fuzz is not installed; \`cargo install cargo-fuzz\`)"
else
  fuzz/run.sh "${FUZZ_SECONDS:-60}" || status=1
fi
echo

run_tests() { # cargo test args... [-- test filters]; collects HARDENING rows
  local log
  log="$(mktemp)"
  if ! cargo test --release "$@" --nocapture --test-threads=1 >"$log" 2>&1; then
    echo "FAILED: cargo test --release $*" >&2
    grep -E "panicked|FAILED|error" "$log" | head -20 >&2
    status=1
  fi
  grep -o 'HARDENING|.*' "$log" >>"$rows"
  rm -f "$log"
}
run_tests --test hardening --
run_tests --test check -- mutations:: bad_inputs::
timing_log="$(mktemp)"
if ! cargo test --release --test runtime -- --ignored --nocapture race_check_timings \
  >"$timing_log" 2>&1; then
  echo "FAILED: race_check_timings" >&2
  status=1
fi
grep -o 'HARDENING|.*' "$timing_log" >>"$rows"
rm -f "$timing_log"
if [ "$gpu" = 1 ]; then
  run_tests --features cuda --test gpu -- faults:: determinism::
fi
gpu_cmd='cargo test --release --features cuda --test gpu -- --nocapture --test-threads=1 faults:: determinism::'

table() { # name header separator [gpu placeholder]
  local name="$1"
  echo "$2"
  echo "$3"
  grep "^HARDENING|$name|" "$rows" | cut -d'|' -f3- |
    awk -F'|' '{ printf "|"; for (i = 1; i <= NF; i++) printf " %s |", $i; print "" }'
  if ! grep -q "^HARDENING|$name|cuda|" "$rows"; then
    echo "| cuda | not run yet: \`$gpu_cmd\` (or \`scripts/hardening.sh --gpu\`) |"
  fi
  echo
}

echo "## Fault injection"
echo
table faults "| backend | operation | ranks | fault | every rank stopped after | undelivered messages | result |" \
  "|---|---|---|---|---|---|---|"
echo "## Memory (reused evaluator: after 10 steps / after 1000 steps)"
echo
table memory "| backend | example | ranks | VmRSS | VmHWM | CPU buffers live | open fds |" \
  "|---|---|---|---|---|---|---|"
echo "## Determinism"
echo
table determinism "| backend | example | same seed | stream pool | lowering | other seed |" \
  "|---|---|---|---|---|---|"
plain() { # name header separator: rows without a GPU placeholder
  echo "$2"
  echo "$3"
  grep "^HARDENING|$1|" "$rows" | cut -d'|' -f3- |
    awk -F'|' '{ printf "|"; for (i = 1; i <= NF; i++) printf " %s |", $i; print "" }'
  echo
}
echo "## Static check: mutation corpus"
echo
plain mutations "| rejected with the expected message | mutations |" "|---|---|"
echo "## Bad inputs"
echo
plain bad_inputs "| inputs | panics | outcomes |" "|---|---|---|"
echo "## Race checking: stream all-reduce loop, 2 ranks, CPU backend"
echo
plain race_time "| iterations | race checking on | off |" "|---|---|---|"
exit $status
