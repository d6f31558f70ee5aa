//! The `meshflow` binary on GPUs (feature `cuda`): ranks split into nodes linked by the host
//! proxy, in one process and in several. Without enough GPUs each test prints why it skipped.
#![cfg(feature = "cuda")]

#[path = "../../../tests/support/mod.rs"]
mod support;

mod graph;
mod launch;
mod proxy;
