"""Errors become exceptions of meshflow's hierarchy, with the Rust API's messages."""

import numpy as np
import pytest

import meshflow
from conftest import example


def test_hierarchy():
    assert issubclass(meshflow.ParseError, meshflow.ProgramError)
    assert issubclass(meshflow.VerifyError, meshflow.ProgramError)
    assert issubclass(meshflow.BuildError, meshflow.ProgramError)
    assert issubclass(meshflow.ProgramError, meshflow.MeshflowError)
    assert issubclass(meshflow.BindingError, meshflow.ExecutionError)
    assert issubclass(meshflow.DeviceError, meshflow.ExecutionError)
    for e in (meshflow.CompileError, meshflow.CheckError, meshflow.ExecutionError, meshflow.MoeError):
        assert issubclass(e, meshflow.MeshflowError)
    assert issubclass(meshflow.MeshflowError, Exception)


def test_parse_error_names_line_and_column():
    with pytest.raises(meshflow.ParseError) as e:
        meshflow.parse("program p {\n  mesh m0 = iota(2)\n  input x: f99[4] on m0\n}\n")
    assert str(e.value).startswith("parse error at 3:")


def test_verify_error_lists_the_problem():
    text = "program p {\n  mesh m0 = iota(2)\n  input x: f32[4] on m0\n  output y\n}\n"
    with pytest.raises(meshflow.ProgramError) as e:
        meshflow.parse(text)
    assert "y" in str(e.value)


def test_missing_file():
    with pytest.raises(FileNotFoundError) as e:
        meshflow.load("/nonexistent/program.mf")
    assert "/nonexistent/program.mf" in str(e.value)


def test_builder_errors():
    b = meshflow.Builder("p")
    m = b.mesh("m0", 2)
    x = b.input("x", "f32", [4, 6], m)
    with pytest.raises(meshflow.BuildError, match="the name `x` is already used"):
        b.input("x", "f32", [4], m)
    w = b.input("w", "f32", [5, 7], m)
    with pytest.raises(meshflow.BuildError):
        b.linear(x, w)  # contraction extents 6 and 7 differ
    with pytest.raises(ValueError, match="unknown dtype `f99`"):
        b.input("z", "f99", [4], m)
    with pytest.raises(ValueError, match="unknown parallel type `DIDq`"):
        b.schedule(x).parallelize(0, "DIDq")
    other = meshflow.Builder("q")
    with pytest.raises(meshflow.BuildError, match="another builder"):
        other.output(x)
    with pytest.raises(meshflow.BuildError):
        b.mesh("bad", [2], devices=[0, 0])  # a device twice


def test_build_that_does_not_verify():
    b = meshflow.Builder("p")
    m = b.mesh("m0", 2)
    x = b.input("x", "f32", [4, 4], m)
    b.schedule(x).parallelize(0, "DIDx")  # 4 rows cannot be spread over 2 devices without a split
    y = b.gelu(x)
    b.output(y)
    with pytest.raises(meshflow.ProgramError, match="loop axis 0 of `x` is parallelized DIDx with extent 4"):
        b.build().lower()


def test_too_few_ranks():
    program = meshflow.load(example("column_parallel_linear_ring"), ranks=4)
    with pytest.raises(meshflow.CompileError, match="needs 4 ranks but the job has 2"):
        program.lower(ranks=2)


def test_bad_options():
    program = meshflow.load(example("column_parallel_linear_ring"), ranks=2)
    with pytest.raises(TypeError, match="unknown option `colour`"):
        program.lower(colour="red")
    with pytest.raises(ValueError, match="unknown schedule"):
        program.lower(schedule="sometimes")
    with pytest.raises(ValueError, match="unknown decomposition `spiral`"):
        program.lower(decompose={"ag": "spiral"})
    with pytest.raises(meshflow.CompileError):
        program.lower(disable_passes=["no_such_pass"])
    with pytest.raises(meshflow.CompileError, match="no built-in profile|profile"):
        program.lower(profile="/nonexistent/profile.json")
    with pytest.raises(ValueError, match="unknown transport `pigeon`"):
        program.lower(transport="pigeon")
    with pytest.raises(ValueError, match="unknown backend"):
        program.run(backend="tpu")
    graphs = program.lower(graph=True)
    with pytest.raises(meshflow.ExecutionError, match="does not record graphs"):
        meshflow.Executor(graphs, 0, job=meshflow.CpuJob(2))


def test_check_error_on_a_mismatched_host_program():
    # The prefetched schedule (the search may take another for the annotated ring).
    host = meshflow.load(example("column_parallel_linear_ring"), ranks=2).lower(schedule="prefetch")
    # Every rank sends its chunk to rank 0 while receiving from its neighbour: rank 1 waits
    # for a chunk rank 0 never sends.
    send = "send=(my(m0, DIDx) + 1) % 2"
    assert send in host.text, host.text
    broken = host.text.replace(send, "send=0", 1)
    with pytest.raises(meshflow.CheckError, match="cross-rank check failed"):
        meshflow.HostProgram.from_text(broken, ranks=2)
    # Without the check it loads.
    assert meshflow.HostProgram.from_text(broken, ranks=2, check=False).world_size == 2


def test_executor_binding_errors():
    host = meshflow.load(example("column_parallel_linear_collective"), ranks=2).lower()
    x = np.zeros((16, 32), np.float32)
    w = np.zeros((12, 32), np.float32)

    def run(**bindings):
        # A failed run aborts its job: every case gets a fresh one.
        return meshflow.Executor(host, 0, job=meshflow.CpuJob(2)).run(bindings)

    with pytest.raises(meshflow.BindingError, match="binding `bogus`: the program has no input"):
        run(x=x, w=w, bogus=x)
    with pytest.raises(meshflow.BindingError, match="binding `w`: input not bound"):
        run(x=x)
    with pytest.raises(meshflow.BindingError, match=r"binding `w`: must be f32\[12, 32\]"):
        run(x=x, w=np.zeros((12, 31), np.float32))
    with pytest.raises(meshflow.BindingError, match="same_kind"):
        run(x=x, w=np.zeros((12, 32), np.complex64))
    with pytest.raises(meshflow.ExecutionError, match="rank 5 is not in the job of 2 ranks"):
        meshflow.Executor(host, 5, job=meshflow.CpuJob(2))
    with pytest.raises(ValueError, match="pass job="):
        meshflow.Executor(host, 0)
    with pytest.raises(meshflow.ExecutionError, match="the job has 3 ranks, the host program runs on 2"):
        meshflow.Executor(host, 0, job=meshflow.CpuJob(3))
