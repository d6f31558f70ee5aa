//! `decompose_reshardings`: afterwards every resharding expression is a single `set` that one
//! row of the decision table ([`crate::decision`]) lowers, and every other op computes locally.
//!
//! 1. **Partial-sum outputs are rfactored.** An op output holding partial sums (a device split
//!    on a reduction axis, e.g. `y = linear(x, w)` with `y`'s `rK` split on DIDx) that is a
//!    program output becomes `y_partial = linear(x, w)` (the same type and schedule: each
//!    device's partial sum) followed by `y = set(y_partial)`, where `y` keeps its name and
//!    its non-reduction splits and loses the reduction axis. A `set` from a tensor holding
//!    partial sums to one that does not **is** the reduction over the device-parallel axis
//!    (all-reduce, reduce-scatter or reduce); we use it rather than a level-1 `sum` because
//!    the partial tensor's contraction axis is not a value axis a `sum` could name.
//! 2. **Inputs are resharded before ops that need it.** Each input of a compute op (and of
//!    `moe_dispatch`/`moe_combine`) must carry exactly the device splits the op's output
//!    implies through the axis map, on the output's mesh (e.g. an input split on the
//!    contraction axis while the output's reduction axis is not split must be gathered first).
//!    Otherwise a `set` to the needed sharding is inserted before the op; when the input is
//!    itself the unannotated, single-use output of a `set`, that `set` is retargeted instead.
//! 3. **Unary ops reshard after.** For `gelu`, `silu`, `cast` and `sum`, the op runs on the
//!    input's sharding into `<out>_local` and a `set` after it produces the annotated output
//!    (a `sum` over a split axis thus becomes partial sums plus an all-reduce).
//! 4. **Multi-step changes are split.** A `set` whose sharding changes along two parallel
//!    types at once becomes a chain of `set`s changing one type each (partial sums first,
//!    the type that feeds a Stream split last); a mesh change combined with a sharding change
//!    becomes a reshard on the source mesh plus a pure transfer (and a slice on the target
//!    mesh when needed).

use std::collections::BTreeMap;

use meshflow_ir::{MeshId, Op, OpKind, ParallelType, Program, TensorId};

use crate::analysis::local_sharding;
use crate::analysis::op_rules::{
    dropped_splits, requirements_for, same_mesh, satisfies, Requirement,
};
use crate::analysis::{describe, AxisSplit, Sharding, Spec, StreamSpec};
use crate::decision::{decide, placements, Decision, Placement};
use crate::edit::{add_tensor, decl, insert_set, spec_from_placements, value_type};
use crate::error::PassError;
use crate::manager::{PassContext, ProgramPass};

/// The pass.
pub struct DecomposeReshardings;

impl ProgramPass for DecomposeReshardings {
    fn name(&self) -> &'static str {
        "decompose_reshardings"
    }

    fn run(&self, program: &mut Program, cx: &mut PassContext) -> Result<(), PassError> {
        for op in program.ops.iter().filter(|op| op.kind == OpKind::Set) {
            if let (Some(&p), Some(&c)) = (op.inputs.first(), op.outputs.first()) {
                check_partial_target(program, p, c)?;
            }
        }
        rfactor_outputs(program)?;
        materialize_broadcasts(program)?;
        satisfy_requirements(program, cx)?;
        split_sets(program)
    }
}

fn mesh_of(program: &Program, m: MeshId) -> Result<&meshflow_ir::DeviceMesh, PassError> {
    program
        .meshes
        .get(m)
        .map(|d| &d.mesh)
        .ok_or_else(|| PassError::internal("decompose_reshardings", format!("unknown mesh {m:?}")))
}

/// The spec of a tensor with its splits re-indexed onto value axes (partial splits dropped).
fn value_spec(sh: &Sharding) -> Spec {
    let mut spec = Spec::default();
    for (pt, p) in placements(sh) {
        if let Placement::Split { axis, parts } = p {
            spec.device.insert(pt, AxisSplit { axis, parts });
        }
    }
    spec.stream = sh
        .stream()
        .and_then(|s| sh.value_index(s.axis).map(|axis| StreamSpec { axis, ..s }));
    spec
}

