//! The MoE layer as a lowered program, for the evaluator path of `meshflow bench moe`: the
//! `moe_layer` program (dispatch, one expert op, combine; as `examples/programs/moe_layer.mf`)
//! at a benchmark's sizes, lowered by the pipeline, and cut down to its dispatch alone or to
//! its dispatch and combine ([`MoePhases`]) so that the evaluator's time for each phase can be
//! taken the same way the kernels' is.
//!
//! The experts are an element-wise `gelu` (`F = H`, as the kernels' benchmark, whose experts
//! are the identity), so the program needs no `[E, H, F]` weight tensor; the timed programs
//! drop the expert op anyway.

use meshflow::ir::{Block, HostProgram, InstKind, Program};
use meshflow::{compile, Error, Options};

/// A MoE case: sizes per rank and the dispatch encoding.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MoeLayer {
    /// Ranks (the expert-parallel team).
    pub world: usize,
    /// Tokens per rank `T`.
    pub tokens: u64,
    /// Token width `H` (= `F`).
    pub hidden: u64,
    /// Experts per token `K`.
    pub top_k: u64,
    /// Experts in all `E` (a multiple of `world`).
    pub experts: u64,
    /// Rows per expert (its receive capacity).
    pub capacity: u64,
    /// `wire=...` of the dispatch (empty: native), e.g. `wire=f8e4m3, scale=block128`.
    pub wire: &'static str,
    /// Element type of the tokens (`bf16`, `f32`).
    pub dtype: &'static str,
}

/// Which phases a timed program keeps.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MoePhases {
    /// The dispatch alone.
    Dispatch,
    /// Dispatch, then combine (no expert op between).
    DispatchCombine,
    /// The whole layer.
    Layer,
}

impl MoeLayer {
    /// The level-1 program text.
    pub fn text(&self) -> String {
        let MoeLayer {
            world: d,
            tokens: t,
            hidden: h,
            top_k: k,
            experts,
            capacity: c,
            wire,
            dtype: ty,
        } = *self;
        let e = experts / d as u64;
        let split = "{outer_split(0, d), parallelize(0, DIDx)}";
        let wire = if wire.is_empty() {
            String::new()
        } else {
            format!(", {wire}")
        };
        format!(
            "program moe_layer_bench {{\n  param d = {d}\n  mesh m0 = iota(d)\n  \
             input x: {ty}[{t} * d, {h}] on m0 {split}\n  \
             input topk_idx: i32[{t} * d, {k}] on m0 {split}\n  \
             input topk_weights: f32[{t} * d, {k}] on m0 {split}\n  \
             tensor expert_x: {ty}[{e} * d, {c}, {h}] on m0 {split}\n  \
             tensor expert_counts: i32[{e} * d] on m0 {split}\n  \
             tensor routing: i32[{e} * d, {c}, 2] on m0 {split}\n  \
             tensor expert_y: {ty}[{e} * d, {c}, {h}] on m0 {split}\n  \
             tensor y: {ty}[{t} * d, {h}] on m0 {split}\n  \
             expert_x, expert_counts, routing = moe_dispatch(x, topk_idx{wire})\n  \
             expert_y = gelu(expert_x)\n  \
             y = moe_combine(expert_y, expert_counts, routing, topk_weights)\n  \
             output y\n}}\n"
        )
    }

    /// The level-1 program.
    pub fn program(&self) -> Result<Program, Error> {
        meshflow::parse(&self.text(), &Options::new())
    }

    /// The program lowered by the pipeline (no options), and its host program cut down to
    /// `phases`.
    pub fn lowered(&self, phases: MoePhases) -> Result<(Program, HostProgram), Error> {
        let program = self.program()?;
        let c = compile(&program, &Options::new().check(false))?;
        let mut host = c.host().clone();
        if phases != MoePhases::Layer {
            let mut dropped = Vec::new();
            host.body = keep(&host.body, phases, &mut dropped);
        }
        Ok((c.level1()?.clone(), host))
    }
}

fn keep(b: &Block, phases: MoePhases, dropped: &mut Vec<meshflow::ir::CommId>) -> Block {
    b.iter()
        .filter_map(|inst| {
            match &inst.kind {
                InstKind::Compute { .. } | InstKind::CallKernel { .. } => return None,
                InstKind::MoeCombine { id, .. } if phases == MoePhases::Dispatch => {
                    dropped.push(*id);
                    return None;
                }
                InstKind::Wait { comm } if dropped.contains(comm) => return None,
                _ => {}
            }
            let mut inst = inst.clone();
            if let InstKind::ForLoop { body, .. } = &mut inst.kind {
                *body = keep(body, phases, dropped);
            }
            Some(inst)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow::runtime::{run_and_compare, CpuOptions};

    fn small(world: usize, wire: &'static str) -> MoeLayer {
        MoeLayer {
            world,
            tokens: 6,
            hidden: 128,
            top_k: 2,
            experts: 2 * world as u64,
            capacity: 6 * world as u64 * 2,
            wire,
            dtype: "bf16",
        }
    }

    #[test]
    fn the_layer_matches_the_reference_on_cpu_ranks() {
        for d in [1, 2, 3, 4] {
            for wire in ["", "wire=f8e4m3, scale=block128"] {
                let l = small(d, wire);
                let (program, host) = l.lowered(MoePhases::Layer).unwrap();
                let cmp = run_and_compare(&program, &host, d, 7, &CpuOptions::default())
                    .unwrap_or_else(|e| panic!("d={d} {wire}: {e}\n{host}"));
                assert!(cmp.passed(), "d={d} {wire}: {cmp}");
            }
        }
    }

    #[test]
    fn the_timed_programs_keep_their_phases() {
        let l = small(2, "");
        let (_, dispatch) = l.lowered(MoePhases::Dispatch).unwrap();
        let text = dispatch.to_string();
        assert!(text.contains("moe_dispatch("), "{text}");
        assert!(
            !text.contains("moe_combine(") && !text.contains("gelu("),
            "{text}"
        );
        assert_eq!(text.matches("wait ").count(), 1, "{text}");
        let (_, both) = l.lowered(MoePhases::DispatchCombine).unwrap();
        let text = both.to_string();
        assert!(
            text.contains("moe_dispatch(") && text.contains("moe_combine("),
            "{text}"
        );
        assert!(!text.contains("gelu("), "{text}");
        assert_eq!(text.matches("wait ").count(), 2, "{text}");
    }
}
