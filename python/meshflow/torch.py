"""meshflow on torch CUDA tensors: one :class:`Executor` per rank, and MoE ops.

Needs a wheel built with CUDA (``meshflow.HAS_CUDA``) and torch with CUDA. One process per GPU,
as ``torchrun`` starts them::

    program = meshflow.load("column_parallel_linear_ring.mf", ranks=2)
    ex = meshflow.torch.Executor(program)       # rank, GPU and rendezvous from the launcher
    ex.run(x=x_local, w=w_local, y=y_local)     # y_local written in place, on the current stream

- Given a :class:`~meshflow.Program`, the executor lowers it for its rank after the ranks agree
  on the machine profile through the store (``Program.lower_for_rank``): ranks whose GPU models
  differ (an H100 node and an H200 node; a rank's model is the name of its GPU 0, or
  ``MESHFLOW_GPU_MODEL``) take rank 0's profile and lower the same plans, as
  ``meshflow run`` under ``meshflow launch`` does. Given a :class:`~meshflow.HostProgram`
  lowered beforehand (``program.lower(device=...)``), there is no store yet when it is
  lowered, so nothing is agreed: the executor only checks that every rank lowered rank 0's
  program, and ranks that priced with different profiles fail with an error saying so (give
  every rank the same ``device=`` or ``profile=``, or pass the ``Program``).

- Tensors are bound through DLPack without a copy: inputs are read and outputs written in
  the caller's memory.
- Work is enqueued on torch's current stream, so it is ordered with the caller's work.
- The ranks meet to create their NCCL communicators through a store: by default
  ``torch.distributed``'s (when it is initialized), else the store ``torchrun``'s agent serves on
  ``MASTER_ADDR:MASTER_PORT``, else meshflow's own TCP store there (rank 0 serves it).

:class:`AllToAll` is MoE dispatch/combine in the style of pplx-kernels: ``dispatch(x, topk_idx)``
returns ``expert_x``, ``expert_counts`` and a handle; ``combine(expert_y, handle, topk_weights,
out)`` fills ``out``. Both only enqueue work on the current stream (no host synchronization).

The CUDA libraries come from the torch wheels: importing this module makes their NCCL and NVRTC
reachable by meshflow's loaders (``MESHFLOW_NCCL_LIBRARY`` is set unless already set).
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from . import _native
from ._native import BindingError, HostProgram, MoeError, Program

__all__ = ["AllToAll", "DispatchHandle", "Executor", "resolve_store"]

_LIBRARIES_LOADED = False


def _require_cuda() -> None:
    if not _native.HAS_CUDA:
        raise RuntimeError(
            "this meshflow wheel was built without CUDA (build it with `--features cuda`)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")


def _load_libraries() -> None:
    """Loads the NCCL and NVRTC of the torch wheels (nvidia-* packages), so that meshflow's
    loaders, which open them by name, find them already in the process."""
    global _LIBRARIES_LOADED
    if _LIBRARIES_LOADED:
        return
    wanted = (
        ("nvidia.nccl", "libnccl.so.2"),
        ("nvidia.cu13", "libcublas.so.13"),
        ("nvidia.cu13", "libcublasLt.so.13"),
        ("nvidia.cu13", "libnvrtc.so.13"),
        ("nvidia.cu13", "libnvrtc-builtins.so.*"),
        ("nvidia.cuda_nvrtc", "libnvrtc.so.12"),
        ("nvidia.cuda_nvrtc", "libnvrtc-builtins.so.*"),
    )
    for module, pattern in wanted:
        try:
            package = importlib.import_module(module)
        except ImportError:
            continue
        for base in list(getattr(package, "__path__", [])):
            for path in sorted(glob.glob(os.path.join(base, "lib", pattern))):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                if pattern == "libnccl.so.2":
                    os.environ.setdefault("MESHFLOW_NCCL_LIBRARY", path)
    _LIBRARIES_LOADED = True


def _rank(rank: Optional[int], world_size: int) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if world_size == 1:
        return 0
    raise ValueError(
        f"rank is not given and neither torch.distributed nor RANK says it "
        f"(the job has {world_size} ranks)"
    )


def _device(device: Union[None, int, str, torch.device]) -> torch.device:
    """The GPU: `device`, else `LOCAL_RANK`'s, else torch's current device."""
    if device is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"device {d} is not a CUDA device")
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


def _world_size(default: int) -> int:
    """The job's size: ``torch.distributed``'s, else ``WORLD_SIZE``, else `default`."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return default


