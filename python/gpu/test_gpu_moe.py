"""MoE dispatch/combine (meshflow.torch.AllToAll) on torch tensors, compared with a torch
reference: the rows each expert receives, their counts, and the weighted combine; several
steps, a CUDA graph, no host synchronization."""

import pytest
import torch

import meshflow
import meshflow.torch as mft
from conftest import all_gather, rel_error

TRANSPORTS = ["nccl", "nvlink"]


def routing(tokens, experts, k, seed, device):
    """Distinct random experts per token (int64) and positive weights (float32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.stack(
        [torch.randperm(experts, generator=g, device=device)[:k] for _ in range(tokens)]
    )
    w = torch.rand((tokens, k), generator=g, device=device) + 0.1
    return idx, w


def expert_fn(expert_x, counts, rank, local_experts):
    """Each expert scales its rows by (global expert id + 1): what `out` must sum."""
    scale = torch.arange(local_experts, device=expert_x.device) + rank * local_experts + 1
    return expert_x * scale.view(-1, 1, 1).to(expert_x.dtype)


def reference_out(x, idx, w):
    """out[t] = sum_k w[t, k] * x[t] * (idx[t, k] + 1), in float32."""
    return (w * (idx.float() + 1)).sum(dim=1, keepdim=True) * x.float()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_combine(dist, transport, dtype):
    rank, d, device = dist
    T, H, E, K = 64, 256, 8 * d, 4
    L = E // d
    ata = mft.AllToAll(
        num_experts=E, experts_per_token=K, max_num_tokens=T, hidden_dim=H,
        dtype=dtype, transport=transport,
    )
    for step in range(3):
        x = torch.randn((T, H), device=device).to(dtype)
        idx, w = routing(T, E, K, 1000 * step + rank, device)
        expert_x, counts, handle = ata.dispatch(x, idx)
        # Counts and rows against the gathered routing.
        all_x, all_idx = all_gather(x), all_gather(idx)
        want_counts = torch.stack([(all_idx == rank * L + e).sum() for e in range(L)])
        assert torch.equal(counts.long(), want_counts), f"step {step}"
        for e in range(L):
            c = int(counts[e])
            src = handle.routing[e, :c, 0].long()  # team-global token of each row
            kk = handle.routing[e, :c, 1].long()
            assert torch.equal(expert_x[e, :c], all_x[src]), f"step {step}, expert {e}"
            assert torch.all(all_idx[src, kk] == rank * L + e)
        # Combine the scaled rows: out = sum_k w * x * (expert + 1).
        y = expert_fn(expert_x, counts, rank, L)
        out = torch.empty((T, H), device=device, dtype=dtype)
        assert ata.combine(y, handle, w, out) is out
        err = rel_error(out, reference_out(x, idx, w))
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"step {step}: {err:.2e}"
    assert ata.status()["ok"], ata.status()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_host_synchronization(dist, transport):
    rank, d, device = dist
    T, H, E, K = 32, 128, 4 * d, 2
    ata = mft.AllToAll(num_experts=E, experts_per_token=K, max_num_tokens=T, hidden_dim=H,
                       transport=transport)
    x = torch.randn((T, H), device=device, dtype=torch.bfloat16)
    idx, w = routing(T, E, K, rank, device)
    out = torch.empty_like(x)
    _, _, h = ata.dispatch(x, idx)  # warm-up step (kernels compile on first use)
    ata.combine(ata.expert_x, h, w, out)
    torch.cuda.synchronize()
    # Hold the stream with a long kernel, then enqueue a step: if dispatch or combine waited
    # for the device, the stream would be idle by the time they return.
    torch.cuda._sleep(2_000_000_000)
    _, _, h = ata.dispatch(x, idx)
    ata.combine(ata.expert_x, h, w, out)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "dispatch/combine returned only after the stream drained"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cuda_graph(dist, transport):
    rank, d, device = dist
    T, H, E, K = 32, 128, 4 * d, 2
    ata = mft.AllToAll(num_experts=E, experts_per_token=K, max_num_tokens=T, hidden_dim=H,
                       transport=transport)
    assert ata.capturable, f"the {transport} MoE transport must be capturable"
    x = torch.zeros((T, H), device=device, dtype=torch.bfloat16)
    idx = torch.zeros((T, K), device=device, dtype=torch.int32)
    w = torch.zeros((T, K), device=device)
    out = torch.empty_like(x)

    def step():
        expert_x, counts, h = ata.dispatch(x, idx)
        ata.combine(expert_fn(expert_x, counts, rank, E // d), h, w, out)

    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        xi = torch.randn((T, H), device=device).to(torch.bfloat16)
        ii, wi = routing(T, E, K, 77 * replay + rank, device)
        x.copy_(xi)
        idx.copy_(ii)
        w.copy_(wi)
        graph.replay()
        err = rel_error(out, reference_out(xi, ii, wi))
        assert err < 2e-2, f"replay {replay}: {err:.2e}"


def test_errors(dist):
    rank, d, device = dist
    with pytest.raises(meshflow.MoeError, match="not torch.float8_e4m3fn|float8"):
        mft.AllToAll(num_experts=2 * d, experts_per_token=1, max_num_tokens=4, hidden_dim=64,
                     dtype=torch.float8_e4m3fn)
    with pytest.raises(meshflow.MoeError, match="cannot be split evenly"):
        mft.AllToAll(num_experts=2 * d + 1, experts_per_token=1, max_num_tokens=4, hidden_dim=64)
    ata = mft.AllToAll(num_experts=2 * d, experts_per_token=1, max_num_tokens=4, hidden_dim=64)
    x = torch.zeros((4, 64), device=device, dtype=torch.bfloat16)
    idx = torch.zeros((4, 1), device=device, dtype=torch.int32)
    with pytest.raises(meshflow.MoeError, match=r"x must be bf16\[4, 64\]"):
        ata.dispatch(torch.zeros((5, 64), device=device, dtype=torch.bfloat16), idx)
    _, _, first = ata.dispatch(x, idx)
    ata.combine(ata.expert_x, first, torch.ones((4, 1), device=device), torch.empty_like(x))
    _, _, second = ata.dispatch(x, idx)
    with pytest.raises(meshflow.MoeError, match="combine each dispatch before the next"):
        ata.combine(ata.expert_x, first, torch.ones((4, 1), device=device), torch.empty_like(x))
    ata.combine(ata.expert_x, second, torch.ones((4, 1), device=device), torch.empty_like(x))
    torch.cuda.synchronize()
