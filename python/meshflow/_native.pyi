"""Type stubs of meshflow's native module (Rust, pyo3)."""

from os import PathLike
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

HAS_CUDA: bool
OPTION_NAMES: list[str]

class MeshflowError(Exception):
    """Base class of every meshflow error."""

class ProgramError(MeshflowError):
    """A program cannot be read or built."""

class ParseError(ProgramError):
    """Program text does not parse (the message gives the line and column)."""

class VerifyError(ProgramError):
    """A program does not verify (the message lists every problem)."""

class BuildError(ProgramError):
    """A builder call failed."""

class CompileError(MeshflowError):
    """Lowering failed: a pass, an option, or a job too small for the program."""

class CheckError(MeshflowError):
    """The static cross-rank check rejects the host program."""

class ExecutionError(MeshflowError):
    """A rank's run failed."""

class BindingError(ExecutionError):
    """A tensor bound to an executor is missing, unknown, or of the wrong type or shape."""

class DeviceError(ExecutionError):
    """A CUDA, NCCL or rendezvous call failed."""

class MoeError(MeshflowError):
    """A MoE dispatch or combine cannot be set up or run."""

class TensorSpec:
    """A tensor of a program: name, element type, shape, role and the ranks that hold it."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def role(self) -> str: ...
    @property
    def devices(self) -> list[int]: ...

class CheckReport:
    """The static cross-rank check's summary."""

    @property
    def world_size(self) -> int: ...
    @property
    def events_per_rank(self) -> list[int]: ...
    @property
    def teams(self) -> list[list[int]]: ...
    @property
    def point_to_point(self) -> int: ...
    @property
    def groups(self) -> int: ...

