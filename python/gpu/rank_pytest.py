"""Runs the GPU tests on one rank (started by torchrun from run.sh): pytest with a JUnit report
per rank under $OUT, output lines prefixed by the rank."""

import os
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    args = [str(here), "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={out}/python-gpu-rank{rank}.xml"]
    sys.exit(pytest.main(args + sys.argv[1:]))
