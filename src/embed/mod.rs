//! The embedding API: meshflow as the backend of another compiler.
//!
//! A front end builds a sharded level-1 program ([`ProgramBuilder`](meshflow_ir::ProgramBuilder)
//! or text through [`parse`]), lowers it with [`compile`] and runs the host program inside its
//! own process, one [`Executor`] per rank, on its own tensors:
//!
//! 1. **Compile.** [`compile`]`(&program, &`[`Options`]`)` runs the pass pipeline and the
//!    static cross-rank check. [`Options`] carry the job size ([`Options::for_ranks`]),
//!    pass-list changes, the worker-stream count, forced decompositions and the transport.
//!    The result, [`Compiled`], prints its host program ([`Compiled::host_text`]) and loads
//!    one back ([`Compiled::from_host_text`]), lists the inputs and outputs with their
//!    per-rank shapes ([`Compiled::inputs`]) and cuts or assembles full tensors by their
//!    layouts ([`Compiled::scatter`], [`Compiled::gather`]).
//! 2. **Execute.** [`Executor::new`]`(&compiled, rank, backend)` prepares one rank on a
//!    backend; [`Executor::run`]`(&mut `[`Bindings`]`)` runs one step with the caller's
//!    tensors bound by name: inputs are read, outputs written **in place** into the caller's
//!    buffers. An executor is reused across steps. On the CPU backend the ranks of one
//!    process share a [`CpuJob`] (`CpuJob::new(world_size, config).backend(rank)`); tensors
//!    are [`CpuTensor`]s (`Bindings::input(name, &data)`, `Bindings::output(name, &mut
//!    data)`: the caller's allocation itself is written, with no copy).
//! 3. **External compute.** A level-1 `custom(inputs.., kernel="NAME", args=[..])` op (built
//!    with [`ProgramBuilder::custom`](meshflow_ir::ProgramBuilder::custom); contract on
//!    [`CustomOp`](meshflow_ir::CustomOp)) is the front end's own op: it flows through sharding
//!    propagation and resharding like an elementwise op and lowers to `call_kernel`, which
//!    calls the kernel the embedder registered with the backend — a Rust closure in
//!    [`CpuKernels`](crate::runtime::cpu::CpuKernels) on the CPU, a PTX or CUBIN image with
//!    its launch geometry on CUDA. The kernel gets the local chunks of the inputs and
//!    outputs and, as scalar arguments, the op's `args` followed by the extents of the first
//!    output's chunk. The CPU closure also serves as the op's reference
//!    ([`reference::evaluate_with`](crate::runtime::reference::evaluate_with)), so
//!    [`run_and_compare`](crate::runtime::run_and_compare) checks programs with custom ops.
//!
//! **On GPUs** (feature `cuda`), the same [`Executor`] runs on a `CudaBackend` made by
//! `CudaJob::backend(rank, CudaResources { device, stream, comms })`: the caller's stream is
//! the rank's main stream (the program runs in order with the caller's work), its NCCL
//! communicators serve the teams they are given for (handed in borrowed with
//! `Comm::from_raw_borrowed`: never destroyed, aborted or cached), and its device memory is
//! bound as `CudaTensor`s (wrapped with `DeviceBuffer::from_raw_borrowed`; used in place, no
//! copy in or out). Kernels are registered in `CudaKernels` as a PTX or CUBIN image, a
//! function name and a closure giving the launch geometry; their parameters are a pointer per
//! input, a pointer per output, then the scalar arguments as 64-bit integers.
//! [`compile`] does not know which GPUs will run the program: name their model with
//! [`Options::device`] (`Device::name`, e.g. `NVIDIA H100 80GB HBM3`) so the schedule search
//! prices plans with its built-in profile, or give one with [`Options::profile`]; without
//! either it uses the default `h200x2` ([`Compiled::profile_reason`] says which and why). When
//! the ranks lower in separate processes (one per GPU under torchrun, several nodes), call
//! [`Options::agree_profile`] on every rank before [`compile`] so that they price with one
//! profile (rank 0's where their GPU models differ); a job made with
//! `CudaJob::for_program_with_rendezvous` over a rendezvous that spans processes checks that
//! each rank lowered rank 0's host program when its backend is made
//! ([`crate::front::agree`]).
//! `examples/embed_frontend.rs` shows both backends.
//!
//! Every failure is one [`Error`].
//!
//! See the crate docs for a complete example and `examples/embed_frontend.rs` for a front end
//! with its own fused kernel.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod executor;

pub use crate::error::Error;
pub use crate::front::{compile, parse, Compiled, Options, TensorInfo};
#[cfg(feature = "cuda")]
pub use crate::runtime::cuda::{CudaBackend, CudaConfig, CudaKernels, CudaResources, GridDims};
pub use cpu::{CpuJob, CpuTensor};
#[cfg(feature = "cuda")]
pub use cuda::{CudaJob, CudaTensor};
pub use executor::{Bind, Bindings, Executor};
