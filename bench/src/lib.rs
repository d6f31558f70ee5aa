//! meshflow's benchmarks, kept out of the library crate.
//!
//! - The GPU benchmarks behind `meshflow bench` (feature `cuda`): overlapped AG+GEMM
//!   (`agmm`) and GEMM+RS (`rsmm`) variants next to their parts timed alone and the bound
//!   max(comm, GEMM), collective-permute bandwidth (`permute`), and MoE dispatch/combine
//!   latency (`moe`).
//! - [`programs`] builds the benchmarked programs (also used by the GPU overlap tests and
//!   checked on the CPU backend in CI): every variant is a lowered program.
//! - [`stats`]: medians, tables and JSON; [`rows`]: the flat JSON rows of `bench/results/`; [`torch`]: PyTorch's figures from the same machine
//!   (the JSON of its baseline script, `--torch FILE`).
//! - [`calibrate`]: `meshflow calibrate`, the machine profile measured on the CPU backend or
//!   on GPUs.
//! - `benches/`: criterion benchmarks of the CPU side (lowering, evaluator overhead).
//!
//! Measured results live in `bench/results/`.
#![forbid(unsafe_code)]

pub mod calibrate;
pub mod moe_program;
pub mod programs;
pub mod rows;
pub mod stats;
pub mod torch;

#[cfg(feature = "cuda")]
mod cases;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod launched;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod moe_eval;
#[cfg(feature = "cuda")]
mod session;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod watchdog;

#[cfg(feature = "cuda")]
pub use cases::{bench_agmm, bench_rsmm};
#[cfg(feature = "cuda")]
pub use gpu::{bench_permute, BenchError, BenchOptions};
pub use stats::{
    median, permute_json, permute_table, results_json, CaseResult, PermuteResult, Timing,
    VariantResult,
};
pub use torch::{TorchBaselines, TorchCase};
