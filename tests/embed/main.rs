//! The embedding API on the CPU backend: compile options, external (custom) kernels, the
//! executor on caller-owned tensors, and the ranks of a multi-process job agreeing on what
//! they lower.

#[path = "../support/mod.rs"]
mod support;

mod agree;
mod compile;
mod custom;
mod executor;
