//! Where an op computes: on its output's placement (the inputs are resharded before it) or on
//! one of its inputs' placements (the output is resharded after it), whichever moves less data.
//!
//! The candidates are the output's own placement, minus the splits the op cannot compute
//! locally ([`local_split_ok`]), and the placement each input implies for the output
//! ([`forward_spec`]). A candidate costs the elements of every input it must move (slicing a
//! replicated input is free) plus, when it is not the output's placement, the elements of the
//! output (one resharding after the op).
//! So `z = add(x, y)` with `x` and `y` split alike and `z` replicated computes the add on the
//! shards and gathers `z` once instead of gathering `x` and `y`; an `expand` of a split input
//! to a replicated output gathers the (smaller) input first; a `sum` over a split axis sums
//! locally and reduces the partial sums after; a compute op whose inputs live on another mesh
//! gets them moved to its mesh (nvFuser's resharding insertion). Ties go to the output's
//! placement for ops with several inputs and to the input's for unary ops, as in nvFuser
//! (multi-input expressions reshard before, unary ones after).
//!
//! A `view` never reshards its input: it computes where its input is (a split that does not
//! carry over is refused by the caller), and an output placed differently is resharded after.
//! An output that holds partial results (and is no program output) is computed in place.

use meshflow_ir::{MeshId, OpKind, Program};

use crate::analysis::op_rules::{
    forward_spec, local_split_ok, requirements_for, same_mesh, value_numel, Requirement,
};
use crate::analysis::{op_axis_map, Sharding, Spec};
use crate::edit::value_type;
use crate::error::PassError;

/// A placement for an op's output other than the output's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalSharding {
    /// The mesh the op computes on.
    pub mesh: MeshId,
    /// The output's spec while computing.
    pub spec: Spec,
}

/// Where op `index` computes (see the module docs): `None` for the output's own placement.
pub fn choose(program: &Program, index: usize) -> Result<Option<LocalSharding>, PassError> {
    let op = &program.ops[index];
    let Some(&out) = op.outputs.first() else {
        return Ok(None);
    };
    if op.outputs.len() != 1 || matches!(op.kind, OpKind::Custom(_)) {
        return Ok(None);
    }
    let os = Sharding::of(program, out)?;
    let out_mesh = program
        .tensors
        .get(out)
        .map(|d| d.mesh)
        .ok_or_else(|| PassError::internal("local_sharding", "unknown output"))?;
    let map = op_axis_map(program, op);
    let mut own = os.spec.clone();
    own.device
        .retain(|_, s| local_split_ok(program, op, &map, s.axis));
    if own
        .stream
        .is_some_and(|st| !local_split_ok(program, op, &map, st.axis))
    {
        own.stream = None;
    }
    let out_partial = !os.partial_types().is_empty();
    let unary = op.inputs.len() == 1;
    // (mesh, spec, preference: lower wins ties)
    let mut cands: Vec<(MeshId, Spec, u8)> = Vec::new();
    if op.kind != OpKind::View {
        cands.push((out_mesh, own, if unary { 1 } else { 0 }));
    }
    if !out_partial || op.kind == OpKind::View {
        for j in 0..op.inputs.len() {
            if let Some((m, spec)) = forward_spec(program, op, j)? {
                cands.push((m, spec, if unary { 0 } else { 1 }));
            }
        }
    }
    let mut best: Option<(u64, u8, MeshId, Spec)> = None;
    for (mesh, spec, pref) in cands {
        let moved_out = !(same_mesh(program, mesh, out_mesh) && spec == os.spec);
        if moved_out && out_partial && op.kind != OpKind::View {
            continue;
        }
        let Some(m) = program.meshes.get(mesh).map(|d| &d.mesh) else {
            continue;
        };
        let mut cost = if moved_out {
            value_numel(program, out)
        } else {
            0
        };
        let mut valid = true;
        for (j, req) in requirements_for(program, op, mesh, &spec)
            .into_iter()
            .enumerate()
        {
            let (Some(req), Some(&x)) = (req, op.inputs.get(j)) else {
                continue;
            };
            let xs = Sharding::of(program, x)?;
            let mut xspec = Spec::default();
            for (&pt, s) in &req.device {
                match xs.value_index(s.axis) {
                    Some(axis) => {
                        xspec
                            .device
                            .insert(pt, crate::analysis::AxisSplit { axis, ..*s });
                    }
                    None => valid = false,
                }
            }
            let ty = program.tensors.get(x).map(|d| value_type(&d.ty));
            if !ty.is_some_and(|ty| xspec.fits(&ty, m)) {
                valid = false;
            }
            if moves_data(program, &xs, &req) {
                cost = cost.saturating_add(value_numel(program, x));
            }
        }
        if !valid {
            continue;
        }
        let better = best
            .as_ref()
            .is_none_or(|(c, p, _, _)| (cost, pref) < (*c, *p));
        if better {
            best = Some((cost, pref, mesh, spec));
        }
    }
    Ok(match best {
        Some((_, _, mesh, spec)) if !(same_mesh(program, mesh, out_mesh) && spec == os.spec) => {
            Some(LocalSharding { mesh, spec })
        }
        _ => None,
    })
}

/// True when giving `xs` what `req` asks for moves data: another mesh, or a split (or partial
/// result) along some parallel type that changes. Slicing a replicated input is free.
fn moves_data(program: &Program, xs: &Sharding, req: &Requirement) -> bool {
    if !same_mesh(program, xs.mesh, req.mesh) {
        return true;
    }
    xs.spec
        .device
        .iter()
        .any(|(pt, have)| req.device.get(pt) != Some(have))
}
