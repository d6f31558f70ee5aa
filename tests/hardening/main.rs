//! The hardening figures of `docs/hardening.md` on the CPU backend: the fault matrix, resources
//! (memory, threads, descriptors) and determinism. These tests read process-wide probes, so
//! every test of this binary holds `support::hardening::serial()`; `scripts/hardening.sh`
//! collects their `HARDENING` rows.

#[path = "../support/mod.rs"]
mod support;

mod determinism;
mod fault_matrix;
mod resources;
