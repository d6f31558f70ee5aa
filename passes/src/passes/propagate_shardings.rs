//! `propagate_shardings`: fills in the schedules of unannotated tensors.
//!
//! **Forward**, in op order, each unannotated output takes from the op's inputs every
//! device parallel type it does not have yet, mapped through the op's axis map
//! ([`op_axis_map`]): for `matmul`/`linear` (and `grouped_matmul`) the **weight first**, so
//! weights (usually larger than activations) are never redistributed; otherwise the input with
//! the most parallel axes first. A split of a contraction axis lands on the output's reduction
//! axis (partial sums). The Stream split (with its swizzle) is taken the same way, from the
//! first input that has one that fits. **Backward**, from the last op to the first, every
//! unannotated input takes the device splits of the op's outputs it lacks (mapped back).
//! A split is only taken when it fits: the mesh has the parallel type with that many devices,
//! the axis divides, and the axis is not split by another type. An axis split several times
//! lends its whole chain at once, in its order. Forward, a split only lands
//! on an output axis the op can compute split ([`local_split_ok`]): through a reshape, the
//! split of a group's first axis moves to the group's first output axis when that extent
//! divides (the head split `[B, S, H] -> [B, S, nh, hd]` keeps `H`'s split on `nh` when
//! `d | nh`), and the normalized axis of `softmax`/`rms_norm` is never split.
//!
//! Only tensors whose schedule is `None` change; annotations, including `{}` (explicitly
//! replicated), are never overwritten. Results are written in canonical form
//! ([`Spec::to_transforms`]).

use meshflow_ir::{Op, OpKind, Program, TensorId};

use crate::analysis::op_rules::keeps_uneven;
use crate::analysis::{local_split_ok, op_axis_map, AxisSplit, Sharding, Spec, StreamSpec};
use crate::error::PassError;
use crate::manager::ProgramPass;
use crate::options::PassContext;

/// The pass.
pub struct PropagateShardings;

impl ProgramPass for PropagateShardings {
    fn name(&self) -> &'static str {
        "propagate_shardings"
    }

    fn run(&self, program: &mut Program, _cx: &mut PassContext) -> Result<(), PassError> {
        let specs = propagate(program)?;
        for (id, spec) in specs {
            if let Some(decl) = program.tensors.get_mut(id) {
                if decl.schedule.is_none() {
                    decl.schedule = Some(spec.to_transforms());
                }
            }
        }
        Ok(())
    }
}

/// The device splits of `spec` grouped by logical axis: each axis with its whole chain (a
/// chain moves as one, keeping its order).
fn chains(spec: &Spec) -> Vec<(usize, Vec<(meshflow_ir::ParallelType, AxisSplit)>)> {
    let mut by_axis: std::collections::BTreeMap<
        usize,
        Vec<(meshflow_ir::ParallelType, AxisSplit)>,
    > = std::collections::BTreeMap::new();
    // A strided chain is not lent (compute ops read and write plain chains).
    for (&pt, &split) in &spec.without_strided().device {
        by_axis.entry(split.axis).or_default().push((pt, split));
    }
    by_axis.into_iter().collect()
}

/// The order in which an op's inputs lend their splits to its outputs.
fn input_order(op: &Op, specs: &[Option<Spec>]) -> Vec<usize> {
    match op.kind {
        OpKind::Linear | OpKind::Matmul => vec![1, 0],
        OpKind::GroupedMatmul => vec![2, 0, 1],
        _ => {
            let count = |j: usize| {
                op.inputs
                    .get(j)
                    .and_then(|t| specs.get(t.index()).cloned().flatten())
                    .map_or(0, |s| s.device.len() + usize::from(s.stream.is_some()))
            };
            let mut order: Vec<usize> = (0..op.inputs.len()).collect();
            order.sort_by_key(|&j| std::cmp::Reverse(count(j)));
            order
        }
    }
}

use meshflow_ir::EntityRef;