class Program:
    """A level-1 (sharded) program; ``str(program)`` is its text."""

    @property
    def name(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def ranks(self) -> Optional[int]: ...
    @property
    def inputs(self) -> list[TensorSpec]: ...
    @property
    def outputs(self) -> list[TensorSpec]: ...
    def lower(
        self,
        *,
        ranks: Optional[int] = ...,
        streams: Optional[int] = ...,
        schedule: Optional[str] = ...,
        decompose: Optional[Mapping[str, str]] = ...,
        pieces: Optional[Mapping[str, int]] = ...,
        accumulate: Optional[Mapping[str, bool]] = ...,
        transport: Optional[str] = ...,
        profile: Optional[str] = ...,
        device: Optional[str] = ...,
        disable_passes: Optional[Sequence[str]] = ...,
        verify_each_pass: Optional[bool] = ...,
        dump_after: Optional[str] = ...,
        check: Optional[bool] = ...,
        graph: Optional[bool] = ...,
    ) -> HostProgram:
        """Lowers to a host program (every pass, then the cross-rank check)."""
    def lower_for_rank(
        self,
        rank: int,
        world_size: int,
        store: Any,
        namespace: str,
        timeout: float = 120.0,
        **options: Any,
    ) -> HostProgram:
        """Lowers as one rank of a multi-process job, after the ranks agree on the machine
        profile through ``store`` (a torch ``Store``, ``"env"`` or ``"local"``); options as
        :meth:`lower`."""
    def check(self, ranks: Optional[int] = None, **options: Any) -> CheckReport:
        """Lowers and runs the static cross-rank check; raises ``CheckError``."""
    def run(
        self, backend: str = "cpu", ranks: Optional[int] = None, seed: int = 0, **options: Any
    ) -> RunResult:
        """Runs on seeded random inputs and compares with the unsharded reference."""

class HostProgram:
    """A host program, with the compiler's reports; ``str(host)`` is its text."""

    @staticmethod
    def from_text(text: str, ranks: Optional[int] = None, check: bool = True) -> HostProgram: ...
    @property
    def name(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def inputs(self) -> list[TensorSpec]: ...
    @property
    def outputs(self) -> list[TensorSpec]: ...
    @property
    def kernels(self) -> list[str]: ...
    @property
    def explain(self) -> str: ...
    @property
    def plans(self) -> dict[str, dict[str, Any]]: ...
    @property
    def profile(self) -> Optional[str]: ...
    @property
    def transport(self) -> Optional[str]: ...
    @property
    def check_report(self) -> Optional[CheckReport]: ...
    @property
    def dumps(self) -> list[tuple[str, str]]: ...
    def scatter(self, name: str, full: Any) -> dict[int, np.ndarray]:
        """Cuts a full array into each holding rank's local array."""
    def gather(self, name: str, parts: Mapping[int, Any]) -> np.ndarray:
        """Assembles the full array from the holding ranks' local arrays."""

class RunResult:
    """What ``Program.run`` gives."""

    @property
    def ok(self) -> bool: ...
    @property
    def summary(self) -> str: ...
    @property
    def errors(self) -> dict[str, float]: ...
    @property
    def tolerances(self) -> dict[str, float]: ...
    @property
    def outputs(self) -> dict[str, np.ndarray]: ...
    @property
    def reference(self) -> dict[str, np.ndarray]: ...
    @property
    def inputs(self) -> dict[str, np.ndarray]: ...
    @property
    def host(self) -> HostProgram: ...
    @property
    def backend(self) -> str: ...
    @property
    def ranks(self) -> int: ...
    def __bool__(self) -> bool: ...

class Tensor:
    """A tensor handle of a ``Builder``."""

class Mesh:
    """A device mesh handle of a ``Builder``."""

class Schedule:
    """The schedule of one tensor of a ``Builder``; the methods chain."""

    def outer_split(self, axis: int, parts: int) -> Schedule: ...
    def inner_split(self, axis: int, factor: int) -> Schedule: ...
    def merge(self, axis: int) -> Schedule: ...
    def reorder(self, order: Sequence[int]) -> Schedule: ...
    def swizzle1d(self, axis: int, pt: str) -> Schedule: ...
    def parallelize(self, axis: int, pt: str) -> Schedule: ...

class Builder:
    """Builds a level-1 program op by op (the Rust ``ProgramBuilder``)."""

    def __init__(self, name: str) -> None: ...
    def mesh(
        self,
        name: str,
        shape: Union[int, Sequence[int]],
        start: int = 0,
        devices: Optional[Sequence[int]] = None,
    ) -> Mesh: ...
    def input(self, name: str, dtype: str, shape: Sequence[int], mesh: Mesh) -> Tensor: ...
    def schedule(self, t: Tensor) -> Schedule: ...
    def replicate(self, t: Tensor) -> None: ...
    def place(self, t: Tensor, mesh: Mesh) -> None: ...
    def rename(self, t: Tensor, name: str) -> None: ...
    def name_of(self, t: Tensor) -> str: ...
    def output(self, t: Tensor) -> None: ...
    def set(self, x: Tensor) -> Tensor: ...
    def matmul(self, a: Tensor, b: Tensor) -> Tensor: ...
    def linear(self, x: Tensor, w: Tensor) -> Tensor: ...
    def add(self, a: Tensor, b: Tensor) -> Tensor: ...
    def sub(self, a: Tensor, b: Tensor) -> Tensor: ...
    def mul(self, a: Tensor, b: Tensor) -> Tensor: ...
    def gelu(self, x: Tensor) -> Tensor: ...
    def silu(self, x: Tensor) -> Tensor: ...
    def sum(self, x: Tensor, axis: int) -> Tensor: ...
    def cast(self, x: Tensor, dtype: str) -> Tensor: ...
    def moe_dispatch(
        self, x: Tensor, topk_idx: Tensor, experts: int, capacity: int
    ) -> tuple[Tensor, Tensor, Tensor]: ...
    def grouped_matmul(self, expert_x: Tensor, counts: Tensor, w: Tensor) -> Tensor: ...
    def moe_combine(
        self, expert_y: Tensor, counts: Tensor, routing: Tensor, topk_weights: Tensor
    ) -> Tensor: ...
    def custom(
        self,
        kernel: str,
        inputs: Sequence[Tensor],
        outputs: Sequence[tuple[str, Sequence[int]]],
        args: Sequence[int] = ...,
    ) -> list[Tensor]: ...
    @property
    def text(self) -> str: ...
    def build(self) -> Program: ...

class CpuJob:
    """The ranks of one job on the CPU backend, in this process."""

    def __init__(self, world_size: int, timeout: float = 30.0) -> None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def failure(self) -> Optional[tuple[int, str]]: ...

class CpuExecutor:
    """One rank of a host program on the CPU backend, on numpy arrays."""

    def __init__(self, host: HostProgram, rank: int, job: CpuJob) -> None: ...
    @property
    def rank(self) -> int: ...
    def run(self, bindings: Mapping[str, Any]) -> dict[str, np.ndarray]: ...

class CudaExecutor:
    """One rank of a host program on a GPU (wheels built with CUDA)."""

    def __init__(
        self,
        host: HostProgram,
        rank: int,
        device: int,
        store: Any,
        namespace: str,
        timeout: float = 120.0,
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def records_graphs(self) -> bool: ...
    @property
    def last_run_us(self) -> Optional[float]: ...
    def run(self, bindings: Mapping[str, Any], stream: Any) -> dict[str, np.ndarray]: ...

class NativeAllToAll:
    """One rank's MoE dispatch/combine (wheels built with CUDA)."""

    def __init__(
        self,
        rank: int,
        world: int,
        experts: int,
        top_k: int,
        tokens: int,
        hidden: int,
        out_hidden: int,
        capacity: int,
        dtype: str,
        transport: str,
        device: int,
        store: Any,
        namespace: str,
        timeout: float = 120.0,
    ) -> None: ...
    @property
    def capturable(self) -> bool: ...
    def outputs(self) -> list[Any]: ...
    def dispatch(self, x: Any, topk_idx: Any, stream: Any) -> None: ...
    def combine(self, expert_y: Any, weights: Any, out: Any, stream: Any) -> None: ...
    def status(self, stream: Any) -> dict[str, bool]: ...
    def clear_status(self, stream: Any) -> None: ...

def parse(
    text: str, ranks: Optional[int] = None, params: Optional[Mapping[str, int]] = None
) -> Program:
    """Parses level-1 program text."""

def load(
    path: Union[str, PathLike[str]],
    ranks: Optional[int] = None,
    params: Optional[Mapping[str, int]] = None,
) -> Program:
    """Reads and parses a level-1 program file."""
