//! Sharding coverage: the conformance suite (cases transcribed from PyTorch DTensor's and
//! nvFuser's tests, `tests/data/conformance`), random shardings as property tests, and the
//! regressions they found; every lowered program passes the cross-rank check and matches the
//! unsharded reference on the CPU backend.

#[path = "../support/mod.rs"]
mod support;

mod conformance;
mod layouts;
mod properties;
mod regressions;