fn rfactor_outputs(program: &mut Program) -> Result<(), PassError> {
    for out in program.outputs.clone() {
        let sh = Sharding::of(program, out)?;
        if sh.partial_types().is_empty() {
            continue;
        }
        let d = decl(program, out)?.clone();
        let Some(def) = program.definition(out) else {
            return Err(PassError::tensor(
                &d.name,
                format!(
                    "the program input {} holds partial results and is also a program output; \
                     an output is returned reduced: add `y = set({})` and output `y`",
                    describe(program, out),
                    d.name
                ),
            ));
        };
        let mut partial = d.clone();
        partial.name = program.fresh_tensor_name(&format!("{}_partial", d.name));
        partial.is_input = false;
        let p = program.tensors.push(partial);
        for o in &mut program.ops[def].outputs {
            if *o == out {
                *o = p;
            }
        }
        let spec = value_spec(&sh);
        let t = &mut program.tensors[out];
        t.ty = value_type(&d.ty);
        t.schedule = Some(spec.to_transforms());
        insert_set(program, def + 1, p, out);
    }
    Ok(())
}

fn requirements(program: &Program, index: usize) -> Result<Vec<Option<Requirement>>, PassError> {
    let op = &program.ops[index];
    let mut reqs = vec![None; op.inputs.len()];
    let value_axis = |t: TensorId, v: usize| -> Option<usize> {
        program.tensors.get(t).and_then(|d| {
            d.ty.axes
                .iter()
                .enumerate()
                .filter(|(_, a)| !a.reduction)
                .nth(v)
                .map(|(i, _)| i)
        })
    };
    match op.kind {
        OpKind::Set => {}
        OpKind::MoeDispatch | OpKind::MoeCombine => {
            // The expert-parallel type is the one splitting the expert axis of expert_x /
            // expert_y; token tensors must be split on their token axis by it.
            let (experts, token_inputs, expert_inputs): (TensorId, &[usize], &[usize]) =
                if op.kind == OpKind::MoeDispatch {
                    (op.outputs[0], &[0, 1], &[])
                } else {
                    (op.inputs[0], &[3], &[0, 1, 2])
                };
            let esh = Sharding::of(program, experts)?;
            let nb = esh.value_axes.len().saturating_sub(3);
            let Some((pt, parts)) = placements(&esh).into_iter().find_map(|(pt, p)| match p {
                Placement::Split { axis, parts } if axis == nb => Some((pt, parts)),
                _ => None,
            }) else {
                return Ok(reqs);
            };
            let mesh = decl(program, experts)?.mesh;
            for &j in token_inputs {
                let Some(&t) = op.inputs.get(j) else { continue };
                if let Some(axis) = value_axis(t, nb) {
                    let mut device = BTreeMap::new();
                    device.insert(pt, AxisSplit { axis, parts });
                    reqs[j] = Some(Requirement { mesh, device });
                }
            }
            for &j in expert_inputs {
                let Some(&t) = op.inputs.get(j) else { continue };
                if let Some(axis) = value_axis(t, nb) {
                    let mut device = BTreeMap::new();
                    device.insert(pt, AxisSplit { axis, parts });
                    reqs[j] = Some(Requirement { mesh, device });
                }
            }
        }
        _ => {
            let Some(&out) = op.outputs.first() else {
                return Ok(reqs);
            };
            let osh = Sharding::of(program, out)?;
            let mesh = decl(program, out)?.mesh;
            reqs = requirements_for(program, op, mesh, &osh.spec);
        }
    }
    Ok(reqs)
}

fn satisfy_requirements(program: &mut Program, cx: &PassContext) -> Result<(), PassError> {
    let mut i = 0;
    while i < program.ops.len() {
        let kind = program.ops[i].kind.clone();
        if kind == OpKind::Set {
            i += 1;
            continue;
        }
        let after = if matches!(kind, OpKind::MoeDispatch | OpKind::MoeCombine) {
            false
        } else {
            place_op(program, i)?
        };
        let reqs = requirements(program, i)?;
        for (j, req) in reqs.iter().enumerate() {
            let Some(req) = req else { continue };
            let Some(&x) = program.ops[i].inputs.get(j) else {
                continue;
            };
            if satisfies(program, x, req)? {
                continue;
            }
            i += reshard_before(program, cx, i, j, req)?;
        }
        i += 1 + usize::from(after);
    }
    Ok(())
}

