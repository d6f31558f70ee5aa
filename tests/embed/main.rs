//! The embedding API on the CPU backend: compile options, external (custom) kernels, and the
//! executor on caller-owned tensors.

#[path = "../support/mod.rs"]
mod support;

mod compile;
mod custom;
mod executor;
