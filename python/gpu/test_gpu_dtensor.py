"""DTensor `redistribute` and meshflow give the same local tensors for the same placement
changes on a 1-D mesh of every rank."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshflow.torch as mft
from conftest import rel_error
from programs import RESHARDS, reshard

PLACEMENT = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}


@pytest.fixture(scope="module")
def mesh(dist):
    """A 1-D device mesh of every rank."""
    return init_device_mesh("cuda", (dist[1],))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src, dst", RESHARDS)
def test_redistribute(dist, mesh, src, dst, dtype):
    rank, d, device = dist
    rows, cols = 64, 48
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    host = reshard(src, dst, d, name, rows, cols).lower()
    ex = mft.Executor(host)
    g = torch.Generator(device=device).manual_seed(5)  # the same full tensors on every rank
    if src == "P":
        x_full = torch.randn((rows * d, 4 * d), generator=g, device=device).to(dtype)
        w_full = torch.randn((cols * d, 4 * d), generator=g, device=device).to(dtype)
        x = distribute_tensor(x_full, mesh, [Shard(1)]).to_local().contiguous()
        w = distribute_tensor(w_full, mesh, [Shard(1)]).to_local().contiguous()
        partial = DTensor.from_local(torch.matmul(x, w.t()), mesh, [Partial()])
        want = partial.redistribute(mesh, [PLACEMENT[dst]]).to_local()
        bindings = {"x": x, "w": w}
    else:
        full = torch.randn((rows * d, cols * d), generator=g, device=device).to(dtype)
        dt = distribute_tensor(full, mesh, [PLACEMENT[src]])
        want = dt.redistribute(mesh, [PLACEMENT[dst]]).to_local()
        bindings = {"x": dt.to_local().contiguous()}
    (y_spec,) = host.outputs
    y = torch.empty(y_spec.shape, device=device, dtype=dtype)
    assert list(want.shape) == y_spec.shape
    ex.run(bindings, y=y)
    if src == "P":
        # Sums of d partial products, possibly in another order (bf16: rounded once per side).
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_error(y, want) < tol
    else:
        assert torch.equal(y, want.contiguous()), f"{src} -> {dst} on rank {rank}"
