//! The front door: [`compile`] a level-1 program with [`Options`] into a [`Compiled`] host
//! program, or load host IR text ([`Compiled::from_host_text`]). The command line and the
//! embedding API both come in here, with the same options.
//!
//! - [`options`]: [`Options`] (the job size, parameters, the pass options that
//!   [`PassContext`](meshflow_passes::PassContext) borrows, the cross-rank check) and
//!   [`parse`].
//! - [`compiled`]: [`compile`] and what it produces.

pub mod compiled;
pub mod options;

pub use compiled::{compile, Compiled, TensorInfo};
pub use options::{parse, Options};
