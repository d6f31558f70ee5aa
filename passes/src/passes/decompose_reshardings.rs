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
//! 4. **Multi-step changes are split.** A `set` that no single row of the decision table
//!    covers becomes a chain of `set`s, each changing one parallel type, planned by
//!    [`crate::redistribute::plan`] (DTensor's redistribute planner over chains of splits:
//!    fewest communications, then fewest elements moved; `[S0, S0] -> [S0, R]` is one
//!    all-gather over the inner mesh axis). Intermediate tensors may hold partial sums (on one
//!    extra reduction axis). A mesh change becomes a reshard on the source mesh plus a pure
//!    transfer (per device pair for equal shapes, else a broadcast of the replicated value and
//!    a slice on the target mesh). A consumer cut by a Stream split gets its device placement
//!    first when the last step could not fill its chunks one by one. Every step is checked
//!    against the decision table; a refusal names both tensors, their placements and the
//!    reason.

use std::collections::BTreeMap;

use meshflow_ir::{MeshId, Op, OpKind, ParallelType, Program, TensorId};

use crate::analysis::local_sharding;
use crate::analysis::op_rules::{
    dropped_splits, requirements_for, same_mesh, satisfies, Requirement,
};
use crate::analysis::{describe, AxisSplit, Sharding, Spec, StreamSpec};
use crate::decision::{decide, placements, Decision, Placement};
use crate::edit::{add_tensor, decl, insert_set, value_type};
use crate::error::PassError;
use crate::manager::{PassContext, ProgramPass};
use crate::redistribute::{materialize, normalized, placements_of, plan, Placements};

/// The pass.
pub struct DecomposeReshardings;

impl ProgramPass for DecomposeReshardings {
    fn name(&self) -> &'static str {
        "decompose_reshardings"
    }

    fn run(&self, program: &mut Program, cx: &mut PassContext) -> Result<(), PassError> {
        refuse_strided(program)?;
        for op in program.ops.iter().filter(|op| op.kind == OpKind::Set) {
            if let (Some(&p), Some(&c)) = (op.inputs.first(), op.outputs.first()) {
                check_partial_target(program, p, c)?;
            }
        }
        rfactor_outputs(program)?;
        materialize_broadcasts(program)?;
        satisfy_requirements(program, cx)?;
        split_sets(program, cx.options.merge_collectives)
    }
}

