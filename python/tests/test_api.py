"""The rest of the API: lowering options, the compiler's reports, host programs as text,
scatter/gather, and the stubs."""

import ast
from pathlib import Path

import numpy as np
import pytest

import meshflow
from conftest import example
from programs import agmm


def test_options_change_the_lowering():
    program = agmm(4)
    ring = program.lower(decompose={"x_gathered": "ring"}, schedule="per-iteration")
    collective = program.lower(decompose={"x_gathered": "collective"})
    assert "collective_permute" in ring.text
    assert "all_gather" in collective.text and "collective_permute" not in collective.text
    assert ring.plans["x_gathered"]["decomposition"] == "ring"
    assert ring.plans["x_gathered"]["schedule"] == "per-iteration"
    assert collective.plans["x_gathered"]["decomposition"] == "collective"
    assert program.lower(transport="copy-engine").transport == "copy-engine"
    assert program.lower(profile="h100x2").text
    assert "x_gathered = set(x) [all_gather over DIDx]: chose" in program.lower().explain
    assert program.lower(check=False).check_report is None
    assert program.run(decompose={"x_gathered": "ring_bidirectional"}).ok
    annotated = meshflow.load(example("column_parallel_linear_ring"), ranks=4)
    with pytest.raises(meshflow.CompileError, match="`ag` is annotated by the user"):
        annotated.lower(decompose={"ag": "collective"})


def test_dumps_and_pass_list():
    program = meshflow.load(example("column_parallel_linear_collective"), ranks=2)
    dumps = program.lower(dump_after="all").dumps
    assert len(dumps) > 3 and all(isinstance(p, str) and t for p, t in dumps)
    first = dumps[0][0]
    assert program.lower(dump_after=first).dumps[0][0] == first


def test_parse_with_params_and_ranks():
    text = example("moe_layer").read_text()
    small = meshflow.parse(text, ranks=2, params={"t": 4})
    assert small.world_size == 2
    (x,) = [t for t in small.inputs if t.name == "x"]
    assert x.shape == [8, 16] and x.dtype == "f32" and x.devices == [0, 1]
    assert small.run().ok


def test_host_program_from_text_runs_through_executors():
    program = meshflow.load(example("column_parallel_linear_collective"), ranks=2)
    host = meshflow.HostProgram.from_text(program.lower().text)
    assert host.world_size == 2 and host.name == program.name
    assert [t.shape for t in host.inputs] == [[16, 32], [12, 32]]
    with pytest.raises(meshflow.CompileError, match="needs the level-1 program"):
        host.scatter("x", np.zeros((32, 32)))


def test_scatter_gather_round_trip():
    host = meshflow.load(example("row_parallel_linear_ring"), ranks=4).lower()
    x = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    parts = host.scatter("x", x)
    assert sorted(parts) == [0, 1, 2, 3] and parts[1].shape == (32, 16)
    np.testing.assert_array_equal(parts[1], x[:, 16:32])
    np.testing.assert_array_equal(host.gather("x", parts), x)


def test_run_result():
    program = meshflow.load(example("moe_layer"), ranks=2)
    r = program.run(seed=7)
    assert bool(r) and r.ok
    assert r.summary.startswith("ok y: rel err")
    assert r.host.world_size == 2
    assert r.inputs["topk_idx"].dtype == np.int32
    np.testing.assert_allclose(r.outputs["y"], r.reference["y"], rtol=1e-5, atol=1e-5)
    again = program.run(seed=7)
    np.testing.assert_array_equal(again.inputs["x"], r.inputs["x"])
    assert not np.array_equal(program.run(seed=8).inputs["x"], r.inputs["x"])


def test_stubs_cover_the_native_module():
    stubs = ast.parse((Path(meshflow.__file__).parent / "_native.pyi").read_text())
    stubbed = {
        n.name if not isinstance(n, ast.AnnAssign) else n.target.id
        for n in stubs.body
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AnnAssign))
    }
    public = {n for n in dir(meshflow._native) if not n.startswith("_")}
    if not meshflow.HAS_CUDA:
        stubbed -= {"CudaExecutor", "NativeAllToAll"}
    assert public == stubbed
    for name in meshflow.__all__:
        assert hasattr(meshflow, name), name
    assert (Path(meshflow.__file__).parent / "py.typed").exists()


def test_the_reduce_scatter_ring_is_forced_through_the_options():
    from programs import rsmm

    program = rsmm(2)
    on = program.lower(accumulate={"y": True}, pieces={"y": 2})
    plan = on.plans["y"]
    assert plan["decomposition"] == "ring_forward"
    assert plan["accumulate"] is True and plan["pieces"] == 2
    assert "linear_accumulate" in on.text
    off = program.lower(decompose={"y": "ring_forward"}, accumulate={"y": False})
    assert off.plans["y"]["accumulate"] is False
    assert "linear_accumulate" not in off.text
    assert "accumulate)" not in off.explain
    assert program.run(accumulate={"y": True}).ok
    assert program.lower(decompose={"y": "collective"}).plans["y"]["accumulate"] is False
    with pytest.raises(meshflow.CompileError, match="cannot accumulate in place"):
        agmm(2).lower(accumulate={"x_gathered": True})
    with pytest.raises(TypeError, match="accumulate must be a dict"):
        program.lower(accumulate=True)
    with pytest.raises(ValueError, match="pieces must be positive"):
        program.lower(pieces={"y": 0})
    assert {"pieces", "accumulate"} <= set(meshflow.OPTION_NAMES)


def test_the_profile_is_the_given_one_else_the_gpu_models():
    program = agmm(2)
    assert program.lower().profile == (
        "h200x2: default, no GPU named (the target machine is unknown)"
    )
    h100 = "NVIDIA H100 80GB HBM3"
    assert program.lower(device=h100).profile == f"h100x2: built-in profile of {h100}"
    assert program.lower(device="NVIDIA H200").profile == (
        "h200x2: built-in profile of NVIDIA H200"
    )
    a100 = "NVIDIA A100-SXM4-80GB"
    assert program.lower(device=a100).profile == (
        f"h200x2: default, no built-in profile for {a100}"
    )
    assert program.lower(profile="h200x2", device=h100).profile == "h200x2: given"
    assert meshflow.HostProgram.from_text(program.lower().text).profile is None
