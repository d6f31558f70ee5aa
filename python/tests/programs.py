"""Programs built with the builder, shared by the CPU tests and the GPU tests (`python/gpu/`).

Placements are written as DTensor writes them on a 1-D mesh: `"S0"` (Shard(0)), `"S1"`
(Shard(1)), `"R"` (Replicate()), `"P"` (Partial(): the partial sums of a row-parallel GEMM).
"""

import meshflow


def agmm(d: int, dtype: str = "f32", m: int = 16, n: int = 12, k: int = 32) -> meshflow.Program:
    """AG+GEMM: `y = all_gather(x) @ w.T`, x `[m*d, k]` split on rows and w `[n*d, k]` on
    output columns over `d` ranks; y `[m*d, n*d]` split on columns. The all-gather (its tensor
    is `x_gathered`) is left to the schedule search, or forced with `decompose=`."""
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


def rsmm(d: int, dtype: str = "f32", m: int = 8, n: int = 24, k: int = 16) -> meshflow.Program:
    """GEMM+RS: `z = reduce_scatter(x @ w.T)`, x `[m*d, k*d]` and w `[n, k*d]` split on the
    contraction axis over `d` ranks; the partial sums `y` are reduce-scattered to z `[m*d, n]`
    split on rows (the decomposition of `y` left to the search, or forced with `decompose=`)."""
    b = meshflow.Builder("rsmm")
    mesh = b.mesh("m0", [d])
    x = b.input("x", dtype, [m * d, k * d], mesh)
    w = b.input("w", dtype, [n, k * d], mesh)
    b.schedule(x).outer_split(1, d).parallelize(1, "DIDx")
    b.schedule(w).outer_split(1, d).parallelize(1, "DIDx")
    y = b.linear(x, w)
    b.rename(y, "y")
    z = b.set(y)
    b.rename(z, "z")
    b.schedule(z).outer_split(0, d).parallelize(0, "DIDx")
    b.output(z)
    return b.build()


def _place(b: meshflow.Builder, t: meshflow.Tensor, placement: str, d: int) -> None:
    if placement == "R":
        b.replicate(t)
    else:
        axis = {"S0": 0, "S1": 1}[placement]
        b.schedule(t).outer_split(axis, d).parallelize(axis, "DIDx")


RESHARDS = [("S0", "R"), ("S1", "R"), ("R", "S0"), ("S0", "S1"), ("S1", "S0"), ("P", "R"), ("P", "S0")]


def reshard(src: str, dst: str, d: int, dtype: str = "f32", rows: int = 8, cols: int = 6) -> meshflow.Program:
    """`y = x` redistributed from placement `src` to `dst` on a 1-D mesh of `d` ranks: x and y
    are `[rows*d, cols*d]`. For `src == "P"`, the partial sums come from `x @ w.T` with x
    `[rows*d, 4*d]` and w `[cols*d, 4*d]` split on the contraction axis (inputs `x`, `w`)."""
    b = meshflow.Builder(f"reshard_{src}_{dst}".lower())
    mesh = b.mesh("m0", [d])
    if src == "P":
        x = b.input("x", dtype, [rows * d, 4 * d], mesh)
        w = b.input("w", dtype, [cols * d, 4 * d], mesh)
        _place(b, x, "S1", d)
        _place(b, w, "S1", d)
        x = b.linear(x, w)
    else:
        x = b.input("x", dtype, [rows * d, cols * d], mesh)
        _place(b, x, src, d)
    y = b.set(x)
    b.rename(y, "y")
    _place(b, y, dst, d)
    b.output(y)
    return b.build()
