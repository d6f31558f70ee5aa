//! Execution of host programs: the [`Evaluator`] over a [`Backend`], the embedded CPU backend
//! [`CpuBackend`], the level-1 [`reference`](mod@reference) interpreter, and the helpers that scatter, run,
//! gather and compare.
//!
//! - [`data`], [`view`]: host tensors and strided views.
//! - [`cpu_ops`]: numeric kernels of the CPU backend.
//! - [`mod@reference`]: the level-1 interpreter on full tensors, with its own naive kernels.
//! - [`shard`]: scatter/gather by a level-1 tensor's layout.
//! - [`backend`]: the [`Backend`] trait (shaped for CUDA streams, events and NCCL).
//! - [`evaluator`]: [`Evaluator`], one rank's interpreter of a host program.
//! - [`cpu`]: [`CpuBackend`], N ranks as threads with race checking.
//! - [`ranks`]: fault-tolerant runs of N CPU ranks, one thread each ([`run_cpu`]).
//! - [`rendezvous`]: key/value stores and barriers for ranks (threads or processes, TCP).
//! - `cuda` (feature `cuda`): the CUDA backend over NCCL, and runs of N GPU ranks.
//! - [`trace`]: Chrome/Perfetto traces.
//! - [`compare`]: [`run_and_compare`] and per-output comparisons.
//! - `transport_rules`: which transport carries each communication on GPUs.
//! - [`multinode`]: multi-process CPU runs, nodes linked by the inter-node host proxy.
//! - `faults` (feature `fault-injection`, tests only): ranks that fail on purpose.

pub mod backend;
mod bytes;
pub(crate) mod collective;
pub mod compare;
pub mod cpu;
pub mod cpu_ops;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod evaluator;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub mod multinode;
pub mod ranks;
pub mod reference;
mod reference_ops;
pub mod rendezvous;
pub mod shard;
pub mod shard_partial;
pub mod trace;
mod trace_svg;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod transport_rules;
pub mod view;

pub use backend::Backend;
pub use compare::{run_and_compare, Comparison};
pub use cpu::{CpuBackend, CpuConfig};
pub use data::TensorData;
pub use evaluator::{EvalOptions, Evaluator, RuntimeError, SelectedTransport};
pub use ranks::{
    run_cpu, run_cpu_observed, CpuOptions, RunError, RunInputs, RunOutcome, RunResources,
};
