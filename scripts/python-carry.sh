#!/usr/bin/env bash
# Builds the Python package's CUDA wheel (one abi3 wheel for CPython >= 3.10, CUDA and NCCL
# loaded at run time) and packs it with the wheels of pytest and numpy (for a GPU machine whose
# Python lacks them, without network) into gpu/python/ (git-ignored). Then, on the GPU machine,
# from the repository root:
#
#   bash python/gpu/run.sh                 # logs, JUnit and JSON under $OUT (default /tmp/out)
#
# Needs a Rust toolchain and PyPI (maturin, pytest, numpy) here; uses a virtual environment in
# target/python-carry-venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
dest="$root/gpu/python"
venv="$root/target/python-carry-venv"
[ -x "$venv/bin/maturin" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q "maturin>=1.9.4,<2"; }
rm -rf "$dest"
mkdir -p "$dest/wheels"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" \
  "$venv/bin/maturin" build --release --features cuda -m python/Cargo.toml --out "$dest"
# pytest and numpy for CPython 3.12 on x86-64 Linux (the GPU machines' Python).
"$venv/bin/pip" download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dest/wheels" \
  pytest numpy
ls -la "$dest" "$dest/wheels"
du -sh "$dest"
echo "carry gpu (or gpu/python) to the GPU machine and run: bash python/gpu/run.sh"