/// Strided layouts (a device split inside a serial piece of its axis) are lowered with even
/// splits and without Stream splits only: others are refused here, naming the tensor.
fn refuse_strided(program: &Program) -> Result<(), PassError> {
    for (t, d) in program.tensors.iter() {
        let sh = Sharding::of(program, t)?;
        let ragged = |axis: usize| sh.layout.axes.get(axis).is_some_and(|a| a.ragged);
        let serials = || sh.spec.serial.iter().filter(|s| s.parts > 1);
        let (serial, missing) = if let Some(s) = serials().find(|s| ragged(s.axis)) {
            (
                s,
                "a strided axis is lowered only when every split divides it",
            )
        } else if let Some(s) = serials().next().filter(|_| sh.stream().is_some()) {
            (s, "a strided tensor cannot also be cut by a Stream split")
        } else {
            continue;
        };
        let mut inner: Vec<(usize, &str)> = sh
            .spec
            .device
            .iter()
            .filter(|(_, s)| s.axis == serial.axis && s.depth > serial.depth)
            .map(|(pt, s)| (s.depth, pt.name()))
            .collect();
        inner.sort_unstable();
        let names: Vec<&str> = inner.iter().map(|&(_, n)| n).collect();
        let (splits, lie) = if names.len() > 1 {
            ("splits", "lie")
        } else {
            ("split", "lies")
        };
        return Err(PassError::tensor(
            &d.name,
            format!(
                "the {} {splits} of logical axis {} {lie} inside a serial piece of extent {} (an \
                 inner split, or a `_StridedShard`; placements {}): {missing}",
                names.join(", "),
                serial.axis,
                serial.parts,
                placements_of(&sh).describe()
            ),
        ));
    }
    Ok(())
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
        if let Placement::Split { axis, parts, depth } = p {
            spec.device.insert(pt, AxisSplit { axis, parts, depth });
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
        OpKind::MoeDispatch { .. } | OpKind::MoeCombine => {
            // The expert-parallel type is the one splitting the expert axis of expert_x /
            // expert_y; token tensors must be split on their token axis by it.
            let (experts, token_inputs, expert_inputs): (TensorId, &[usize], &[usize]) =
                if matches!(op.kind, OpKind::MoeDispatch { .. }) {
                    (op.outputs[0], &[0, 1], &[])
                } else {
                    (op.inputs[0], &[3], &[0, 1, 2])
                };
            let esh = Sharding::of(program, experts)?;
            let nb = esh.value_axes.len().saturating_sub(3);
            let Some((pt, parts)) = placements(&esh).into_iter().find_map(|(pt, p)| match p {
                Placement::Split { axis, parts, .. } if axis == nb => Some((pt, parts)),
                _ => None,
            }) else {
                return Ok(reqs);
            };
            let mesh = decl(program, experts)?.mesh;
            for &j in token_inputs {
                let Some(&t) = op.inputs.get(j) else { continue };
                if let Some(axis) = value_axis(t, nb) {
                    let mut device = BTreeMap::new();
                    device.insert(pt, AxisSplit::outer(axis, parts));
                    reqs[j] = Some(Requirement { mesh, device });
                }
            }
            for &j in expert_inputs {
                let Some(&t) = op.inputs.get(j) else { continue };
                if let Some(axis) = value_axis(t, nb) {
                    let mut device = BTreeMap::new();
                    device.insert(pt, AxisSplit::outer(axis, parts));
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
        let after = if matches!(kind, OpKind::MoeDispatch { .. } | OpKind::MoeCombine) {
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
            let mesh = mesh_of(program, out_mesh)?;
            if spec.fits(&ty, mesh) && spec.divides(&ty) {
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

fn split_sets(program: &mut Program, merge: bool) -> Result<(), PassError> {
    let mut i = 0;
    while i < program.ops.len() {
        if program.ops[i].kind != OpKind::Set {
            i += 1;
            continue;
        }
        let (p, c) = (program.ops[i].inputs[0], program.ops[i].outputs[0]);
        check_partial_target(program, p, c)?;
        let steps =
            plan_steps(program, p, c, merge).map_err(|why| PassError::op(program, i, why))?;
        let cd = decl(program, c)?.clone();
        let mut prev = p;
        for (mesh, ty, spec) in steps {
            let t = add_tensor(program, &format!("{}_step", cd.name), ty, mesh, &spec);
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
/// all-to-all on the other axis, longer changes are planned like any other); Replicate ->
/// Partial is refused, as in DTensor, and the target must stay on the producer's mesh.
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
    Ok(())
}

/// A `Sharding` of the would-be tensor `(ty, spec)` on `mesh` (for the decision table).
fn sharding_of(ty: &meshflow_ir::TensorType, mesh: MeshId, spec: &Spec) -> Option<Sharding> {
    Sharding::from_parts("step", ty, mesh, &spec.to_transforms()).ok()
}

/// The placements from `from` to `to` on one mesh, one parallel type per step (both ends
/// excluded), or why there are none.
fn mesh_path(
    from: &Placements,
    to: &Placements,
    pty: &meshflow_ir::TensorType,
    ps: &Sharding,
    mesh: &meshflow_ir::DeviceMesh,
    merge: bool,
) -> Result<Vec<Placements>, String> {
    let vty = &value_type(pty);
    let sizes: BTreeMap<ParallelType, u64> = ParallelType::DEVICE
        .into_iter()
        .filter_map(|pt| Some((pt, mesh.size_of(pt)? as u64)))
        .filter(|&(_, n)| n > 1)
        .collect();
    let extents = vty.value_shape();
    // A team of one device never communicates: its splits and partial sums change nothing.
    let strip = |pl: &Placements| Placements {
        chains: pl
            .chains
            .iter()
            .map(|c| {
                normalized(
                    c.iter()
                        .copied()
                        .filter(|cut| cut.device().is_none_or(|pt| sizes.contains_key(&pt)))
                        .collect(),
                )
            })
            .collect(),
        partial: pl
            .partial
            .iter()
            .copied()
            .filter(|pt| sizes.contains_key(pt))
            .collect(),
    };
    let (from, to) = (&strip(from), &strip(to));
    let fits = |pl: &Placements| {
        let (ty, spec) = materialize(pl, pty, ps, mesh);
        spec.fits(&ty, mesh)
    };
    plan(from, to, &extents, &sizes, &fits, merge).ok_or_else(|| {
        let missing: Vec<&str> = to
            .partial
            .difference(&from.partial)
            .map(|p| p.name())
            .collect();
        if missing.is_empty() {
            format!(
                "no sequence of single-parallel-type steps from {} to {} fits the shape {:?} \
                 on mesh {mesh}",
                from.describe(),
                to.describe(),
                extents
            )
        } else {
            format!(
                "the target holds partial sums along {} and the source does not: nothing \
                 creates partial sums (Replicate -> Partial is refused, as in DTensor)",
                missing.join(", "),
            )
        }
    })
}

/// Intermediate `(mesh, type, spec)`s that turn `set(p) -> c` into single-row steps.
#[allow(clippy::type_complexity)]
fn plan_steps(
    program: &Program,
    p: TensorId,
    c: TensorId,
    merge: bool,
) -> Result<Vec<(MeshId, meshflow_ir::TensorType, Spec)>, String> {
    let err = |e: PassError| e.to_string();
    let ps = Sharding::of(program, p).map_err(err)?;
    let cs = Sharding::of(program, c).map_err(err)?;
    let pm = mesh_of(program, ps.mesh).map_err(err)?;
    let cm = mesh_of(program, cs.mesh).map_err(err)?;
    let (pd, cd) = (
        decl(program, p).map_err(err)?,
        decl(program, c).map_err(err)?,
    );
    let direct = decide(&ps, pm, &cs, cm);
    let merged = matches!(
        direct,
        Decision::MergedAllGather { .. }
            | Decision::MergedAllReduce { .. }
            | Decision::MergedReduceScatter { .. }
    );
    if !matches!(direct, Decision::Unsupported(_))
        && stream_safe(&ps, &cs, &direct)
        && (merge || !merged)
    {
        return Ok(Vec::new());
    }
    let vty = value_type(&cd.ty);
    let (from, to) = (placements_of(&ps), placements_of(&cs));
    let refuse = |why: String| {
        format!(
            "cannot reshard `{}` ({} on mesh {}) into `{}` ({} on mesh {}): {why}",
            pd.name,
            from.describe(),
            pm,
            cd.name,
            to.describe(),
            cm
        )
    };
    let mut steps: Vec<(MeshId, Placements)> = Vec::new();
    if same_mesh(program, ps.mesh, cs.mesh) {
        steps.extend(
            mesh_path(&from, &to, &pd.ty, &ps, pm, merge)
                .map_err(&refuse)?
                .into_iter()
                .map(|s| (cs.mesh, s)),
        );
    } else if !to.partial.is_empty() {
        return Err(refuse(
            "a target on another mesh cannot hold partial sums (reduce first)".into(),
        ));
    } else if pm.shape() == cm.shape() {
        // Reshard on the source mesh to the target's splits, then one transfer per pair.
        steps.extend(
            mesh_path(&from, &to, &pd.ty, &ps, pm, merge)
                .map_err(&refuse)?
                .into_iter()
                .map(|s| (ps.mesh, s)),
        );
        if from != to {
            steps.push((ps.mesh, to.clone()));
        }
    } else {
        // Replicate on the source mesh, broadcast, slice on the target mesh.
        let repl = Placements::replicated(vty.axes.len());
        let replicated_sharding = sharding_of(&vty, cs.mesh, &Spec::default())
            .ok_or_else(|| refuse("the replicated value has no layout".into()))?;
        steps.extend(
            mesh_path(&from, &repl, &pd.ty, &ps, pm, merge)
                .map_err(&refuse)?
                .into_iter()
                .map(|s| (ps.mesh, s)),
        );
        if from != repl {
            steps.push((ps.mesh, repl.clone()));
        }
        if to != repl {
            steps.push((cs.mesh, repl.clone()));
        }
        steps.extend(
            mesh_path(&repl, &to, &vty, &replicated_sharding, cm, merge)
                .map_err(&refuse)?
                .into_iter()
                .map(|s| (cs.mesh, s)),
        );
    }
    let mut out: Vec<(MeshId, meshflow_ir::TensorType, Spec)> = Vec::new();
    for (m, pl) in steps {
        let mesh = mesh_of(program, m).map_err(err)?;
        let (ty, spec) = materialize(&pl, &pd.ty, &ps, mesh);
        out.push((m, ty, spec));
    }
    // The last step reaches the consumer itself; a consumer cut by a Stream split whose
    // chunks the last step cannot fill directly gets its device placement first.
    let last = |out: &[(MeshId, meshflow_ir::TensorType, Spec)]| match out.last() {
        Some((m, ty, spec)) => {
            sharding_of(ty, *m, spec).map(|sh| (sh, mesh_of(program, *m).ok().cloned()))
        }
        None => Some((ps.clone(), Some(pm.clone()))),
    };
    if let (Some(_), Some((sh, Some(m)))) = (cs.stream(), last(&out)) {
        let d = decide(&sh, &m, &cs, cm);
        if matches!(d, Decision::Unsupported(_)) || !stream_safe(&sh, &cs, &d) {
            let spec = cs.spec.without_stream();
            out.push((cs.mesh, cd.ty.clone(), spec));
        }
    }
    // Every step must be one row of the decision table.
    let mut prev = (ps.clone(), pm.clone());
    for (m, ty, spec) in
        out.iter()
            .chain(std::iter::once(&(cs.mesh, cd.ty.clone(), cs.spec.clone())))
    {
        let mesh = mesh_of(program, *m).map_err(err)?;
        let sh = sharding_of(ty, *m, spec)
            .ok_or_else(|| refuse("an intermediate placement has no layout".into()))?;
        if let Decision::Unsupported(why) = decide(&prev.0, &prev.1, &sh, mesh) {
            return Err(refuse(why));
        }
        prev = (sh, mesh.clone());
    }
    Ok(out)
}

/// True when the step `p -> c` (decision `d`) can run chunk by chunk in `c`'s stream loop:
/// a ring or stream broadcast fills the chunks itself; any other communication must leave the
/// chunked axis alone and, for uneven pieces, find `p` cut by the same Stream split (a
/// consumer with no Stream split is always fine).
fn stream_safe(p: &Sharding, c: &Sharding, d: &Decision) -> bool {
    let Some(cst) = c.stream() else {
        return true;
    };
    let Some(a) = c.value_index(cst.axis) else {
        return true;
    };
    let touched = match *d {
        Decision::Ring { .. } | Decision::StreamBroadcast { .. } => return true,
        Decision::LocalCopy => false,
        Decision::AllGather { axis, .. }
        | Decision::LocalSlice { axis, .. }
        | Decision::ReduceScatter { axis, .. }
        | Decision::MergedAllGather { axis, .. }
        | Decision::StridedAllGather { axis, .. }
        | Decision::StridedSlice { axis, .. }
        | Decision::MergedReduceScatter { axis, .. }
        | Decision::Gather { axis, .. }
        | Decision::Scatter { axis, .. } => axis == a,
        Decision::AllToAll { from, to, .. } => from == a || to == a,
        _ => false,
    };
    if touched {
        return false;
    }
    let ragged = |sh: &Sharding| sh.layout.axes.iter().any(|x| x.ragged);
    let same_stream = p.stream().is_some_and(|ps| {
        p.value_index(ps.axis) == Some(a) && ps.chunks == cst.chunks && ps.swizzle == cst.swizzle
    });
    matches!(d, Decision::LocalCopy) || !(ragged(p) || ragged(c)) || same_stream
}

/// Why op `index` cannot compute locally, if it cannot: an input whose sharding differs from
/// what the op's output implies, or an output split the op cannot compute on chunks (the
/// lowering reports this as an error).
pub(crate) fn local_mismatch(program: &Program, index: usize) -> Result<Option<String>, PassError> {
    let op = &program.ops[index];
    if !matches!(
        op.kind,
        OpKind::MoeDispatch { .. } | OpKind::MoeCombine | OpKind::Set
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
