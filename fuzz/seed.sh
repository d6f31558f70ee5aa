#!/usr/bin/env bash
# Seeds fuzz/corpus/<target>/ from the repository's programs (idempotent):
#   parse_program, lower_check_run: examples/programs/*.mf, tests/data/**/*.mf
#   parse_host: ir/tests/data/host/*.mfh, tests/data/**/*.mfh, fuzz/seeds/*.mfh
#   verify: all of them, level-1 files prefixed with `1`, host files with `h`
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
corpus="$here/corpus"
mkdir -p "$corpus"/{parse_program,parse_host,verify,lower_check_run}

mf=()
while IFS= read -r f; do mf+=("$f"); done < <(
  find "$root/examples/programs" "$root/tests/data" "$here/seeds" -name '*.mf' 2>/dev/null | sort)
mfh=()
while IFS= read -r f; do mfh+=("$f"); done < <(
  find "$root/ir/tests/data/host" "$root/tests/data" "$here/seeds" -name '*.mfh' 2>/dev/null | sort)

seed_name() { # unique, stable file name for a seed path
  local rel="${1#"$root"/}"
  echo "seed-${rel//\//_}"
}
for f in "${mf[@]}"; do
  n="$(seed_name "$f")"
  cp "$f" "$corpus/parse_program/$n"
  cp "$f" "$corpus/lower_check_run/$n"
  { printf '1'; cat "$f"; } > "$corpus/verify/$n"
done
for f in "${mfh[@]}"; do
  n="$(seed_name "$f")"
  cp "$f" "$corpus/parse_host/$n"
  { printf 'h'; cat "$f"; } > "$corpus/verify/$n"
done
echo "seeded ${#mf[@]} level-1 and ${#mfh[@]} host programs into $corpus"
