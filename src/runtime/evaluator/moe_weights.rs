//! Which MoE dispatches carry their combine's top-k weights.
//!
//! `moe_combine` names the weights `[B.., T, K]`; `moe_dispatch` does not. A GPU engine
//! given the weights only at the combine must first copy them to every peer there (one more
//! device exchange per step), while weights handed to the dispatch travel with the token rows
//! for free. So the evaluator hands a dispatch the weights of the one combine that reads its
//! `routing`, when that is safe:
//!
//! - the combine follows the dispatch in the same block, on the same team, with no other
//!   `moe_dispatch` or `moe_combine` between them (the engine pairs a combine with the last
//!   dispatch), and it is the only combine that reads that `routing`;
//! - the weights are a program input on the dispatch's mesh that no instruction writes,
//!   allocates, releases or views (so they hold the same values, in the same buffer, from the
//!   start of the run to its end: reading them at the dispatch instead of the combine needs
//!   no ordering the program does not already have).
//!
//! Otherwise (weights computed inside the program, say) they go with the combine, as before.
//! The decision is taken on the whole program, not on one rank's part of it, so every member
//! of a team decides the same (the engines need every rank of a step to give the weights at
//! the same phase).

use std::collections::{BTreeMap, BTreeSet};

use meshflow_ir::host::TensorUse;
use meshflow_ir::{CommId, HostProgram, HostTensorId, Inst, InstKind, Role, Team};

/// The outcome: per dispatch that carries weights, the weights tensor; per such combine, its
/// dispatch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct MoeWeightPairs {
    /// Dispatch label -> the weights it carries.
    pub early: BTreeMap<CommId, HostTensorId>,
    /// Combine label -> the dispatch that carried its weights.
    pub combine_of: BTreeMap<CommId, CommId>,
}

/// Pairs the dispatches and combines of `program` whose weights can travel with the dispatch.
pub(crate) fn pair_moe_weights(program: &HostProgram) -> MoeWeightPairs {
    let mut touched = BTreeSet::new();
    let mut readers: BTreeMap<HostTensorId, usize> = BTreeMap::new();
    program.walk(&mut |inst, _| {
        for (u, t) in inst.kind.operands() {
            if u != TensorUse::Read {
                touched.insert(t);
            }
        }
        if let InstKind::MoeCombine { routing, .. } = &inst.kind {
            *readers.entry(*routing).or_default() += 1;
        }
    });
    let facts = Facts {
        program,
        touched,
        readers,
    };
    let mut out = MoeWeightPairs::default();
    facts.block(&program.body, &mut out);
    out
}

struct Facts<'p> {
    program: &'p HostProgram,
    /// Tensors some instruction writes, allocates, releases, views or makes a view of.
    touched: BTreeSet<HostTensorId>,
    /// Per `routing` tensor, how many combines read it.
    readers: BTreeMap<HostTensorId, usize>,
}

/// A dispatch's operands that its combine must match.
struct Dispatch<'a> {
    id: CommId,
    team: &'a Team,
    x: HostTensorId,
    routing: HostTensorId,
}

