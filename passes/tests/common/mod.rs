//! Helpers shared by the pass tests.
#![allow(dead_code)]

use meshflow_ir::host::{CommKind, InstKind};
use meshflow_ir::{DeviceMesh, HostProgram, Inst, Program, ProgramBuilder};
use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PropagateShardings, SimplifyIndices, VerifyHost, VerifyProgram,
};
use meshflow_passes::{PassError, PassManager, PassOptions, PassOutput};

/// The full pass list (the same order as `meshflow::pipeline`, without `prefetch_transfers`).
pub fn all_passes() -> PassManager {
    PassManager::new(
        vec![
            Box::new(VerifyProgram),
            Box::new(PropagateShardings),
            Box::new(DecomposeReshardings),
            Box::new(ChooseDecompositions),
        ],
        Box::new(LowerToHost),
        vec![
            Box::new(SimplifyIndices),
            Box::new(AssignStreams),
            Box::new(InsertAllocations),
            Box::new(DeferWaits),
            Box::new(VerifyHost),
        ],
    )
}

/// The level-1 passes, the lowering and `simplify_indices` only (compact output).
pub fn lowering_passes() -> PassManager {
    PassManager::new(
        vec![
            Box::new(PropagateShardings),
            Box::new(DecomposeReshardings),
            Box::new(ChooseDecompositions),
        ],
        Box::new(LowerToHost),
        vec![Box::new(SimplifyIndices)],
    )
}

/// Options with verification after every pass.
pub fn verifying() -> PassOptions {
    PassOptions {
        verify: true,
        ..PassOptions::default()
    }
}

/// Runs `passes` on `program`, verifying after each.
pub fn run(program: &Program, passes: PassManager) -> Result<PassOutput, PassError> {
    passes.run(program.clone(), &verifying())
}

/// The host program of the compact lowering.
pub fn lower(program: &Program) -> HostProgram {
    run(program, lowering_passes())
        .unwrap_or_else(|e| panic!("lowering failed: {e}"))
        .host
}

/// The host program of the full pipeline.
pub fn lower_full(program: &Program) -> HostProgram {
    run(program, all_passes())
        .unwrap_or_else(|e| panic!("lowering failed: {e}"))
        .host
}

/// Every instruction with its loop depth.
pub fn insts(host: &HostProgram) -> Vec<(Inst, usize)> {
    let mut out = Vec::new();
    host.walk(&mut |i, d| out.push((i.clone(), d)));
    out
}

/// The collectives of one kind, with their loop depth.
pub fn comms(host: &HostProgram, kind: CommKind) -> Vec<(Inst, usize)> {
    insts(host)
        .into_iter()
        .filter(|(i, _)| matches!(&i.kind, InstKind::Communication { kind: k, .. } if *k == kind))
        .collect()
}

/// Counts instructions whose name (`all_gather`, `permute`, ...) is `name`.
pub fn count(host: &HostProgram, name: &str) -> usize {
    insts(host)
        .iter()
        .filter(|(i, _)| i.kind.name() == name)
        .count()
}

/// A builder with a 1-D mesh `m0` of `d` devices starting at 0.
pub fn builder(name: &str, d: usize) -> (ProgramBuilder, meshflow_ir::MeshId) {
    let mut b = ProgramBuilder::new(name);
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d], 0).expect("valid mesh"))
        .expect("fresh name");
    (b, m)
}
