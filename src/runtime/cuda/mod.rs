//! The CUDA backend (feature `cuda`): the same host programs as the sim backend, on GPUs.
//!
//! - [`CudaBackend`] implements [`Backend`](crate::runtime::Backend) for one rank on one GPU:
//!   buffers are slots of a caching allocator ([`CudaBuffer`]); a main stream and a bounded pool
//!   of worker streams; `synchronize` is an event recorded on the other stream and waited on by
//!   the current one; compute runs on the current stream (cuBLAS GEMMs without TF32, NVRTC
//!   kernels for elementwise ops, sums, casts and layout changes; strided views are copied to
//!   packed temporaries where a kernel needs packed operands); communications are NCCL calls
//!   on the current stream through one communicator per team, created once through a
//!   [`Rendezvous`](crate::runtime::rendezvous::Rendezvous) and cached for the process; a
//!   posted communication is an event, and `wait` makes the current stream wait for it (the
//!   host never blocks until the end of the run).
//! - Profiling mode ([`CudaConfig::profile`]) records events around every compute op and
//!   communication and reports [`Interval`]s per stream; every run also reports its device time
//!   ([`CudaBackend::last_run_us`]).
//! - [`run_cuda`] / [`run_cuda_timed`] run a host program in-process, one thread per GPU (rank `r`
//!   on GPU `r`); [`run_rank`] runs one rank of a multi-process run (torchrun variables, TCP
//!   rendezvous); [`run_program_cuda`] does either from full inputs and returns full outputs
//!   (what `meshflow run --backend cuda` does); [`run_and_compare_cuda`] compares a run with
//!   the level-1 reference.
//!
//! A missing driver, GPU or library is an error value naming the rank and the call, never a
//! panic. A rank that fails sets a shared [`AbortSignal`]; the others stop waiting for the
//! device, abort their communicators and report the failed rank.
//!
//! MoE dispatch/combine run through the NCCL MoE transport of `meshflow-kernels` (see the
//! `moe` module for its limits on GPUs).
//!
//! Runs split into nodes ([`CudaConfig::node_size`] or `MESHFLOW_NODE_SIZE`) move collective
//! permutes and MoE rows between ranks of different nodes through the inter-node host proxy
//! over TCP (staged in host memory by each rank's thread); see the `proxy` module.

mod backend;
mod comm;
mod compare;
mod compute;
mod launch;
mod layout;
mod layout_ops;
mod memory;
mod moe;
mod operands;
mod peer;
mod profile;
mod program;
mod proxy;
mod teams;
mod user_kernels;

pub use backend::{AbortSignal, CudaBackend, CudaComm, CudaConfig, CudaResources};
pub use compare::{run_and_compare_cuda, CudaCompareError};
pub use launch::{
    device_count, run_cuda, run_cuda_timed, run_rank, CudaLaunchError, CudaOptions, RankRun,
    TimedRun,
};
pub use memory::CudaBuffer;
pub use peer::{CopyStream, CudaTransport, PeerHub};
pub use profile::{Interval, IntervalKind};
pub use program::{run_program_cuda, ProgramRun};
pub use teams::clear_communicator_cache;
pub use user_kernels::{CudaKernels, DimsFn, LaunchDims};
