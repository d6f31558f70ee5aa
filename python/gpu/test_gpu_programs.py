"""AG+GEMM and GEMM+RS programs on torch tensors (bound in place), compared with
torch.matmul on the gathered inputs; several steps, another stream, binding errors."""

from pathlib import Path

import pytest
import torch

import meshflow
import meshflow.torch as mft
from conftest import all_gather, rel_error
from programs import agmm, rsmm

TOL = {"bf16": 2e-2, "f32": 1e-5}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "programs"
TORCH = {"bf16": torch.bfloat16, "f32": torch.float32}


def randn(shape, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(TORCH[dtype])


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("decomposition", [None, "collective", "ring", "ring_forward", "ring_bidirectional"])
def test_agmm(dist, dtype, decomposition):
    rank, d, device = dist
    m, n, k = 256, 192, 512
    options = {} if decomposition is None else {"decompose": {"x_gathered": decomposition}}
    host = agmm(d, dtype, m, n, k).lower(**options)
    ex = mft.Executor(host)
    x = randn((m, k), dtype, 100 + rank, device)
    w = randn((n, k), dtype, 200 + rank, device)
    y = torch.full((m * d, n), float("nan"), device=device, dtype=TORCH[dtype])
    ptr = y.data_ptr()
    for step in range(3):
        if step:
            x.mul_(-1)  # a new input every step, in the same memory
        assert ex.run(x=x, w=w, y=y) == {}
        want = torch.matmul(all_gather(x).float(), w.float().t())
        err = rel_error(y, want)
        assert err < TOL[dtype], f"step {step}: rel err {err:.2e}\n{host.explain}"
    assert y.data_ptr() == ptr


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("decomposition", [None, "collective", "ring_forward"])
def test_rsmm(dist, dtype, decomposition):
    rank, d, device = dist
    m, n, k = 128, 256, 384
    options = {} if decomposition is None else {"decompose": {"y": decomposition}}
    host = rsmm(d, dtype, m, n, k).lower(**options)
    ex = mft.Executor(host)
    x = randn((m * d, k), dtype, 300 + rank, device)
    w = randn((n, k), dtype, 400 + rank, device)
    z = torch.empty((m, n), device=device, dtype=TORCH[dtype])
    for _ in range(2):
        ex.run(x=x, w=w, z=z)
    full = torch.matmul(all_gather(x, dim=1).float(), all_gather(w, dim=1).float().t())
    want = full[rank * m : (rank + 1) * m]
    err = rel_error(z, want)
    assert err < TOL[dtype], f"rel err {err:.2e}\n{host.explain}"


@pytest.mark.parametrize("current", ["default_stream", "side_stream"])
@pytest.mark.parametrize("decomposition", ["collective", "ring"])
def test_steps_recorded_as_cuda_graphs(dist, decomposition, current):
    """Every step is recorded as a CUDA graph and replayed, whichever torch stream is current:
    the legacy default stream (which cannot be captured itself) or a side stream. The run is
    ordered after the work queued on that stream before it, and before the work queued after."""
    rank, d, device = dist
    host = agmm(d, "bf16", 128, 128, 256).lower(
        graph=True, decompose={"x_gathered": decomposition}
    )
    if current == "default_stream":
        stream = torch.cuda.default_stream(device)
        assert stream.cuda_stream == 0, "torch's default stream is not the legacy (null) stream"
    else:
        stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream(device) == stream
        ex = mft.Executor(host)
        assert ex.records_graphs
        x = randn((128, 256), "bf16", 500 + rank, device)
        w = randn((128, 256), "bf16", 600 + rank, device)
        y = torch.full((128 * d, 128), float("nan"), device=device, dtype=torch.bfloat16)
        for step in range(3):
            x.add_(1.0)  # queued on the current stream before the run: the run must see it
            ex.run(x=x, w=w, y=y)
            after = y + 1  # queued after the run: must see its result
            want = torch.matmul(all_gather(x).float(), w.float().t())
            assert rel_error(y, want) < TOL["bf16"], f"step {step}"
            assert rel_error(after, want + 1) < TOL["bf16"], f"step {step}, after the run"
    torch.cuda.current_stream(device).wait_stream(stream)


def test_runs_on_the_current_stream(dist):
    rank, d, device = dist
    host = agmm(d, "f32", 64, 64, 64).lower(decompose={"x_gathered": "ring"})
    ex = mft.Executor(host)
    x = randn((64, 64), "f32", rank, device)
    w = randn((64 * 1, 64), "f32", 7 + rank, device)
    y = torch.zeros((64 * d, 64), device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        # Work queued on the side stream before the run must be seen by it.
        x2 = x * 2
        ex.run(x=x2, w=w, y=y)
        z = y + 1  # and work after it sees its result, on the same stream
    side.synchronize()
    want = torch.matmul(all_gather(x * 2), w.t())
    assert rel_error(y, want) < 1e-5
    assert rel_error(z, want + 1) < 1e-5


def test_program_run_on_cuda_in_process(dist):
    """`Program.run(backend="cuda")`: every rank on its own GPU, as threads of rank 0's process
    (the other processes wait)."""
    import torch.distributed as d_

    rank, d, device = dist
    ok = torch.zeros(1, device=device)
    summary = ""
    if rank == 0:
        program = meshflow.load(EXAMPLES / "column_parallel_linear_ring.mf", ranks=d)
        result = program.run(backend="cuda", seed=2)
        summary = result.summary
        # Plans priced with the built-in profile of these GPUs (or the default, said so).
        name = torch.cuda.get_device_name(0)
        want = program.lower(device=name).profile
        summary += f"\nprofile: {result.host.profile} (want {want})"
        passed = result.ok and result.host.profile == want and name in want
        ok.fill_(1.0 if passed else 0.0)
    d_.broadcast(ok, src=0)
    assert ok.item() == 1.0, summary


def test_binding_errors(dist):
    rank, d, device = dist
    host = agmm(d, "f32", 8, 8, 8).lower()
    ex = mft.Executor(host)
    x = torch.zeros((8, 8), device=device)
    w = torch.zeros((8, 8), device=device)
    with pytest.raises(meshflow.BindingError, match="the executor runs on"):
        ex.run(x=x.cpu(), w=w)
    with pytest.raises(TypeError):
        ex.run(x=[1, 2], w=w)
    with pytest.raises(meshflow.BindingError, match="contiguous"):
        mft.Executor(host).run(x=torch.zeros((8, 16), device=device)[:, ::2], w=w)
    with pytest.raises(meshflow.BindingError, match=r"binding `w`: must be f32\[8, 8\]"):
        mft.Executor(host).run(x=x, w=torch.zeros((8, 9), device=device))
    with pytest.raises(meshflow.BindingError, match=r"binding `w`: must be f32"):
        mft.Executor(host).run(x=x, w=w.to(torch.bfloat16))


def test_ranks_on_different_gpu_models_agree_on_the_profile(dist, monkeypatch):
    # Rank 0 says its GPU is an H200, the others an H100 (MESHFLOW_GPU_MODEL, read when each
    # rank lowers): the executors, given the Program, agree on rank 0's profile before lowering
    # and run the same plans.
    rank, d, device = dist
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    monkeypatch.setenv("MESHFLOW_GPU_MODEL", h200 if rank == 0 else h100)
    m, n, k = 256, 192, 512
    ex = mft.Executor(agmm(d, "f32", m, n, k))
    assert ex.host.profile.startswith(f"h200x2: built-in profile of {h200}"), ex.host.profile
    if rank:
        assert "rank 0's, which every rank takes" in ex.host.profile, ex.host.profile
    x = randn((m, k), "f32", 500 + rank, device)
    w = randn((n, k), "f32", 600 + rank, device)
    y = torch.empty((m * d, n), device=device, dtype=torch.float32)
    ex.run(x=x, w=w, y=y)
    want = torch.matmul(all_gather(x).float(), w.float().t())
    err = rel_error(y, want)
    assert err < TOL["f32"], f"rel err {err:.2e}\n{ex.host.explain}"