/// Decides where op `i` computes ([`local_sharding::choose`]). When that is not its output's
/// placement, the op writes `<out>_local` there and a `set` after it produces the output;
/// returns true in that case. A `view` whose input split cannot carry over is refused.
fn place_op(program: &mut Program, i: usize) -> Result<bool, PassError> {
    let op: Op = program.ops[i].clone();
    if op.kind == OpKind::View {
        refuse_communicating_view(program, &op)?;
    }
    let Some(choice) = local_sharding::choose(program, i)? else {
        return Ok(false);
    };
    let Some(&o) = op.outputs.first() else {
        return Ok(false);
    };
    let os = Sharding::of(program, o)?;
    let od = decl(program, o)?.clone();
    let tmp = add_tensor(
        program,
        &format!("{}_local", od.name),
        choice.partial.clone().unwrap_or_else(|| od.ty.clone()),
        choice.mesh,
        &choice.spec,
    );
    program.ops[i].outputs[0] = tmp;
    let new_spec = value_spec(&os);
    let t = &mut program.tensors[o];
    t.ty = value_type(&od.ty);
    t.schedule = Some(new_spec.to_transforms());
    insert_set(program, i + 1, tmp, o);
    Ok(true)
}

/// A `view` stays local (torch `view`): an input split that does not carry over to the output
/// is an error naming the tensors, their placements and the split.
fn refuse_communicating_view(program: &Program, op: &Op) -> Result<(), PassError> {
    let (Some(&x), Some(&y)) = (op.inputs.first(), op.outputs.first()) else {
        return Ok(());
    };
    let xs = Sharding::of(program, x)?;
    let dropped: Vec<_> = dropped_splits(program, op, 0)?
        .into_iter()
        .filter(|(pt, _, _)| !xs.is_partial_on(*pt))
        .collect();
    let Some(&(pt, axis, parts)) = dropped.first() else {
        return Ok(());
    };
    let v = xs.value_index(axis).unwrap_or(axis);
    let out_shape = decl(program, y)?.ty.value_shape();
    Err(PassError::tensor(
        &decl(program, x)?.name,
        format!(
            "`{} = view(...)` of {}: its {pt} split of axis {v} into {parts} parts has no \
             equal split on the output shape {out_shape:?} (a split must be on the first axis \
             of its reshape group, and that output axis must divide into {parts}); a view \
             never communicates, so use `reshape` to replicate {pt} first",
            decl(program, y)?.name,
            describe(program, x),
        ),
    ))
}

/// Inserts an `expand` before every `matmul` operand whose batch axes are broadcast (torch
/// semantics), so the local GEMM sees equal batch axes; a 2-D right operand stays shared.
/// The expanded operand is placed as the matmul's output requires it.
fn materialize_broadcasts(program: &mut Program) -> Result<(), PassError> {
    let mut i = 0;
    while i < program.ops.len() {
        if program.ops[i].kind != OpKind::Matmul {
            i += 1;
            continue;
        }
        let op = program.ops[i].clone();
        let (Some(&out), [a, b]) = (op.outputs.first(), op.inputs.as_slice()) else {
            i += 1;
            continue;
        };
        let so = decl(program, out)?.ty.value_shape();
        let nb = so.len().saturating_sub(2);
        for (j, &x) in [(0usize, a), (1, b)] {
            let xd = decl(program, x)?.clone();
            let sx = xd.ty.value_shape();
            if sx.len() < 2 || (j == 1 && sx.len() == 2) || sx[..sx.len() - 2] == so[..nb] {
                continue;
            }
            let mut shape = so[..nb].to_vec();
            shape.extend_from_slice(&sx[sx.len() - 2..]);
            let ty = meshflow_ir::TensorType::new(xd.ty.dtype, &shape);
            let out_mesh = decl(program, out)?.mesh;
            let e = add_tensor(
                program,
                &format!("{}_expanded", xd.name),
                ty.clone(),
                out_mesh,
                &Spec::default(),
            );
            program.ops.insert(
                i,
                Op {
                    kind: OpKind::Expand,
                    inputs: vec![x],
                    outputs: vec![e],
                    loc: op.loc,
                },
            );
            i += 1;
            program.ops[i].inputs[j] = e;
            // Place the expanded operand where the matmul's output needs it.
            let osh = Sharding::of(program, out)?;
            let req = requirements_for(program, &program.ops[i], out_mesh, &osh.spec)
                .into_iter()
                .nth(j)
                .flatten();
            let mut spec = Spec::default();
            if let Some(req) = req {
                spec.device = req.device;
            }
            if spec.fits(&ty, mesh_of(program, out_mesh)?) {
                program.tensors[e].schedule = Some(spec.to_transforms());
            }
        }
        i += 1;
    }
    Ok(())
}

