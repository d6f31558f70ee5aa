//! Helpers shared by the pass tests.
#![allow(dead_code)]

use meshflow_ir::host::{CommKind, InstKind};
use meshflow_ir::{DeviceMesh, HostProgram, Inst, Program, ProgramBuilder};
use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PropagateShardings, SimplifyIndices, VerifyHost, VerifyProgram,
};
use meshflow_passes::{Pass, PassContext, PassError, PassManager, PassOutput};

/// The full pass list (the same order as `meshflow::pipeline`).
pub fn all_passes() -> Vec<Pass> {
    vec![
        Pass::Program(Box::new(VerifyProgram)),
        Pass::Program(Box::new(PropagateShardings)),
        Pass::Program(Box::new(DecomposeReshardings)),
        Pass::Program(Box::new(ChooseDecompositions)),
        Pass::Lower(Box::new(LowerToHost)),
        Pass::Host(Box::new(SimplifyIndices)),
        Pass::Host(Box::new(AssignStreams)),
        Pass::Host(Box::new(InsertAllocations)),
        Pass::Host(Box::new(DeferWaits)),
        Pass::Host(Box::new(VerifyHost)),
    ]
}

/// The level-1 passes, the lowering and `simplify_indices` only (compact output).
pub fn lowering_passes() -> Vec<Pass> {
    vec![
        Pass::Program(Box::new(PropagateShardings)),
        Pass::Program(Box::new(DecomposeReshardings)),
        Pass::Program(Box::new(ChooseDecompositions)),
        Pass::Lower(Box::new(LowerToHost)),
        Pass::Host(Box::new(SimplifyIndices)),
    ]
}

/// Runs `passes` on `program` with a fresh context.
pub fn run(program: &Program, passes: Vec<Pass>) -> Result<(PassOutput, PassContext), PassError> {
    let mut cx = PassContext::new(program);
    let out = PassManager::new(passes)
        .with_verify(true)
        .run(program.clone(), &mut cx)?;
    Ok((out, cx))
}

/// The host program of the compact lowering.
pub fn lower(program: &Program) -> HostProgram {
    run(program, lowering_passes())
        .unwrap_or_else(|e| panic!("lowering failed: {e}"))
        .0
        .host
}

/// The host program of the full pipeline.
pub fn lower_full(program: &Program) -> HostProgram {
    run(program, all_passes())
        .unwrap_or_else(|e| panic!("lowering failed: {e}"))
        .0
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
