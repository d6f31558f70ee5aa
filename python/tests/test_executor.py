"""Executors on the CPU backend with numpy arrays: one per rank, each on its own thread,
outputs written in place, results equal to numpy's."""

import threading

import numpy as np
import pytest

import meshflow
from conftest import example


def run_ranks(host, bindings_of, steps=1):
    """Runs every rank of `host` on its own thread; returns each rank's unbound outputs."""
    job = meshflow.CpuJob(host.world_size)
    results, errors = [None] * host.world_size, []

    def rank_main(rank):
        try:
            ex = meshflow.Executor(host, rank, job=job)
            for _ in range(steps):
                results[rank] = ex.run(bindings_of(rank))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(host.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return results


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_column_parallel_linear_on_numpy(ranks):
    program = meshflow.load(example("column_parallel_linear_collective"), ranks=ranks)
    host = program.lower()
    rng = np.random.default_rng(ranks)
    x = rng.standard_normal((16 * ranks, 32), dtype=np.float32)
    w = rng.standard_normal((12 * ranks, 32), dtype=np.float32)
    xs, ws = host.scatter("x", x), host.scatter("w", w)
    (y_spec,) = host.outputs
    ys = {r: np.full(y_spec.shape, np.nan, np.float32) for r in range(ranks)}
    before = {r: ys[r] for r in ys}
    unbound = run_ranks(host, lambda r: {"x": xs[r], "w": ws[r], "y": ys[r]}, steps=2)
    # Written in place: the same arrays, now holding this rank's columns of x @ w.T.
    assert all(ys[r] is before[r] for r in ys)
    assert all(u == {} for u in unbound)
    np.testing.assert_allclose(host.gather("y", ys), x @ w.T, rtol=1e-5, atol=1e-4)


def test_unbound_outputs_are_returned():
    program = meshflow.load(example("mlp_2d_mesh"), ranks=4)
    host = program.lower()
    rng = np.random.default_rng(0)
    full = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in program.inputs}
    parts = {name: host.scatter(name, a) for name, a in full.items()}
    outs = run_ranks(host, lambda r: {name: p[r] for name, p in parts.items() if r in p})
    y = host.gather("y", {r: o["y"] for r, o in enumerate(outs)})
    h = full["x"] @ full["w1"].T
    a = 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(y, a @ full["w2"].T, rtol=1e-3, atol=1e-3)


def test_bf16_program_on_float32_arrays():
    program = meshflow.load(example("column_parallel_linear_ring"), ranks=2)
    host = program.lower()
    assert [t.dtype for t in host.inputs] == ["bf16", "bf16"]
    # Values exact in bf16, products exact in f32.
    x = np.arange(32 * 32, dtype=np.float32).reshape(32, 32) % 4
    w = np.ones((24, 32), np.float32)
    xs, ws = host.scatter("x", x), host.scatter("w", w)
    outs = run_ranks(host, lambda r: {"x": xs[r], "w": ws[r]})
    y = host.gather("y", {r: o["y"] for r, o in enumerate(outs)})
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x @ w.T)


def test_failure_of_one_rank_stops_the_others():
    host = meshflow.load(example("column_parallel_linear_ring"), ranks=2).lower()
    job = meshflow.CpuJob(2, timeout=5.0)
    errors = {}

    def rank_main(rank):
        ex = meshflow.Executor(host, rank, job=job)
        x = np.zeros((16, 32), np.float32)
        w = np.zeros((12, 32) if rank == 0 else (12, 31), np.float32)  # rank 1 is wrong
        try:
            ex.run(x=x, w=w)
        except meshflow.ExecutionError as e:
            errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(errors[1], meshflow.BindingError)
    assert "rank 1" in str(errors[0])
    assert job.failure is not None and job.failure[0] == 1


def test_single_rank_executor_needs_no_job():
    b = meshflow.Builder("one")
    m = b.mesh("m", 1)
    x = b.input("x", "f32", [3, 4], m)
    y = b.gelu(x)
    b.rename(y, "y")
    b.output(y)
    host = b.build().lower()
    out = np.zeros((3, 4), np.float32)
    assert meshflow.Executor(host).run(x=np.ones((3, 4)), y=out) == {}
    np.testing.assert_allclose(out, 0.8411920, rtol=1e-5)