impl Facts<'_> {
    fn block(&self, block: &[Inst], out: &mut MoeWeightPairs) {
        for (i, inst) in block.iter().enumerate() {
            match &inst.kind {
                InstKind::ForLoop { body, .. } => self.block(body, out),
                InstKind::MoeDispatch {
                    id,
                    team,
                    x,
                    routing,
                    ..
                } => {
                    let d = Dispatch {
                        id: *id,
                        team,
                        x: *x,
                        routing: *routing,
                    };
                    if let Some((c, w)) = self.combine_after(&d, &block[i + 1..]) {
                        out.early.insert(d.id, w);
                        out.combine_of.insert(c, d.id);
                    }
                }
                _ => {}
            }
        }
    }

    /// The combine of `d` among the instructions after it, with its weights, when they can
    /// travel with `d`.
    fn combine_after(&self, d: &Dispatch<'_>, rest: &[Inst]) -> Option<(CommId, HostTensorId)> {
        if self.readers.get(&d.routing) != Some(&1) {
            return None;
        }
        for inst in rest {
            match &inst.kind {
                InstKind::MoeCombine {
                    id,
                    team,
                    routing,
                    topk_weights,
                    ..
                } if *routing == d.routing => {
                    return (team == d.team && self.constant_input(*topk_weights, d.x))
                        .then_some((*id, *topk_weights));
                }
                // Another MoE step in between (the engine pairs a combine with the last
                // dispatch), or the combine inside a loop: leave the weights where they are.
                InstKind::MoeDispatch { .. }
                | InstKind::MoeCombine { .. }
                | InstKind::ForLoop { .. } => return None,
                _ => {}
            }
        }
        None
    }

    /// Whether `w` is a program input on the mesh of `x` that no instruction touches.
    fn constant_input(&self, w: HostTensorId, x: HostTensorId) -> bool {
        let (Some(wt), Some(xt)) = (self.program.tensors.get(w), self.program.tensors.get(x))
        else {
            return false;
        };
        wt.role == Role::Input && wt.mesh == xt.mesh && !self.touched.contains(&w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(text: &str) -> HostProgram {
        meshflow_ir::parse_host(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    /// The `moe_layer` program's host IR with `between` after the dispatch and `decls` added.
    fn layer(decls: &str, between: &str) -> String {
        format!(
            "host moe_layer {{
  mesh m0 = [0, 1]
  in x: f32[6, 16] on m0
  in topk_idx: i32[6, 2] on m0
  in topk_weights: f32[6, 2] on m0
  {decls}
  tensor expert_x: f32[2, 12, 16] on m0
  tensor expert_counts: i32[2] on m0
  tensor routing: i32[2, 12, 2] on m0
  tensor expert_y: f32[2, 12, 16] on m0
  out y: f32[6, 16] on m0
  allocate expert_x
  allocate expert_counts
  allocate routing
  c0 = moe_dispatch(x, topk_idx -> expert_x, expert_counts, routing, team=slice(m0, DIDx))
  allocate expert_y
  wait c0
  {between}
  gelu(expert_x -> expert_y)
  allocate y
  c1 = moe_combine(expert_y, expert_counts, routing, topk_weights -> y, team=slice(m0, DIDx))
  wait c1
  deallocate expert_x
  deallocate expert_counts
  deallocate routing
  deallocate expert_y
}}
"
        )
    }

    #[test]
    fn an_input_weights_tensor_travels_with_its_dispatch() {
        let h = host(&layer("", ""));
        let p = pair_moe_weights(&h);
        let w = h.tensor_by_name("topk_weights").unwrap();
        assert_eq!(p.early, BTreeMap::from([(CommId(0), w)]));
        assert_eq!(p.combine_of, BTreeMap::from([(CommId(1), CommId(0))]));
    }

    #[test]
    fn weights_written_in_the_program_stay_with_the_combine() {
        // Written after the dispatch.
        let between = "copy(w_raw -> topk_weights)";
        let p = pair_moe_weights(&host(&layer("in w_raw: f32[6, 2] on m0", between)));
        assert_eq!(p, MoeWeightPairs::default());
        // A view of them is made.
        let decls = "tensor w_half: f32[3, 2] on m0";
        let view = "w_half = narrow(topk_weights, axis=0, start=0, length=3)";
        let p = pair_moe_weights(&host(&layer(decls, view)));
        assert_eq!(p, MoeWeightPairs::default());
    }

    #[test]
    fn a_second_moe_step_between_them_keeps_the_weights_late() {
        let between = "allocate expert_x2
  allocate expert_counts2
  allocate routing2
  c2 = moe_dispatch(x, topk_idx -> expert_x2, expert_counts2, routing2, team=slice(m0, DIDx))
  wait c2";
        let decls = "tensor expert_x2: f32[2, 12, 16] on m0
  tensor expert_counts2: i32[2] on m0
  tensor routing2: i32[2, 12, 2] on m0";
        let p = pair_moe_weights(&host(&layer(decls, between)));
        assert_eq!(p, MoeWeightPairs::default());
    }
}