def resolve_store(store: Any, world_size: int, timeout: float) -> Tuple[Any, str]:
    """The store the ranks meet through, and a name for it.

    ``store="auto"``: ``torch.distributed``'s default store when it is initialized; one rank:
    none needed; under ``torchrun`` (its agent serves a store on ``MASTER_ADDR:MASTER_PORT``): a
    client of that store; else ``"env"``, meshflow's own TCP store on ``MASTER_ADDR:MASTER_PORT``
    (served by rank 0). A torch ``Store`` or ``"env"``/``"local"`` is used as given.
    """
    import torch.distributed as dist  # noqa: PLC0415

    if not (isinstance(store, str) and store == "auto"):
        name = store if isinstance(store, str) else f"store-{id(store)}"
        return store, name
    address = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    if dist.is_available() and dist.is_initialized():
        base = dist.distributed_c10d._get_default_store()
        return dist.PrefixStore("meshflow/", base), f"torch.distributed@{address}"
    if world_size == 1:
        return "local", "local"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout),
        )
        return dist.PrefixStore("meshflow/", client), f"torchrun@{address}"
    return "env", f"env@{address}"


def _capsule(name: str, t: Any, device: torch.device) -> Any:
    """A DLPack capsule of `t` (no copy; `t` stays the owner)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, is a {type(t).__name__}")
    if t.device != device:
        raise BindingError(f"`{name}` is on {t.device}, the executor runs on {device}")
    return torch.utils.dlpack.to_dlpack(t.detach())


class Executor:
    """One rank of a host program on one GPU, on torch CUDA tensors.

    ``host``: a :class:`~meshflow.HostProgram`, or a :class:`~meshflow.Program` that the
    executor lowers for its rank with the lowering ``options`` (those of ``Program.lower``)
    after the ranks agree on the machine profile through ``store`` (see the module docs).

    ``rank``: ``torch.distributed``'s rank, else ``RANK``. ``device``: ``LOCAL_RANK``'s GPU,
    else torch's current device. ``store``: see :func:`resolve_store`. ``timeout``: seconds a
    rank waits for its peers (rendezvous, end of a run).

    Each run is ordered on torch's current stream at the call (the default stream or a side
    stream): after the work queued there before it, and before the work queued after it. The
    executor's device work runs on a stream of its own, forked from and joined back into the
    current stream with events, so that steps can be recorded as CUDA graphs
    (``lower(graph=True)``) whichever stream is current.
    """

    def __init__(
        self,
        host: Union[HostProgram, Program],
        rank: Optional[int] = None,
        *,
        device: Union[None, int, str, torch.device] = None,
        store: Any = "auto",
        timeout: float = 120.0,
        **options: Any,
    ) -> None:
        _require_cuda()
        _load_libraries()
        if isinstance(host, Program):
            world_size = _world_size(options.get("ranks") or host.ranks or host.world_size)
        elif options:
            raise TypeError(
                f"lowering options {sorted(options)} apply to a Program, not a HostProgram"
            )
        else:
            world_size = host.world_size
        self.rank = _rank(rank, world_size)
        self.device = _device(device)
        store, namespace = resolve_store(store, world_size, timeout)
        if isinstance(host, Program):
            host = host.lower_for_rank(self.rank, world_size, store, namespace, timeout, **options)
        self.host = host
        with torch.cuda.device(self.device):
            self._native = _native.CudaExecutor(
                host, self.rank, self.device.index, store, namespace, timeout
            )

    def run(self, bindings: Optional[Mapping[str, torch.Tensor]] = None, **tensors: torch.Tensor) -> dict:
        """Runs one step of this rank on torch's current stream.

        ``bindings`` (and keyword arguments) map input and output names to this rank's local
        CUDA tensors (contiguous, on this executor's GPU): inputs are read, outputs written in
        place. Returns the outputs this rank holds that were not bound, as numpy arrays. Returns
        when this rank's work is complete.
        """
        merged = dict(bindings or {})
        merged.update(tensors)
        capsules = {name: _capsule(name, t, self.device) for name, t in merged.items()}
        with torch.cuda.device(self.device):
            return self._native.run(capsules, torch.cuda.current_stream(self.device))

    @property
    def last_run_us(self) -> Optional[float]:
        """Device time of the last run in microseconds (meshflow's events around it)."""
        return self._native.last_run_us

    @property
    def records_graphs(self) -> bool:
        """Whether every run records its step as a CUDA graph and replays it
        (``lower(graph=True)``)."""
        return self._native.records_graphs

    def __repr__(self) -> str:
        return f"<meshflow.torch.Executor rank {self.rank} on {self.device}: {self.host.name}>"


_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
}


@dataclass(frozen=True)
class DispatchHandle:
    """What a combine needs from its dispatch: the step it belongs to, and the per-expert row
    counts and routing (source token and k of every received row), which the next dispatch
    overwrites."""

    step: int
    expert_counts: torch.Tensor
    routing: torch.Tensor


class AllToAll:
    """MoE expert-parallel dispatch and combine for one layer shape, on one rank of a team.

    A team of ``world_size`` ranks holds ``num_experts`` experts, ``L = num_experts /
    world_size`` per rank (expert ``e`` on rank ``e // L``). Every rank has ``max_num_tokens``
    tokens of ``hidden_dim`` elements per step, routed to ``experts_per_token`` distinct
    experts each.

    - :meth:`dispatch` sends every token to its experts and returns ``expert_x[L, C,
      hidden_dim]`` (rows past ``expert_counts[e]`` are padding), ``expert_counts[L]`` (int32)
      and a :class:`DispatchHandle`. ``C`` is ``capacity`` (default ``world_size *
      max_num_tokens``, which never overflows); rows past it are dropped and :meth:`status`
      reports the overflow.
    - :meth:`combine` returns the expert outputs ``expert_y[L, C, out_hidden_dim]`` to their
      tokens and writes ``out[t] = sum_k topk_weights[t, k] * y(t, k)`` (in float32, rounded
      once).

    ``expert_x`` and ``expert_counts`` are views of memory the transport owns (no copy): the
    next dispatch overwrites them. ``transport``: ``"nccl"`` (grouped send/recv) or ``"nvlink"``
    (stores into peer memory, CUDA IPC between processes). Rows are ``dtype`` (bfloat16, float16
    or float32). Every rank calls the constructor, :meth:`dispatch` and :meth:`combine` in the
    same order; both only enqueue work on the current stream. A step (dispatch, expert
    computation, combine) can be captured in a CUDA graph when :attr:`capturable` is true;
    run one step before capturing (kernels are compiled on first use).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        experts_per_token: int,
        max_num_tokens: int,
        hidden_dim: int,
        out_hidden_dim: Optional[int] = None,
        capacity: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        transport: str = "nccl",
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        device: Union[None, int, str, torch.device] = None,
        store: Any = "auto",
        timeout: float = 120.0,
    ) -> None:
        _require_cuda()
        _load_libraries()
        if world_size is None:
            world_size = _world_size(1)
        if dtype not in _DTYPES:
            raise MoeError(
                f"the MoE kernels of this build move bfloat16, float16 or float32 rows, not {dtype}"
            )
        self.rank = _rank(rank, world_size)
        self.world_size = world_size
        self.device = _device(device)
        self.dtype = dtype
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.max_num_tokens = max_num_tokens
        self.hidden_dim = hidden_dim
        self.out_hidden_dim = hidden_dim if out_hidden_dim is None else out_hidden_dim
        self.capacity = world_size * max_num_tokens if capacity is None else capacity
        self.transport = transport
        store, namespace = resolve_store(store, world_size, timeout)
        with torch.cuda.device(self.device):
            self._native = _native.NativeAllToAll(
                self.rank,
                world_size,
                num_experts,
                experts_per_token,
                max_num_tokens,
                hidden_dim,
                self.out_hidden_dim,
                self.capacity,
                _DTYPES[dtype],
                transport,
                self.device.index,
                store,
                namespace,
                timeout,
            )
            expert_x, counts, routing = (torch.from_dlpack(c) for c in self._native.outputs())
        self.expert_x: torch.Tensor = expert_x
        self.expert_counts: torch.Tensor = counts
        self.routing: torch.Tensor = routing
        self._step = 0

    @property
    def capturable(self) -> bool:
        """Whether a step can be captured in a CUDA graph and replayed (both transports of this
        build can: NCCL's grouped send/recv, and the NVLink kernels keep their step number on
        the device)."""
        return bool(self._native.capturable)

    def _check_capture(self) -> None:
        if torch.cuda.is_current_stream_capturing() and not self.capturable:
            raise MoeError(
                f"the {self.transport} MoE transport of this build cannot be captured in a CUDA "
                "graph"
            )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Sends ``x[T, hidden_dim]`` (``dtype``) to the experts ``topk_idx[T, K]`` names
        (int32, or int64 converted on the device); returns ``(expert_x, expert_counts,
        handle)``."""
        self._check_capture()
        if topk_idx.dtype != torch.int32:
            topk_idx = topk_idx.to(torch.int32)
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            self._native.dispatch(
                _capsule("x", x, self.device), _capsule("topk_idx", topk_idx, self.device), stream
            )
        self._step += 1
        return self.expert_x, self.expert_counts, DispatchHandle(self._step, self.expert_counts, self.routing)

    def combine(
        self,
        expert_y: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Returns ``expert_y[L, C, out_hidden_dim]`` (``dtype``) to the tokens of the dispatch
        of ``handle`` (the latest one) and writes ``out[T, out_hidden_dim] = sum_k
        topk_weights[t, k] * y(t, k)``; returns ``out``."""
        self._check_capture()
        if handle.step != self._step:
            raise MoeError(
                f"combine of the dispatch of step {handle.step}, but the latest dispatch is step "
                f"{self._step}: combine each dispatch before the next"
            )
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.to(torch.float32)
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            self._native.combine(
                _capsule("expert_y", expert_y, self.device),
                _capsule("topk_weights", topk_weights, self.device),
                _capsule("out", out, self.device),
                stream,
            )
        return out

    def status(self) -> dict:
        """The device status of the transport (waits for the current stream: keep it off the
        hot path): ``{"ok", "overflow", "bad_expert", "bad_routing", "timeout"}``."""
        with torch.cuda.device(self.device):
            return self._native.status(torch.cuda.current_stream(self.device))

    def clear_status(self) -> None:
        """Clears the device status (enqueued on the current stream)."""
        with torch.cuda.device(self.device):
            self._native.clear_status(torch.cuda.current_stream(self.device))
