//! The `meshflow` binary on GPUs (feature `cuda`): ranks split into nodes linked by the host
//! proxy, in one process and in several; one process per GPU sharing memory over CUDA IPC; the
//! machine profile a GPU run lowers with. Without enough GPUs each test prints why it skipped.
#![cfg(feature = "cuda")]

#[path = "../../../tests/support/mod.rs"]
mod support;

mod graph;
mod ipc;
mod launch;
mod profile;
mod proxy;