/// Makes input `j` of op `i` satisfy `req`; returns the number of ops inserted before `i`.
fn reshard_before(
    program: &mut Program,
    cx: &PassContext,
    i: usize,
    j: usize,
    req: &Requirement,
) -> Result<usize, PassError> {
    let x = program.ops[i].inputs[j];
    let xs = Sharding::of(program, x)?;
    let xd = decl(program, x)?.clone();
    let mut spec = Spec::default();
    for (&pt, s) in &req.device {
        let axis = xs.value_index(s.axis).ok_or_else(|| {
            PassError::internal("decompose_reshardings", "a requirement on a reduction axis")
        })?;
        spec.device.insert(pt, AxisSplit { axis, ..*s });
    }
    let ty = value_type(&xd.ty);
    if !spec.fits(&ty, mesh_of(program, req.mesh)?) {
        return Err(PassError::op(
            program,
            i,
            format!(
                "input {} would need the splits {} on mesh `{}`, which its shape {:?} does not \
                 divide into or the mesh does not have",
                describe(program, x),
                spec.device
                    .iter()
                    .map(|(pt, s)| format!("{pt} on axis {} into {}", s.axis, s.parts))
                    .collect::<Vec<_>>()
                    .join(", "),
                program
                    .meshes
                    .get(req.mesh)
                    .map_or("?", |m| m.name.as_str()),
                ty.value_shape()
            ),
        ));
    }
    let retarget = program.definition(x).is_some_and(|d| {
        program.ops[d].kind == OpKind::Set
            && !cx.is_annotated(&xd.name)
            && !program.outputs.contains(&x)
            && program.uses(x).len() == 1
            && xd.ty.axes.iter().all(|a| !a.reduction)
    });
    if retarget {
        let t = &mut program.tensors[x];
        t.mesh = req.mesh;
        t.schedule = Some(spec.to_transforms());
        return Ok(0);
    }
    let have = value_spec(&xs).device;
    let suffix = if !xs.partial_types().is_empty() {
        "reduced"
    } else if spec.device.iter().all(|(pt, s)| have.get(pt) == Some(s)) {
        "gathered"
    } else {
        "resharded"
    };
    let new = add_tensor(
        program,
        &format!("{}_{suffix}", xd.name),
        ty,
        req.mesh,
        &spec,
    );
    insert_set(program, i, x, new);
    program.ops[i + 1].inputs[j] = new;
    Ok(1)
}

fn split_sets(program: &mut Program) -> Result<(), PassError> {
    let mut i = 0;
    while i < program.ops.len() {
        if program.ops[i].kind != OpKind::Set {
            i += 1;
            continue;
        }
        let (p, c) = (program.ops[i].inputs[0], program.ops[i].outputs[0]);
        check_partial_target(program, p, c)?;
        let steps = plan_steps(program, p, c).map_err(|why| PassError::op(program, i, why))?;
        let cd = decl(program, c)?.clone();
        let mut prev = p;
        for (mesh, spec) in steps {
            let t = add_tensor(
                program,
                &format!("{}_step", cd.name),
                value_type(&cd.ty),
                mesh,
                &spec,
            );
            insert_set(program, i, prev, t);
            i += 1;
            prev = t;
        }
        program.ops[i].inputs[0] = prev;
        i += 1;
    }
    Ok(())
}

