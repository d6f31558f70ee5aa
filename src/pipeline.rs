//! THE ordered list of passes ([`pipeline`]); [`compile`](crate::compile) runs it.
//!
//! | # | pass | level | what it does |
//! |---|---|---|---|
//! | 1 | `verify_program` | 1 | rejects invalid input (cannot be disabled) |
//! | 2 | `propagate_shardings` | 1 | fills in unannotated schedules (weights first, then backward) |
//! | 3 | `decompose_reshardings` | 1 | rfactors partial-sum outputs; inserts `set`s so each resharding is one decision-table row |
//! | 4 | `choose_decompositions` | 1 | the schedule search: decomposition, chunks, stream schedule and transport of least predicted time (machine profile) |
//! | 5 | `lower_to_host` | 1 -> host | stream loops, communications, compute (cannot be disabled) |
//! | 6 | `prefetch_transfers` | host | ring loops planned (or forced) with the prefetch schedule: transfers one iteration ahead on a worker, compute on the main stream |
//! | 7 | `simplify_indices` | host | egg: affine-mod canonical index expressions; proves ring peers inverse |
//! | 8 | `assign_streams` | host | worker-stream pool around loops with communication and compute |
//! | 9 | `insert_allocations` | host | allocate/deallocate at the dominating block |
//! | 10 | `defer_waits` | host | waits just before first use; ring buffers for per-iteration temporaries |
//! | 11 | `verify_host` | host | checks the result (cannot be disabled) |
//!
//! `choose_decompositions` runs at level 1 (after the decomposition, before lowering) because
//! what it decides is a schedule: the Stream split (and swizzle) of a resharding's output,
//! which the lowering then turns into a loop. `simplify_indices` runs right after lowering so
//! later passes see canonical indices, and `assign_streams` runs before `insert_allocations`
//! so buffers are allocated outside the fork/join of a loop.
//!
//! The list is a [`PassManager`]: level-1 passes, the lowering, host passes, each in a list of
//! its own type, so a pass cannot be listed on the wrong side of the phase change.

use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PrefetchTransfers, PropagateShardings, SimplifyIndices, VerifyHost, VerifyProgram,
};
use meshflow_passes::PassError;
pub use meshflow_passes::{PassManager, PassOptions, StreamSchedule};

/// The passes, in order.
pub fn pipeline() -> PassManager {
    PassManager::new(
        vec![
            Box::new(VerifyProgram),
            Box::new(PropagateShardings),
            Box::new(DecomposeReshardings),
            Box::new(ChooseDecompositions),
        ],
        Box::new(LowerToHost),
        vec![
            Box::new(PrefetchTransfers),
            Box::new(SimplifyIndices),
            Box::new(AssignStreams),
            Box::new(InsertAllocations),
            Box::new(DeferWaits),
            Box::new(VerifyHost),
        ],
    )
}

/// The pass names, in order.
pub fn pass_names() -> Vec<&'static str> {
    pipeline().pass_names()
}

/// A machine profile by built-in name (`h200x2`, `h100x2`) or JSON file path.
pub fn load_profile(name_or_path: &str) -> Result<meshflow_passes::Profile, PassError> {
    if meshflow_passes::profile::BUILTIN.contains(&name_or_path) {
        return meshflow_passes::Profile::builtin(name_or_path);
    }
    let text = std::fs::read_to_string(name_or_path).map_err(|e| {
        PassError::Options(format!(
            "profile `{name_or_path}` is neither a built-in profile ({}) nor a readable file: {e}",
            meshflow_passes::profile::BUILTIN.join(", ")
        ))
    })?;
    meshflow_passes::Profile::from_json(&text)
}
