//! meshflow: lower sharded tensor programs to a rank-agnostic host IR and run it.
#![forbid(unsafe_code)]

pub use meshflow_ir as ir;
pub use meshflow_passes as passes;

pub mod bench;
pub mod check;
pub mod launch;
pub mod pipeline;
pub mod runtime;
