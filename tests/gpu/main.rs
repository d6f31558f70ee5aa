//! Every GPU test of the root crate (feature `cuda`): the accumulating GEMM and the ring that
//! uses it, communication kinds, the examples and
//! the CPU backend's programs on GPUs, determinism, errors, the fault matrix, multi-process
//! runs (NCCL, and the copy engine and NVLink MoE over CUDA IPC), MoE dispatch outputs written in
//! place, the top-k weights carried by the dispatch or the combine, and the embedding API on the
//! caller's CUDA resources. On a machine without enough
//! GPUs each test prints why it skipped. Run with `--test-threads 1` (the fault and
//! determinism tests read process-wide probes).
#![cfg(feature = "cuda")]

#[path = "../support/mod.rs"]
mod support;

mod accumulate;
mod comm;
mod determinism;
mod embed;
mod errors;
mod examples;
mod faults;
mod ipc;
mod moe_outputs;
mod moe_weights;
mod multiprocess;
mod programs;
mod shape_ops;
