"""GPU tests of the Python package: one process per GPU under torchrun (see run.sh).

Every rank runs the same tests in the same order (they communicate); a test that cannot run
here skips on every rank with the reason (printed with `-rs`).
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest

# The programs the CPU tests also run (python/tests/programs.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

torch = pytest.importorskip("torch", reason="the GPU tests need torch")


def _skip_reason():
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return "not under torchrun: run python/gpu/run.sh"
    import meshflow

    if not meshflow.HAS_CUDA:
        return "this meshflow wheel was built without CUDA (--features cuda)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world:
        return f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}"
    return None


@pytest.fixture(scope="session")
def dist():
    """torch.distributed over NCCL, one GPU per rank: `(rank, world_size, device)`."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch.distributed as d

    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    d.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=180))
    yield d.get_rank(), d.get_world_size(), device
    d.barrier()
    d.destroy_process_group()


def out_dir() -> Path:
    """Where tests leave JSON (`$OUT`, default /tmp/out)."""
    p = Path(os.environ.get("OUT", "/tmp/out"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def rel_error(got, want) -> float:
    """`||got - want|| / ||want||` in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def all_gather(t, dim=0):
    """The full tensor of the per-rank `t`, concatenated along `dim` (torch.distributed)."""
    import torch.distributed as d

    parts = [torch.empty_like(t) for _ in range(d.get_world_size())]
    d.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)