/// A `set` into a target that holds partial results: each partial mesh axis of the target must
/// already be partial in the producer (Partial -> Partial is free, `[P, S0] -> [P, S1]` is one
/// all-to-all on the other axis); Replicate -> Partial is refused, as in DTensor, and the
/// target must stay on the producer's mesh.
fn check_partial_target(program: &Program, p: TensorId, c: TensorId) -> Result<(), PassError> {
    let ps = Sharding::of(program, p)?;
    let cs = Sharding::of(program, c)?;
    let partial = cs.partial_types();
    if partial.is_empty() {
        return Ok(());
    }
    let name = &decl(program, c)?.name;
    let what = || {
        format!(
            "`{name} = set(...)` from {} to {}",
            describe(program, p),
            describe(program, c)
        )
    };
    if let Some(pt) = partial.iter().find(|&&pt| !ps.is_partial_on(pt)) {
        return Err(PassError::tensor(
            name,
            format!(
                "{}: Replicate -> Partial along {pt} is refused (as in DTensor): a set cannot \
                 create partial results, and the producer holds none along {pt}; produce them \
                 with a reduction (`sum`, `matmul`, ...) or keep the target replicated",
                what()
            ),
        ));
    }
    if !same_mesh(program, ps.mesh, cs.mesh) {
        return Err(PassError::tensor(
            name,
            format!(
                "{}: partial results cannot move to another mesh; reduce them first (declare \
                 the target without reduction axes)",
                what()
            ),
        ));
    }
    let pm = mesh_of(program, ps.mesh)?;
    if let Decision::Unsupported(why) = decide(&ps, pm, &cs, pm) {
        return Err(PassError::tensor(
            name,
            format!(
                "{}: keeping the partial results while changing more than one other mesh axis \
                 is not supported ({why}); reshard one mesh axis per set",
                what()
            ),
        ));
    }
    Ok(())
}

/// Intermediate `(mesh, spec)`s that turn `set(p) -> c` into single-row steps.
fn plan_steps(program: &Program, p: TensorId, c: TensorId) -> Result<Vec<(MeshId, Spec)>, String> {
    let err = |e: PassError| e.to_string();
    let ps = Sharding::of(program, p).map_err(err)?;
    let cs = Sharding::of(program, c).map_err(err)?;
    let pm = mesh_of(program, ps.mesh).map_err(err)?;
    let cm = mesh_of(program, cs.mesh).map_err(err)?;
    if !matches!(decide(&ps, pm, &cs, cm), Decision::Unsupported(_)) {
        return Ok(Vec::new());
    }
    let ty = value_type(&decl(program, c).map_err(err)?.ty);
    let pv = placements(&ps);
    let cv = placements(&cs);
    let stream_axis = cs.stream().and_then(|s| cs.value_index(s.axis));
    if same_mesh(program, ps.mesh, cs.mesh) {
        let steps = same_mesh_steps(&pv, &cv, stream_axis, &ty, pm)?;
        if steps.is_empty() {
            // A single-type change that is still no row of the table.
            if let Decision::Unsupported(why) = decide(&ps, pm, &cs, cm) {
                return Err(why);
            }
        }
        return Ok(steps.into_iter().map(|s| (cs.mesh, s)).collect());
    }
    let no_partial =
        |v: &BTreeMap<ParallelType, Placement>| !v.values().any(|p| *p == Placement::Partial);
    let mut out = Vec::new();
    if pm.shape() == cm.shape() && no_partial(&cv) {
        // Reshard on the source mesh to the target's splits, then one transfer per pair.
        out.extend(
            same_mesh_steps(&pv, &cv, None, &ty, pm)?
                .into_iter()
                .map(|s| (ps.mesh, s)),
        );
        if pv != cv {
            let spec = spec_from_placements(&cv).ok_or("the target holds partial sums")?;
            out.push((ps.mesh, spec));
        }
        return Ok(out);
    }
    // Replicate on the source mesh, broadcast, slice on the target mesh.
    let empty = BTreeMap::new();
    out.extend(
        same_mesh_steps(&pv, &empty, None, &ty, pm)?
            .into_iter()
            .map(|s| (ps.mesh, s)),
    );
    if !pv.is_empty() {
        out.push((ps.mesh, Spec::default()));
    }
    if !cv.is_empty() {
        out.push((cs.mesh, Spec::default()));
    }
    out.extend(
        same_mesh_steps(&empty, &cv, stream_axis, &ty, cm)?
            .into_iter()
            .map(|s| (cs.mesh, s)),
    );
    Ok(out)
}

