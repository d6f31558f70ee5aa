//! meshflow: lower sharded tensor programs to a rank-agnostic host IR and run it.
#![forbid(unsafe_code)]

pub use meshflow_ir as ir;
/// The unsafe/FFI crate: CUDA, NCCL and the inter-node host proxy ([`kernels::proxy`]).
pub use meshflow_kernels as kernels;
pub use meshflow_passes as passes;

pub mod bench;
pub mod check;
pub mod launch;
pub mod pipeline;
pub mod runtime;
