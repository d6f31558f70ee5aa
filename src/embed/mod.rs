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
//!    propagation and resharding like an elementwise op and lowers to `launch_kernel`, which
//!    calls the kernel the embedder registered with the backend — a Rust closure in
//!    [`SimKernels`](crate::runtime::sim::SimKernels) on the CPU, a PTX or CUBIN image with
//!    its launch geometry on CUDA. The kernel gets the local chunks of the inputs and
//!    outputs and, as scalar arguments, the op's `args` followed by the extents of the first
//!    output's chunk. The CPU closure also serves as the op's reference
//!    ([`reference::evaluate_with`](crate::runtime::reference::evaluate_with)), so
//!    [`run_and_compare`](crate::runtime::run_and_compare) checks programs with custom ops.
//!
//! Every failure is one [`Error`].
//!
//! See the crate docs for a complete example and `examples/embed_frontend.rs` for a front end
//! with its own fused kernel.

mod compiled;
mod cpu;
mod error;
mod executor;
mod options;

pub use compiled::{compile, Compiled, TensorInfo};
pub use cpu::{CpuJob, CpuTensor};
pub use error::Error;
pub use executor::{Bind, Bindings, Executor};
pub use options::{parse, Options};
