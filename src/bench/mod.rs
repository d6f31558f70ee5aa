//! GPU benchmarks (`meshflow bench agmm`, `meshflow bench rsmm`): overlapped AG+GEMM and
//! GEMM+RS variants next to their parts timed alone and the bound max(comm, GEMM).
//!
//! [`programs`] builds the programs (also used by the GPU overlap tests and checked on the CPU backend
//! backend in CI), [`rings`] the hand-written neighbour rings among them; the measurement
//! itself needs the `cuda` feature.

pub mod programs;
pub mod rings;
pub mod stats;
pub mod torch;

#[cfg(feature = "cuda")]
mod gpu;

#[cfg(feature = "cuda")]
pub use gpu::{bench_agmm, bench_permute, bench_rsmm, BenchError, BenchOptions};
pub use stats::{
    median, permute_json, permute_table, results_json, CaseResult, PermuteResult, Timing,
    VariantResult,
};
pub use torch::{TorchBaselines, TorchCase};
