"""The programs the GPU tests compare with DTensor and torch.matmul, on the CPU backend: every
placement change and both overlapped GEMMs, on 1 to 5 ranks, against the reference and against
numpy's slicing of the full result (what DTensor's local tensors hold)."""

import threading

import numpy as np
import pytest

import meshflow
from programs import RESHARDS, agmm, reshard, rsmm


def local_of(full: np.ndarray, placement: str, rank: int, d: int) -> np.ndarray:
    """This rank's local tensor of `full` under a DTensor placement on a 1-D mesh."""
    if placement == "R":
        return full
    axis = {"S0": 0, "S1": 1}[placement]
    return np.split(full, d, axis=axis)[rank]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("src, dst", RESHARDS)
def test_reshard(src, dst, ranks):
    program = reshard(src, dst, ranks)
    result = program.run(seed=ranks)
    assert result.ok, result.summary
    host = result.host
    full = result.reference["y"]
    parts = host.scatter("y", full)
    for rank in range(ranks):
        np.testing.assert_array_equal(parts[rank], local_of(full, dst, rank, ranks))


def cases(decompositions):
    """(ranks, decomposition) pairs: a ring needs at least 2 ranks."""
    return [
        (r, dcmp)
        for r in [1, 2, 3, 4, 5, 8]
        for dcmp in decompositions
        if r > 1 or dcmp in (None, "collective")
    ]


@pytest.mark.parametrize("ranks, decomposition", cases([None, "collective", "ring", "ring_forward"]))
def test_agmm(ranks, decomposition):
    options = {} if decomposition is None else {"decompose": {"x_gathered": decomposition}}
    result = agmm(ranks, "bf16").run(seed=1, **options)
    assert result.ok, result.summary


@pytest.mark.parametrize("ranks, decomposition", cases([None, "collective", "ring_forward"]))
def test_rsmm(ranks, decomposition):
    options = {} if decomposition is None else {"decompose": {"y": decomposition}}
    result = rsmm(ranks, "bf16").run(seed=1, **options)
    assert result.ok, result.summary


def test_a_ring_needs_two_ranks():
    with pytest.raises(meshflow.CompileError, match="cannot be decomposed as `ring`: its resharding moves nothing between devices"):
        agmm(1).lower(decompose={"x_gathered": "ring"})


def test_reshard_executors_give_dtensor_locals():
    d = 3
    host = reshard("S0", "S1", d).lower()
    full = np.arange(24 * 18, dtype=np.float32).reshape(24, 18)
    xs = host.scatter("x", full)
    job = meshflow.CpuJob(d)
    ys = {r: np.zeros((24, 6), np.float32) for r in range(d)}

    def rank_main(r):
        meshflow.Executor(host, r, job=job).run(x=xs[r], y=ys[r])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(d):
        np.testing.assert_array_equal(xs[r], local_of(full, "S0", r, d))
        np.testing.assert_array_equal(ys[r], local_of(full, "S1", r, d))