/// The schedules propagation gives every unannotated tensor.
pub fn propagate(program: &Program) -> Result<Vec<(TensorId, Spec)>, PassError> {
    let mut specs: Vec<Option<Spec>> = Vec::with_capacity(program.tensors.len());
    let mut free = Vec::with_capacity(program.tensors.len());
    for (id, decl) in program.tensors.iter() {
        free.push(decl.schedule.is_none());
        specs.push(match decl.schedule {
            Some(_) => Some(Sharding::of(program, id)?.spec),
            None => None,
        });
    }
    // Uneven splits propagate only through ops that compute element by element along the
    // split axes (as DTensor's pointwise and linear ops keep uneven placements); shape ops,
    // row-wise ops and reductions take only splits that divide.
    let fits = |t: TensorId, s: &Spec, op: &Op| {
        program
            .tensors
            .get(t)
            .and_then(|d| {
                let mesh = &program.meshes.get(d.mesh)?.mesh;
                Some(s.fits(&d.ty, mesh) && (s.divides(&d.ty) || keeps_uneven(&op.kind)))
            })
            .unwrap_or(false)
    };
    // Forward.
    for op in &program.ops {
        let map = op_axis_map(program, op);
        let order = input_order(op, &specs);
        for (o, &out) in op.outputs.iter().enumerate() {
            if !free.get(out.index()).copied().unwrap_or(false) {
                continue;
            }
            let Some(axes) = map.get(o) else { continue };
            // Only onto output axes the op can compute split (not the normalized axis of a
            // softmax, not the later axes of a reshape group, ...).
            let out_axis = |j: usize, a: usize| {
                axes.iter().enumerate().position(|(k, src)| {
                    src.contains(&(j, a)) && local_split_ok(program, op, &map, k)
                })
            };
            let mut spec = Spec::default();
            for &j in &order {
                let Some(ins) = op.inputs.get(j).and_then(|t| specs[t.index()].clone()) else {
                    continue;
                };
                for (a, chain) in chains(&ins) {
                    let Some(k) = out_axis(j, a) else {
                        continue;
                    };
                    if spec.pt_on(k).is_some()
                        || chain.iter().any(|(pt, _)| spec.device.contains_key(pt))
                    {
                        continue;
                    }
                    let mut cand = spec.clone();
                    for (pt, split) in chain {
                        cand.device.insert(pt, AxisSplit { axis: k, ..split });
                    }
                    if fits(out, &cand, op) {
                        spec = cand;
                    }
                }
            }
            for &j in &order {
                if spec.stream.is_some() {
                    break;
                }
                let Some(ins) = op.inputs.get(j).and_then(|t| specs[t.index()].clone()) else {
                    continue;
                };
                let Some(st) = ins.stream else { continue };
                let Some(k) = out_axis(j, st.axis) else {
                    continue;
                };
                // The chunks must cut the same thing: the same piece of the axis' chain.
                if ins.device_chain(st.axis) != spec.device_chain(k) {
                    continue;
                }
                let mut cand = spec.clone();
                cand.stream = Some(StreamSpec { axis: k, ..st });
                if fits(out, &cand, op) {
                    spec = cand;
                }
            }
            specs[out.index()] = Some(spec);
        }
    }
    // Backward.
    for op in program.ops.iter().rev() {
        let map = op_axis_map(program, op);
        for (o, &out) in op.outputs.iter().enumerate() {
            let Some(os) = specs.get(out.index()).cloned().flatten() else {
                continue;
            };
            let Some(axes) = map.get(o) else { continue };
            for (j, &input) in op.inputs.iter().enumerate() {
                if !free.get(input.index()).copied().unwrap_or(false) {
                    continue;
                }
                let mut is = specs[input.index()].clone().unwrap_or_default();
                for (k, chain) in chains(&os) {
                    let Some(&(_, a)) = axes
                        .get(k)
                        .and_then(|src| src.iter().find(|(jj, _)| *jj == j))
                    else {
                        continue;
                    };
                    if is.pt_on(a).is_some()
                        || is.stream.is_some_and(|st| st.axis == a)
                        || chain.iter().any(|(pt, _)| is.device.contains_key(pt))
                    {
                        continue;
                    }
                    let mut cand = is.clone();
                    for (pt, split) in chain {
                        cand.device.insert(pt, AxisSplit { axis: a, ..split });
                    }
                    if fits(input, &cand, op) {
                        is = cand;
                    }
                }
                specs[input.index()] = Some(is);
            }
        }
    }
    Ok(program
        .tensors
        .keys()
        .filter(|t| free[t.index()])
        .map(|t| (t, specs[t.index()].clone().unwrap_or_default()))
        .collect())
}
