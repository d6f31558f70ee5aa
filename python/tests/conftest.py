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

