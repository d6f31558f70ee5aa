//! GPU tests of the benchmarked programs (feature `cuda`): overlap of communication and
//! compute measured from CUDA events, the copy-engine transport against NCCL, the measuring
//! tools (calibration, the MoE evaluator path), `bench schedule`'s cases at a small shape, and the MoE latency table (`--ignored`, a
//! benchmark). Without enough GPUs each test prints why it skipped.
#![cfg(feature = "cuda")]

#[path = "../../../tests/support/mod.rs"]
mod support;

mod moe_latency;
mod overlap;
mod schedule;
mod tools;
mod transport;
