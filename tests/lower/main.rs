//! Lowering through the whole pipeline: the examples (insta snapshots, every rank count),
//! every decision-table row end to end, the schedule search and the prefetch schedule, shape
//! ops and partial placements, random op chains, the DTensor/nvFuser conformance cases, a
//! 64-layer program, and the file-driven pass tests of `tests/data/passes`
//! (`MESHFLOW_BLESS=1` rewrites them).

#[path = "../support/mod.rs"]
mod support;

mod end_to_end;
mod examples;
mod op_chains;
mod passes;
mod prefetch;
mod rows;
mod schedules;
mod shape_ops;
mod transformer;
