//! The CUDA backend (feature `cuda`): the same host programs as the CPU backend, on GPUs.
//!
//! - [`CudaBackend`] implements [`Backend`](crate::runtime::Backend) for one rank on one GPU:
//!   buffers are slots of a caching allocator ([`CudaBuffer`]); a main stream and a bounded pool
//!   of worker streams; `synchronize` is an event recorded on the other stream and waited on by
//!   the current one; compute runs on the current stream (cuBLAS GEMMs without TF32, NVRTC
//!   kernels for elementwise ops, sums, casts and layout changes; strided views are copied to
//!   packed temporaries where a kernel needs packed operands); a posted communication is an
//!   event, and `wait` makes the current stream wait for it (the host never blocks until the
//!   end of the run).
//! - The backend is a **device core** (`core.rs`: streams, memory, events, timeline) plus one
//!   object per **transport** (`transport/`): NCCL (one communicator per team, created once
//!   through a [`Rendezvous`](crate::runtime::rendezvous::Rendezvous) and cached for the
//!   process), the copy engine (peers whose GPU memory this rank reaches: threads of this
//!   process through the launch's hub, or processes of this host over CUDA IPC), the host
//!   proxy (ranks of other nodes), MoE over NCCL and MoE over NVLink (the same peers as the
//!   copy engine). The transport of every communication is selected per team
//!   when the program is prepared ([`Transport`], [`CudaConfig::transport`]; the rules are in
//!   `src/runtime/transport_rules.rs`), and traces and reports name it.
//! - Profiling mode ([`CudaConfig::profile`]) records events around every compute op and
//!   communication and reports [`Interval`]s per stream; every run also reports its device time
//!   ([`CudaBackend::last_run_us`]).
//! - [`run_cuda`] / [`run_cuda_timed`] run a host program in-process, one thread per GPU (rank `r`
//!   on GPU `r`); [`run_rank`] runs one rank of a multi-process run (torchrun variables, TCP
//!   rendezvous); [`run_program_cuda`] does either from full inputs and returns full outputs
//!   (what `meshflow run --backend cuda` does; [`run_program_rank`] on a rendezvous the caller
//!   connected before lowering, see [`crate::front::agree`]); [`run_and_compare_cuda`] compares a run with
//!   the level-1 reference.
//!
//! A missing driver, GPU or library is an error value naming the rank and the call, never a
//! panic. A rank that fails sets a shared [`AbortSignal`]; the others stop waiting for the
//! device, abort their communicators and report the failed rank.
//!
//! Runs split into nodes ([`CudaConfig::node_size`] or `MESHFLOW_NODE_SIZE`) move collective
//! permutes and MoE rows between ranks of different nodes through the inter-node host proxy
//! over the wire [`CudaConfig::wire`] chooses (staged in host memory by each rank's thread).

mod backend;
mod compare;
mod compute;
mod config;
mod core;
mod deferred;
mod graph;
mod group;
mod layout;
mod layout_ops;
mod memory;
mod operands;
mod profile;
mod program;
mod ranks;
mod teams;
mod transport;
mod user_kernels;

pub use self::core::CudaComm;
pub use backend::CudaBackend;
pub use compare::{run_and_compare_cuda, CudaCompareError};
pub use config::{AbortSignal, CopyStream, CudaConfig, CudaResources, DeferPulls};
pub use memory::CudaBuffer;
pub use meshflow_kernels::proxy::WireChoice;
pub use meshflow_passes::Transport;
pub use profile::{Interval, IntervalKind};
pub use program::{run_program_cuda, run_program_rank, ProgramRun};
pub use ranks::{
    device_count, run_cuda, run_cuda_timed, run_rank, target_device, CudaOptions, CudaRunError,
    RankRun, TimedRun,
};
pub use teams::clear_communicator_cache;
pub use transport::PeerHub;
pub use user_kernels::{CudaKernels, DimsFn, GridDims};
