"""meshflow: lower sharded tensor programs to a rank-agnostic host IR and run them.

A *program* (level 1) puts tensors on device meshes with schedules (splits, ``swizzle1d``,
parallel types) and applies ops to them. Lowering turns it into a *host program*: stream
for-loops of collective permutes, broadcasts, collectives, MoE dispatch/combine and compute,
one program for every rank, checked across ranks before anything runs.

>>> import meshflow
>>> program = meshflow.load("examples/programs/column_parallel_linear_ring.mf", ranks=4)
>>> host = program.lower()             # the host program (host.text)
>>> report = program.check()           # the static cross-rank check
>>> result = program.run(backend="cpu", seed=0)
>>> result.ok                          # compared with the unsharded reference
True

Running a host program inside your own process, one :class:`Executor` per rank:

- on the CPU backend, with numpy arrays (ranks of one :class:`CpuJob`, each on its own thread);
- on GPUs, with torch CUDA tensors bound in place (one process per GPU under ``torchrun``):
  see :mod:`meshflow.torch`, which also has the MoE ops (:class:`meshflow.torch.AllToAll`).

Every error is a :class:`MeshflowError` (see its subclasses), with the message of the Rust API.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from ._native import (
    HAS_CUDA,
    OPTION_NAMES,
    BindingError,
    Builder,
    BuildError,
    CheckError,
    CheckReport,
    CompileError,
    CpuExecutor,
    CpuJob,
    DeviceError,
    ExecutionError,
    HostProgram,
    Mesh,
    MeshflowError,
    MoeError,
    ParseError,
    Program,
    ProgramError,
    RunResult,
    Schedule,
    Tensor,
    TensorSpec,
    VerifyError,
    load,
    parse,
)

__all__ = [
    "HAS_CUDA",
    "OPTION_NAMES",
    "BindingError",
    "Builder",
    "BuildError",
    "CheckError",
    "CheckReport",
    "CompileError",
    "CpuExecutor",
    "CpuJob",
    "DeviceError",
    "ExecutionError",
    "Executor",
    "HostProgram",
    "Mesh",
    "MeshflowError",
    "MoeError",
    "ParseError",
    "Program",
    "ProgramError",
    "RunResult",
    "Schedule",
    "Tensor",
    "TensorSpec",
    "VerifyError",
    "load",
    "parse",
]

__version__ = "0.1.0"


def _launcher_rank() -> Optional[int]:
    """This process's rank: ``torch.distributed``'s when initialized, else ``RANK``."""
    try:
        import torch.distributed as dist  # noqa: PLC0415 (torch is optional)

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None else None


class Executor:
    """One rank of a host program, on the caller's tensors.

    ``backend="cpu"``: the CPU backend, on numpy arrays (or anything ``numpy.asarray``
    accepts). The ranks of one job live in this process and share a :class:`CpuJob`
    (``job=``; made for you when the program has one rank); run each rank's ``run`` on its own
    thread (it releases the GIL).

    ``backend="cuda"``: a GPU, on torch CUDA tensors bound in place through DLPack, on torch's
    current stream, one process per GPU (``torchrun``); see :class:`meshflow.torch.Executor`,
    which takes the same keyword arguments (``device``, ``store``, ``timeout``), and a
    :class:`Program` in place of ``host`` (lowered on every rank after the ranks agree on the
    machine profile).

    ``rank`` defaults to ``torch.distributed``'s rank, else the ``RANK`` variable.
    """

    def __init__(
        self,
        host: HostProgram,
        rank: Optional[int] = None,
        *,
        backend: str = "cpu",
        job: Optional[CpuJob] = None,
        **cuda_options: Any,
    ) -> None:
        if rank is None:
            rank = _launcher_rank()
        if rank is None:
            if host.world_size != 1:
                raise ValueError(
                    f"rank is not given and neither torch.distributed nor RANK says it "
                    f"(the program has {host.world_size} ranks)"
                )
            rank = 0
        self.backend = backend
        self.host = host
        self.rank = rank
        if backend == "cpu":
            if cuda_options:
                raise TypeError(f"options {sorted(cuda_options)} apply to backend='cuda' only")
            if job is None:
                if host.world_size != 1:
                    raise ValueError(
                        f"the program has {host.world_size} ranks: pass job=CpuJob("
                        f"{host.world_size}) shared by the executors of every rank"
                    )
                job = CpuJob(1)
            self.job: Optional[CpuJob] = job
            self._impl: Any = CpuExecutor(host, rank, job)
        elif backend == "cuda":
            if job is not None:
                raise TypeError("job= applies to backend='cpu' only")
            from .torch import Executor as TorchExecutor  # noqa: PLC0415 (torch is optional)

            self.job = None
            self._impl = TorchExecutor(host, rank, **cuda_options)
        else:
            raise ValueError(f"unknown backend `{backend}` (expected cpu or cuda)")

    def run(self, bindings: Optional[Mapping[str, Any]] = None, **tensors: Any) -> dict:
        """Runs one step of this rank.

        ``bindings`` (and keyword arguments) map input and output names to this rank's local
        tensors: inputs are read, outputs written in place. Returns the outputs this rank
        holds that were not bound, as numpy arrays. Every rank of a job runs the same number
        of steps.
        """
        merged = dict(bindings or {})
        merged.update(tensors)
        return self._impl.run(merged)

    def __repr__(self) -> str:
        return f"<meshflow.Executor rank {self.rank} on {self.backend}: {self.host.name}>"
