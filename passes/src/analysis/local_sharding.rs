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
//!
//! Partial sums stay partial through `add`/`sub` of two partial-sum inputs held alike and
//! through `mul` by an input without partial results, when that is cheaper: the op computes on
//! the partial sums and its result is reduced once (one all-reduce instead of two).
//! An output that holds partial results (and is no program output) is computed in place.

use meshflow_ir::host::ReduceOp;
use meshflow_ir::{MeshId, OpKind, Program, TensorType};

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
    /// The type of the op's result when it keeps partial sums (the partial input's type,
    /// reduction axes included); `None` for the output's own type.
    pub partial: Option<TensorType>,
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
    // A strided output is computed on its plain chains and resharded after (a compute op
    // reads and writes plain chains only).
    let mut own = os.spec.without_strided();
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
            let even = |ty: &meshflow_ir::TensorType| {
                xspec.divides(ty) || super::op_rules::keeps_uneven(&op.kind)
            };
            if !ty.is_some_and(|ty| xspec.fits(&ty, m) && even(&ty)) {
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
    if !out_partial {
        if let Some((cost, keep)) = keep_partial_sums(program, index)? {
            if best.as_ref().is_none_or(|(c, _, _, _)| cost < *c) {
                return Ok(Some(keep));
            }
        }
    }
    Ok(match best {
        Some((_, _, mesh, spec)) if !(same_mesh(program, mesh, out_mesh) && spec == os.spec) => {
            Some(LocalSharding {
                mesh,
                spec,
                partial: None,
            })
        }
        _ => None,
    })
}

/// The candidate that keeps partial sums through `add`/`sub` of two partial-sum inputs held
/// alike, or through `mul` of a partial-sum input by an input without partial results: the op
/// runs on the partial inputs' placement and its result is reduced once, after it (DTensor's
/// `P + P -> P` and `P * R -> P`). Returns its cost and the placement.
fn keep_partial_sums(
    program: &Program,
    index: usize,
) -> Result<Option<(u64, LocalSharding)>, PassError> {
    let op = &program.ops[index];
    let (Some(&out), [a, b]) = (op.outputs.first(), op.inputs.as_slice()) else {
        return Ok(None);
    };
    if !matches!(op.kind, OpKind::Add | OpKind::Sub | OpKind::Mul) {
        return Ok(None);
    }
    let (sa, sb) = (Sharding::of(program, *a)?, Sharding::of(program, *b)?);
    let ty = |t| program.tensors.get(t).map(|d| d.ty.clone());
    let sums = |t, sh: &Sharding| {
        !sh.partial_types().is_empty() && crate::analysis::partial_kind(program, t) == ReduceOp::Sum
    };
    let (pa, pb) = (sums(*a, &sa), sums(*b, &sb));
    let (partial, partial_sh, other, other_sh) = match op.kind {
        OpKind::Add | OpKind::Sub if pa && pb => {
            let alike = same_mesh(program, sa.mesh, sb.mesh)
                && sa.spec.device == sb.spec.device
                && ty(*a).map(|t| t.axes) == ty(*b).map(|t| t.axes);
            if !alike {
                return Ok(None);
            }
            (*a, &sa, *b, &sb)
        }
        OpKind::Mul if pa && sb.partial_types().is_empty() => (*a, &sa, *b, &sb),
        OpKind::Mul if pb && sa.partial_types().is_empty() => (*b, &sb, *a, &sa),
        _ => return Ok(None),
    };
    let Some(pty) = ty(partial) else {
        return Ok(None);
    };
    // For `mul`, the other input must hold the partial input's value splits on its mesh.
    let value_splits = |sh: &Sharding| {
        sh.spec
            .device
            .iter()
            .filter_map(|(&pt, s)| Some((pt, (sh.value_index(s.axis)?, s.parts))))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let other_moves = op.kind == OpKind::Mul
        && (!same_mesh(program, other_sh.mesh, partial_sh.mesh)
            || value_splits(other_sh) != value_splits(partial_sh));
    let mut cost = value_numel(program, out);
    if other_moves {
        cost = cost.saturating_add(value_numel(program, other));
    }
    let mut spec = partial_sh.spec.clone();
    spec.stream = None;
    Ok(Some((
        cost,
        LocalSharding {
            mesh: partial_sh.mesh,
            spec,
            partial: Some(TensorType {
                dtype: pty.dtype,
                axes: pty.axes,
            }),
        },
    )))
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
