"""Every example program: load, lower, check and run on the CPU backend, on several rank
counts, with the outputs compared against the unsharded reference."""

import numpy as np
import pytest

import meshflow
from conftest import EXAMPLES, example


def test_there_are_examples():
    assert len(EXAMPLES) >= 8, [p.name for p in EXAMPLES]


@pytest.mark.parametrize("ranks", [2, 4])
def test_load_lower_check_run(example_path, ranks):
    program = meshflow.load(example_path, ranks=ranks)
    assert program.name == example_path.stem
    assert program.ranks == ranks
    # The text parses back to the same program.
    assert meshflow.parse(program.text).text == program.text

    host = program.lower()
    assert host.world_size == ranks
    assert host.text.startswith(f"host {program.name} {{")
    assert host.check_report is not None and host.check_report.world_size == ranks
    # The host text loads back, checked, to the same program.
    assert meshflow.HostProgram.from_text(host.text, ranks=ranks).text == host.text

    report = program.check()
    assert report.world_size == ranks
    assert len(report.events_per_rank) == ranks
    assert "no mismatch, no deadlock" in str(report)

    result = program.run(backend="cpu", seed=3)
    assert result.ok, result.summary
    assert result.ranks == ranks and result.backend == "cpu"
    assert set(result.errors) == {t.name for t in program.outputs}
    for out in program.outputs:
        got, want = result.outputs[out.name], result.reference[out.name]
        assert list(got.shape) == out.shape
        assert result.errors[out.name] <= result.tolerances[out.name]
        if out.dtype in ("i32", "i64"):
            np.testing.assert_array_equal(got, want)
    assert set(result.inputs) == {t.name for t in program.inputs}


def test_run_on_more_ranks_than_the_meshes_use():
    program = meshflow.load(example("pipeline_two_meshes"), ranks=4)
    result = program.run(ranks=6)
    assert result.ok and result.ranks == 6

