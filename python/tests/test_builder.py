"""The builder mirrors the Rust ProgramBuilder: it reproduces example programs exactly."""

import pytest

import meshflow
from conftest import example


def column_parallel_linear_ring(d: int) -> meshflow.Program:
    b = meshflow.Builder("column_parallel_linear_ring")
    m = b.mesh("m0", [d])
    x = b.input("x", "bf16", [16 * d, 32], m)
    w = b.input("w", "bf16", [12 * d, 32], m)
    b.schedule(x).outer_split(0, d).parallelize(0, "DIDx")
    b.schedule(w).outer_split(0, d).parallelize(0, "DIDx")
    ag = b.set(x)
    b.rename(ag, "ag")
    b.schedule(ag).outer_split(0, d).swizzle1d(0, "DIDx").parallelize(0, "Stream")
    y = b.linear(ag, w)
    b.rename(y, "y")
    b.output(y)
    return b.build()


def row_parallel_linear_ring(d: int) -> meshflow.Program:
    b = meshflow.Builder("row_parallel_linear_ring")
    m = b.mesh("m0", d)
    x = b.input("x", "f32", [8 * d, 16 * d], m)
    w = b.input("w", "f32", [24, 16 * d], m)
    b.schedule(x).outer_split(1, d).parallelize(1, "DIDx")
    b.schedule(w).outer_split(1, d).parallelize(1, "DIDx")
    y = b.linear(x, w)
    b.rename(y, "y")
    (
        b.schedule(y)
        .outer_split(0, d)
        .swizzle1d(0, "DIDx")
        .parallelize(0, "Stream")
        .outer_split(3, d)
        .parallelize(3, "DIDx")
    )
    z = b.set(y)
    b.rename(z, "z")
    b.schedule(z).outer_split(0, d).parallelize(0, "DIDx")
    b.output(z)
    return b.build()


def pipeline_two_meshes(d: int) -> meshflow.Program:
    b = meshflow.Builder("pipeline_two_meshes")
    stage0 = b.mesh("stage0", [d])
    stage1 = b.mesh("stage1", [d], start=d)
    x = b.input("x", "f32", [8 * d, 16], stage0)
    b.schedule(x).outer_split(0, d).parallelize(0, "DIDx")
    a = b.gelu(x)
    b.rename(a, "a")
    t = b.set(a)
    b.rename(t, "b")
    b.place(t, stage1)
    b.schedule(t).outer_split(0, d).parallelize(0, "DIDx")
    y = b.silu(t)
    b.rename(y, "y")
    b.output(y)
    return b.build()


@pytest.mark.parametrize(
    "build, name, d, ranks",
    [
        (column_parallel_linear_ring, "column_parallel_linear_ring", 4, 4),
        (column_parallel_linear_ring, "column_parallel_linear_ring", 2, 2),
        (row_parallel_linear_ring, "row_parallel_linear_ring", 4, 4),
        (pipeline_two_meshes, "pipeline_two_meshes", 2, 4),
    ],
)
def test_builder_reproduces_the_example(build, name, d, ranks):
    built = build(d)
    loaded = meshflow.load(example(name), ranks=ranks)
    assert built.text == loaded.text
    # And it lowers to the same host program.
    assert built.lower().text == loaded.lower(ranks=ranks).text


def test_built_program_runs():
    result = column_parallel_linear_ring(4).run(seed=1)
    assert result.ok, result.summary


def test_builder_moe_and_custom_ops():
    b = meshflow.Builder("moe")
    m = b.mesh("m0", 2)
    x = b.input("x", "f32", [12, 16], m)
    idx = b.input("topk_idx", "i32", [12, 2], m)
    wts = b.input("topk_weights", "f32", [12, 2], m)
    we = b.input("w_experts", "f32", [4, 16, 8], m)
    for t in (x, idx, wts, we):
        b.schedule(t).outer_split(0, 2).parallelize(0, "DIDx")
    ex, counts, routing = b.moe_dispatch(x, idx, 4, 12)
    for t in (ex, counts, routing):
        b.schedule(t).outer_split(0, 2).parallelize(0, "DIDx")
    ey = b.grouped_matmul(ex, counts, we)
    y = b.moe_combine(ey, counts, routing, wts)
    b.rename(y, "y")
    b.schedule(y).outer_split(0, 2).parallelize(0, "DIDx")
    b.output(y)
    program = b.build()
    assert "moe_dispatch(x, topk_idx)" in program.text
    assert program.run(seed=2).ok

    c = meshflow.Builder("custom")
    m = c.mesh("m", 2)
    x = c.input("x", "f32", [4, 3], m)
    (y,) = c.custom("double", [x], [("f32", [4, 3])], args=[7])
    c.output(y)
    host = c.build().lower()
    assert host.kernels == ["double"]
    assert 'kernel="double"' in host.text


def test_builder_text_is_available_before_build():
    b = meshflow.Builder("p")
    m = b.mesh("m0", 2)
    b.input("x", "f32", [4, 4], m)
    assert "input x: f32[4, 4] on m0" in b.text
