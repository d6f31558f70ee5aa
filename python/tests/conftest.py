"""Shared fixtures of the CPU tests: the repository's example programs."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "programs").glob("*.mf"))


def example(name: str) -> Path:
    """The path of the example program `name` (without `.mf`)."""
    return REPO / "examples" / "programs" / f"{name}.mf"


@pytest.fixture(params=[p.stem for p in EXAMPLES])
def example_path(request: pytest.FixtureRequest) -> Path:
    """Every example program of the repository."""
    return example(request.param)


def agmm(d: int, dtype: str = "f32", m: int = 16, n: int = 12, k: int = 32):
    """y = all_gather(x) @ w.T with x split on rows and w on output columns over `d` ranks,
    the all-gather left to the schedule search (its tensor is `x_gathered`)."""
    import meshflow

    b = meshflow.Builder("agmm")
    mesh = b.mesh("m0", [d])
    x = b.input("x", dtype, [m * d, k], mesh)
    w = b.input("w", dtype, [n * d, k], mesh)
    b.schedule(x).outer_split(0, d).parallelize(0, "DIDx")
    b.schedule(w).outer_split(0, d).parallelize(0, "DIDx")
    y = b.linear(x, w)
    b.rename(y, "y")
    b.output(y)
    return b.build()
