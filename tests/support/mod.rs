//! What the integration tests share, in one module (every test binary of the workspace that
//! needs it includes it with `#[path]`):
//!
//! - [`programs`]: the example programs built with `ProgramBuilder`, and a transformer.
//! - [`runtime`]: test data files, CPU options, host-text templates of the runtime tests.
//! - [`check`]: host programs built by hand for the cross-rank check.
//! - [`conformance`]: the conformance cases of `tests/data/conformance` (DTensor, nvFuser).
//! - [`corpus`]: the mutation corpus (`tests/data/mutations`).
//! - [`embed`]: running every rank of an embedded job on threads, a fused kernel.
//! - [`faults`]: the timeouts and checks of the CPU fault tests.
//! - [`moe`]: MoE layers whose dispatch outputs are poisoned first, routing, expert rows as
//!   multisets.
//! - [`hardening`]: process probes (threads, descriptors, memory) and the lock that serializes
//!   the tests that read them.
//! - [`launch`]: an ignored test of the current binary run as the ranks of a multi-process
//!   run (the launcher behind `meshflow launch`).
//! - [`passes`]: the file-driven pass tests (`tests/data/passes`, `MESHFLOW_BLESS=1`).
//! - `gpu` (feature `cuda`): GPU counts, honest skips, CPU-vs-GPU comparisons.
#![allow(dead_code)]

pub mod check;
pub mod conformance;
pub mod corpus;
pub mod embed;
pub mod faults;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod hardening;
pub mod launch;
pub mod moe;
pub mod passes;
pub mod programs;
pub mod runtime;

use std::path::PathBuf;

/// The repository root (where `examples/` and `tests/data/` are), from any crate of the
/// workspace.
pub fn root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("examples/programs").is_dir() && d.join("tests/data").is_dir())
        .map(PathBuf::from)
        .unwrap_or(here)
}