/// Intermediate specs (endpoints excluded) changing one parallel type per step.
fn same_mesh_steps(
    from: &BTreeMap<ParallelType, Placement>,
    to: &BTreeMap<ParallelType, Placement>,
    stream_axis: Option<usize>,
    ty: &meshflow_ir::TensorType,
    mesh: &meshflow_ir::DeviceMesh,
) -> Result<Vec<Spec>, String> {
    let mut changed: Vec<ParallelType> = ParallelType::DEVICE
        .into_iter()
        .filter(|pt| from.get(pt) != to.get(pt))
        .collect();
    if changed.len() <= 1 {
        return Ok(Vec::new());
    }
    let key = |pt: &ParallelType| match from.get(pt) {
        Some(Placement::Partial) => 0,
        Some(Placement::Split { axis, .. }) if Some(*axis) == stream_axis => 2,
        _ => 1,
    };
    changed.sort_by_key(|pt| (key(pt), *pt));
    let valid = |cur: &BTreeMap<ParallelType, Placement>| {
        spec_from_placements(cur).filter(|s| s.fits(ty, mesh))
    };
    // Greedy: one type at a time to its target.
    let mut cur = from.clone();
    let mut steps = Vec::new();
    let mut ok = true;
    for pt in &changed[..changed.len() - 1] {
        match to.get(pt) {
            Some(p) => cur.insert(*pt, *p),
            None => cur.remove(pt),
        };
        match valid(&cur) {
            Some(s) => steps.push(s),
            None => {
                ok = false;
                break;
            }
        }
    }
    if ok {
        return Ok(steps);
    }
    // Remove every changed split, then add the targets.
    let mut cur = from.clone();
    let mut steps = Vec::new();
    for pt in changed.iter().filter(|pt| from.contains_key(pt)) {
        cur.remove(pt);
        steps.push(valid(&cur).ok_or_else(|| {
            "the producer holds partial sums along two parallel types at once".to_string()
        })?);
    }
    for pt in changed.iter() {
        if let Some(p) = to.get(pt) {
            cur.insert(*pt, *p);
            if &cur != to {
                steps.push(valid(&cur).ok_or("no valid intermediate sharding")?);
            }
        }
    }
    if cur == *to
        && steps
            .last()
            .is_some_and(|s| Some(s) == spec_from_placements(to).as_ref())
    {
        steps.pop();
    }
    Ok(steps)
}

/// Why op `index` cannot compute locally, if it cannot: an input whose sharding differs from
/// what the op's output implies, or an output split the op cannot compute on chunks (the
/// lowering reports this as an error).
pub(crate) fn local_mismatch(program: &Program, index: usize) -> Result<Option<String>, PassError> {
    let op = &program.ops[index];
    if !matches!(
        op.kind,
        OpKind::MoeDispatch | OpKind::MoeCombine | OpKind::Set
    ) {
        if let Some(&out) = op.outputs.first() {
            let os = Sharding::of(program, out)?;
            let map = crate::analysis::op_axis_map(program, op);
            let stream = os.stream().map(|s| (ParallelType::Stream, s.axis));
            let splits = os.spec.device.iter().map(|(&pt, s)| (pt, s.axis));
            for (pt, axis) in splits.chain(stream) {
                if !crate::analysis::local_split_ok(program, op, &map, axis) {
                    return Ok(Some(format!(
                        "its output {} is split along {pt} on axis {axis}, which `{}` cannot \
                         compute chunk by chunk (decompose_reshardings computes it unsplit and \
                         reshards after)",
                        describe(program, out),
                        op.kind.name()
                    )));
                }
            }
        }
    }
    let reqs = requirements(program, index)?;
    for (j, req) in reqs.iter().enumerate() {
        let (Some(req), Some(&t)) = (req, program.ops[index].inputs.get(j)) else {
            continue;
        };
        if !satisfies(program, t, req)? {
            return Ok(Some(format!(
                "input {} is sharded differently from what the op computes locally \
                 (decompose_reshardings inserts the resharding `set`)",
                describe(program, t)
            )));
        }
    }
    Ok(None)
}
