//! meshflow: lower sharded tensor programs to a rank-agnostic host IR and run it.
//!
//! The language (meshes, splits, stream loops, the host IR and its text format) is specified
//! in the docs of [`ir`]; the passes are listed in [`pipeline`]; the runtime is in
//! [`runtime`].
//!
//! # Embedding meshflow in a compiler
//!
//! The [`embed`] API (re-exported here) makes meshflow the backend of another compiler: the
//! front end builds a sharded program — possibly with its own fused ops (`custom`, a kernel
//! it registers) — [`compile`]s it, and runs it inside its own process with one [`Executor`]
//! per rank, on its own tensors, written in place. Errors are one [`Error`].
//!
//! This example splits `x[4, 3]` by rows over 2 ranks, applies the front end's own op
//! (`double`, a Rust closure on the CPU backend), and runs both ranks on threads:
//!
//! ```
//! use meshflow::ir::{DType, DeviceMesh, ParallelType::DIDx, ProgramBuilder, TensorType};
//! use meshflow::{compile, Bindings, CpuJob, Executor, Options, CpuConfig, TensorData};
//!
//! fn main() -> Result<(), meshflow::Error> {
//!     // 1. Build: y = double(x), x split by rows over ranks 0 and 1.
//!     let mut b = ProgramBuilder::new("double_rows");
//!     let m = b.mesh("m", DeviceMesh::iota(vec![2], 0)?)?;
//!     let x = b.input("x", DType::F32, &[4, 3], m)?;
//!     b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
//!     let y = b.custom("double", &[x], &[TensorType::new(DType::F32, &[4, 3])], &[])?[0];
//!     b.rename(y, "y")?;
//!     b.output(y);
//!     let program = b.build()?;
//!
//!     // 2. Compile for a job of 2 ranks; the host program prints and parses back.
//!     let compiled = compile(&program, &Options::for_ranks(2))?;
//!     assert!(compiled.host_text().contains("kernel=\"double\", args=[2, 3]"));
//!     let reloaded = meshflow::Compiled::from_host_text(&compiled.host_text(), &Options::new())?;
//!     assert_eq!(reloaded.host(), compiled.host());
//!
//!     // 3. Register the kernel: local input chunks, output chunks written in place, args.
//!     let mut config = CpuConfig::default();
//!     config.kernels.register("double", |ins, outs, _args| {
//!         let x = ins[0].to_f32();
//!         let y: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
//!         outs[0].assign_f32(&y).map_err(|e| e.to_string())
//!     });
//!     let job = CpuJob::new(2, config);
//!
//!     // 4. One executor per rank, each on its own thread, with caller-owned tensors.
//!     let full: Vec<f32> = (0..12).map(|v| v as f32).collect();
//!     let x_parts = compiled.scatter("x", &TensorData::from_f32(DType::F32, &[4, 3], &full)?)?;
//!     let mut y_parts = vec![TensorData::zeros(DType::F32, &[2, 3])?; 2];
//!     std::thread::scope(|s| {
//!         let threads: Vec<_> = y_parts
//!             .iter_mut()
//!             .enumerate()
//!             .map(|(rank, y_local)| {
//!                 let (compiled, job, x_local) = (&compiled, &job, &x_parts[&rank]);
//!                 s.spawn(move || -> Result<(), meshflow::Error> {
//!                     let mut exec = Executor::new(compiled, rank, job.backend(rank)?)?;
//!                     let mut bindings = Bindings::new();
//!                     bindings.input("x", x_local).output("y", y_local);
//!                     exec.run(&mut bindings)?; // y_local now holds this rank's rows
//!                     Ok(())
//!                 })
//!             })
//!             .collect();
//!         threads.into_iter().try_for_each(|t| t.join().expect("rank thread"))
//!     })?;
//!     assert_eq!(y_parts[1].storage().to_f32_vec(), vec![12.0, 14.0, 16.0, 18.0, 20.0, 22.0]);
//!     Ok(())
//! }
//! ```
//!
//! With feature `cuda`, the same executor runs on GPUs, on the caller's resources: its
//! stream, its device buffers (bound in place) and its NCCL communicators (`CudaJob`,
//! `CudaResources`, `CudaTensor`; see [`embed`]), with kernels registered as PTX or CUBIN
//! images plus their launch geometry (`CudaKernels`).
#![forbid(unsafe_code)]

pub use meshflow_ir as ir;
/// The FFI crate (all of the workspace's raw-pointer code): CUDA, NCCL and the inter-node
/// host proxy ([`kernels::proxy`]); with feature `cuda`, the constructors that wrap an
/// embedder's raw handles (streams, device memory, communicators; the caller vouches for
/// them).
pub use meshflow_kernels as kernels;
pub use meshflow_passes as passes;

pub mod check;
pub mod embed;
pub mod error;
pub mod front;
pub mod launch;
pub mod ordering;
pub mod pipeline;
pub mod runtime;

pub use embed::{Bind, Bindings, CpuJob, CpuTensor, Executor};
#[cfg(feature = "cuda")]
pub use embed::{
    CudaBackend, CudaConfig, CudaJob, CudaKernels, CudaResources, CudaTensor, GridDims,
};
pub use error::Error;
pub use front::{compile, format_of, load, parse, Compiled, Format, Options, TensorInfo};
pub use meshflow_passes::{CostModel, Decomposition, Plan, Profile, Transport};
pub use runtime::cpu::CpuKernels;
pub use runtime::{CpuBackend, CpuConfig, TensorData};
