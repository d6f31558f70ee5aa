//! The decision sites of a program: every resharding `set` with its [`Case`] and the plans it
//! may take (before transports), and how a chosen plan is written back as a schedule.

use meshflow_ir::{DType, OpKind, ParallelType, Program, TensorId};

use crate::analysis::{accumulates_in_place, op_axis_map, Sharding, Spec, StreamSpec};
use crate::cost_model::{Case, GatherCase, ReduceCase, Work};
use crate::decision::{decide, Decision};
use crate::edit::decl;
use crate::error::{op_text, PassError};
use crate::manager::{Decomposition, PassContext, StreamSchedule};

/// A plan without its transport: decomposition, pieces, stream schedule, and whether the ring
/// of running sums accumulates in place ([`Plan::accumulate`](crate::plan::Plan::accumulate)).
pub(super) type Shape = (Decomposition, u64, StreamSchedule, bool);

/// How a chosen plan changes the program.
#[derive(Clone, Debug)]
pub(super) enum Apply {
    /// Nothing to write (the user's schedule stays, or the collective was chosen).
    Nothing,
    /// Give the gathered tensor `c` a Stream split on logical axis `axis`, and the consumer's
    /// output (when it joins the loop) the matching one.
    Gather {
        c: TensorId,
        spec: Spec,
        axis: usize,
        pt: ParallelType,
        team: u64,
        consumer: Option<(TensorId, usize)>,
    },
    /// Give the partial sums `p` a Stream split on logical axis `axis`.
    Reduce {
        p: TensorId,
        spec: Spec,
        axis: usize,
        pt: ParallelType,
        team: u64,
    },
}

/// One resharding.
#[derive(Clone, Debug)]
pub(super) struct Site {
    /// The tensor whose schedule the decision sets (the name plans and options use).
    pub tensor: String,
    /// The op, printed.
    pub text: String,
    /// The decision-table row.
    pub communication: String,
    /// What the plans are priced for (`None`: not priced).
    pub case: Option<Case>,
    /// The plans it may take (one or none when the user's annotation fixes it).
    pub shapes: Vec<Shape>,
    /// Why it has no choice, when it has none.
    pub fixed: Option<&'static str>,
    /// True when the user's schedule fixes the decomposition.
    pub annotated: bool,
    /// How a chosen plan is written back.
    pub apply: Apply,
}

fn bytes_of(shape: &[u64], dtype: DType) -> f64 {
    shape.iter().product::<u64>() as f64 * dtype.size_bytes() as f64
}

/// The work of op `u` (producing `o`), from `o`'s local shape.
fn work_of(program: &Program, u: usize, o: TensorId) -> Result<Work, PassError> {
    let op = &program.ops[u];
    let os = Sharding::of(program, o)?;
    let od = decl(program, o)?;
    let value = os.local_value_shape();
    let numel: f64 = value.iter().product::<u64>() as f64;
    let local = os.layout.local_shape();
    let k: u64 = od
        .ty
        .axes
        .iter()
        .zip(&local)
        .filter(|(a, _)| a.reduction)
        .map(|(_, &e)| e)
        .product();
    let gemm = matches!(
        op.kind,
        OpKind::Linear | OpKind::Matmul | OpKind::GroupedMatmul
    );
    let mut bytes = numel * od.ty.dtype.size_bytes() as f64;
    for &t in &op.inputs {
        let s = Sharding::of(program, t)?;
        bytes += bytes_of(&s.local_value_shape(), decl(program, t)?.ty.dtype);
    }
    let n = value.last().copied().unwrap_or(1).max(1);
    Ok(Work {
        flops: if gemm { 2.0 * numel * k as f64 } else { numel },
        bytes,
        dtype: od.ty.dtype,
        gemm: gemm.then(|| [(numel as u64 / n).max(1), n, k.max(1)]),
    })
}

fn with_stream(spec: &Spec, axis: usize, chunks: u64, swizzle: Option<ParallelType>) -> Spec {
    let mut s = spec.clone();
    s.stream = Some(StreamSpec {
        axis,
        chunks,
        swizzle,
        depth: spec.device_chain(axis).len(),
    });
    s
}

/// The schedules a distance ring may take under the option `forced`.
fn ring_schedules(forced: StreamSchedule, overlappable: bool) -> Vec<StreamSchedule> {
    match forced {
        StreamSchedule::PerIteration => vec![StreamSchedule::PerIteration],
        StreamSchedule::Prefetch => vec![StreamSchedule::Prefetch],
        StreamSchedule::Auto if overlappable => {
            vec![StreamSchedule::PerIteration, StreamSchedule::Prefetch]
        }
        StreamSchedule::Auto => vec![StreamSchedule::PerIteration],
    }
}

/// The names of both tensors of every `set` whose resharding is a local copy (it moves
/// nothing between devices): a forced decomposition may name either.
pub(super) fn local_copies(program: &Program) -> Result<Vec<String>, PassError> {
    let mut names = Vec::new();
    for op in program.ops.iter() {
        if op.kind != OpKind::Set {
            continue;
        }
        let (p, c) = (op.inputs[0], op.outputs[0]);
        let (ps, cs) = (Sharding::of(program, p)?, Sharding::of(program, c)?);
        let (Some(pm), Some(cm)) = (program.meshes.get(ps.mesh), program.meshes.get(cs.mesh))
        else {
            continue;
        };
        if decide(&ps, &pm.mesh, &cs, &cm.mesh) == Decision::LocalCopy {
            names.push(decl(program, p)?.name.clone());
            names.push(decl(program, c)?.name.clone());
        }
    }
    Ok(names)
}

/// The decision site of op `i`, if it is a resharding `set`.
pub(super) fn site(
    program: &Program,
    cx: &PassContext,
    i: usize,
) -> Result<Option<Site>, PassError> {
    let op = &program.ops[i];
    if op.kind != OpKind::Set {
        return Ok(None);
    }
    let (p, c) = (op.inputs[0], op.outputs[0]);
    let ps = Sharding::of(program, p)?;
    let cs = Sharding::of(program, c)?;
    let mesh = |m| {
        program
            .meshes
            .get(m)
            .map(|d| d.mesh.clone())
            .ok_or_else(|| PassError::internal("choose_decompositions", "unknown mesh"))
    };
    let (pm, cm) = (mesh(ps.mesh)?, mesh(cs.mesh)?);
    let decision = decide(&ps, &pm, &cs, &cm);
    if decision == Decision::LocalCopy {
        return Ok(None);
    }
    let text = op_text(program, op);
    let c_name = decl(program, c)?.name.clone();
    let p_name = decl(program, p)?.name.clone();
    let mut s = Site {
        tensor: c_name.clone(),
        text,
        communication: decision.describe(),
        case: None,
        shapes: Vec::new(),
        fixed: Some("the only lowering of this resharding"),
        annotated: false,
        apply: Apply::Nothing,
    };
    let schedule = cx.options.stream_schedule;
    match decision {
        Decision::AllGather { pt, axis } if cs.stream().is_none() => {
            if cx.is_annotated(&c_name) {
                s.fixed = Some("annotated by the user");
                s.annotated = true;
                return Ok(Some(s));
            }
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let g = gather(program, cx, c, &cs, axis, pt, team)?;
            s.fixed = None;
            s.case = Some(Case::Gather(g.case));
            s.shapes.push((
                Decomposition::Collective,
                1,
                StreamSchedule::PerIteration,
                false,
            ));
            if g.can_stream {
                let ov = g.case.overlappable;
                s.shapes.push((
                    Decomposition::StreamBroadcast,
                    1,
                    StreamSchedule::PerIteration,
                    false,
                ));
                for sch in ring_schedules(schedule, ov) {
                    s.shapes.push((Decomposition::Ring, 1, sch, false));
                }
                s.shapes.push((
                    Decomposition::RingForward,
                    1,
                    StreamSchedule::Prefetch,
                    false,
                ));
                if g.halvable {
                    s.shapes.push((
                        Decomposition::RingBidirectional,
                        1,
                        StreamSchedule::Prefetch,
                        false,
                    ));
                }
            }
            s.apply = g.apply;
        }
        Decision::Ring { pt, axis } => {
            // The user chose the ring; the search picks its schedule.
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let g = gather(program, cx, c, &cs, axis, pt, team)?;
            s.fixed = Some("decomposition annotated by the user; schedule searched");
            s.annotated = true;
            s.case = Some(Case::Gather(g.case));
            for sch in ring_schedules(schedule, g.case.overlappable) {
                s.shapes.push((Decomposition::Ring, 1, sch, false));
            }
        }
        Decision::StreamBroadcast { pt, axis } => {
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let g = gather(program, cx, c, &cs, axis, pt, team)?;
            s.fixed = Some("annotated by the user");
            s.annotated = true;
            s.case = Some(Case::Gather(g.case));
            s.shapes.push((
                Decomposition::StreamBroadcast,
                1,
                StreamSchedule::PerIteration,
                false,
            ));
        }
        Decision::ReduceScatter { pt, axis } if cs.stream().is_none() => {
            s.tensor = p_name.clone();
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let r = reduce(program, cx, i, p, &ps, &cs, axis, pt, team)?;
            s.case = Some(Case::Reduce(r.case));
            s.shapes.push((
                Decomposition::Collective,
                1,
                StreamSchedule::PerIteration,
                false,
            ));
            if cx.is_annotated(&p_name) || !r.can_stream {
                s.annotated = cx.is_annotated(&p_name);
                s.fixed = Some(if s.annotated {
                    "annotated by the user"
                } else {
                    "the partial sums cannot be computed chunk by chunk"
                });
                return Ok(Some(s));
            }
            s.fixed = None;
            s.shapes.push((
                Decomposition::StreamReduce,
                1,
                StreamSchedule::PerIteration,
                false,
            ));
            if r.ring {
                s.shapes.extend(ring_shapes(&r));
            }
            s.apply = r.apply;
        }
        Decision::ReduceRing { pt, axis } => {
            s.tensor = p_name;
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let r = reduce(program, cx, i, p, &ps, &cs, axis, pt, team)?;
            s.fixed = Some("decomposition annotated by the user; pieces searched");
            s.annotated = true;
            s.case = Some(Case::Reduce(r.case));
            s.shapes.extend(ring_shapes(&r));
        }
        Decision::StreamReduce { pt, axis } => {
            s.tensor = p_name;
            let team = pm.size_of(pt).unwrap_or(1) as u64;
            let r = reduce(program, cx, i, p, &ps, &cs, axis, pt, team)?;
            s.fixed = Some("annotated by the user");
            s.annotated = true;
            s.case = Some(Case::Reduce(r.case));
            s.shapes.push((
                Decomposition::StreamReduce,
                1,
                StreamSchedule::PerIteration,
                false,
            ));
        }
        _ => {
            if cx.is_annotated(&c_name) {
                s.fixed = Some("annotated by the user");
                s.annotated = true;
            }
        }
    }
    Ok(Some(s))
}

struct GatherSite {
    case: GatherCase,
    can_stream: bool,
    halvable: bool,
    apply: Apply,
}

/// An all-gather of value axis `axis` into `c` (see the module docs of the pass).
fn gather(
    program: &Program,
    cx: &PassContext,
    c: TensorId,
    cs: &Sharding,
    axis: usize,
    pt: ParallelType,
    team: u64,
) -> Result<GatherSite, PassError> {
    let cd = decl(program, c)?;
    let cmesh = program
        .meshes
        .get(cd.mesh)
        .map(|m| &m.mesh)
        .ok_or_else(|| PassError::internal("choose_decompositions", "unknown mesh"))?;
    let local = cs.local_value_shape();
    let logical = cs.value_axes.get(axis).copied().unwrap_or(axis);
    let chunk_bytes = bytes_of(&local, cd.ty.dtype) / team.max(1) as f64;
    let spec = cs.spec.without_stream();
    let can_stream = team >= 2
        && local.iter().take(axis).all(|&e| e == 1)
        && with_stream(&spec, logical, team, None).fits(&cd.ty, cmesh)
        && with_stream(&spec, logical, team, None).divides(&cd.ty);
    let extent = local.get(axis).copied().unwrap_or(0);
    let mut halvable = extent.is_multiple_of(2 * team.max(1));
    let mut consumer = None;
    let mut work = Work::none(cd.ty.dtype);
    let uses = program.uses(c);
    if let [u] = uses.as_slice() {
        let op = &program.ops[*u];
        let compute = !matches!(
            op.kind,
            OpKind::Set | OpKind::MoeDispatch { .. } | OpKind::MoeCombine
        );
        if let (true, Some(&o)) = (compute, op.outputs.first()) {
            work = work_of(program, *u, o)?;
            let os = Sharding::of(program, o)?;
            let od = decl(program, o)?;
            let j = op.inputs.iter().position(|&t| t == c);
            let map = op_axis_map(program, op);
            let k = j.and_then(|j| {
                map.first()?
                    .iter()
                    .position(|src| src.contains(&(j, logical)))
            });
            if let Some(k) = k.filter(|&k| od.ty.axes.get(k).is_some_and(|a| !a.reduction)) {
                let omesh = program.meshes.get(od.mesh).map(|m| &m.mesh);
                let fits = os.stream().is_none()
                    && os.spec.device_chain(k) == cs.spec.device_chain(logical)
                    && omesh.is_some_and(|m| {
                        with_stream(&os.spec, k, team, None).fits(&od.ty, m)
                            && with_stream(&os.spec, k, team, None).divides(&od.ty)
                    });
                let already = os.stream().is_some_and(|s| s.axis == k && s.chunks == team);
                if (fits && !cx.is_annotated(&od.name)) || already {
                    consumer = Some((o, k));
                    let oe = os
                        .value_index(k)
                        .and_then(|v| os.local_value_shape().get(v).copied())
                        .unwrap_or(0);
                    halvable &= oe.is_multiple_of(2 * team.max(1));
                }
            }
        }
    }
    let overlappable = consumer.is_some();
    Ok(GatherSite {
        case: GatherCase {
            team,
            chunk_bytes,
            consumer: work,
            overlappable,
            workers: cx.options.num_streams as u64,
        },
        can_stream,
        halvable,
        apply: Apply::Gather {
            c,
            spec,
            axis: logical,
            pt,
            team,
            consumer,
        },
    })
}

struct ReduceSite {
    case: ReduceCase,
    can_stream: bool,
    ring: bool,
    pieces: Vec<u64>,
    /// The ring may accumulate in place ([`accumulates_in_place`]).
    accumulate: bool,
    apply: Apply,
}

/// The plans of the ring of running sums: each cut into pieces, with a separate add, and where
/// it applies accumulating in place.
fn ring_shapes(r: &ReduceSite) -> Vec<Shape> {
    let mut shapes = Vec::new();
    for &pieces in &r.pieces {
        let schedule = StreamSchedule::Prefetch;
        shapes.push((Decomposition::RingForward, pieces, schedule, false));
        if r.accumulate {
            shapes.push((Decomposition::RingForward, pieces, schedule, true));
        }
    }
    shapes
}

/// A reduce-scatter (op `i`) of the partial sums `p` over value axis `axis` into `c`.
#[allow(clippy::too_many_arguments)]
fn reduce(
    program: &Program,
    cx: &PassContext,
    i: usize,
    p: TensorId,
    ps: &Sharding,
    cs: &Sharding,
    axis: usize,
    pt: ParallelType,
    team: u64,
) -> Result<ReduceSite, PassError> {
    let pd = decl(program, p)?;
    let pmesh = program
        .meshes
        .get(pd.mesh)
        .map(|m| &m.mesh)
        .ok_or_else(|| PassError::internal("choose_decompositions", "unknown mesh"))?;
    let chunk_bytes = bytes_of(&cs.local_value_shape(), pd.ty.dtype);
    let producer = program.ops.iter().position(|o| o.outputs.contains(&p));
    let compute = producer.is_some_and(|u| {
        !matches!(
            program.ops[u].kind,
            OpKind::Set | OpKind::MoeDispatch { .. } | OpKind::MoeCombine
        ) && program.ops[u].outputs.len() == 1
    });
    let work = match producer {
        Some(u) if compute => work_of(program, u, p)?,
        _ => Work::none(pd.ty.dtype),
    };
    let logical = ps.value_axes.get(axis).copied().unwrap_or(axis);
    let spec = ps.spec.without_stream();
    let only_here = program.uses(p) == [i] && !program.outputs.contains(&p);
    let can_stream = team >= 2
        && compute
        && only_here
        && ps
            .stream()
            .is_none_or(|s| s.axis == logical && s.chunks == team)
        && with_stream(&spec, logical, team, None).fits(&pd.ty, pmesh)
        && with_stream(&spec, logical, team, None).divides(&pd.ty);
    // The ring reads the partial sums right after the op that computes them.
    let ring = can_stream && producer.is_some_and(|u| u + 1 == i);
    let rows = cs.local_value_shape().get(axis).copied().unwrap_or(0);
    let pieces = [1u64, 2, 4]
        .into_iter()
        .filter(|&k| rows.is_multiple_of(k))
        .collect();
    Ok(ReduceSite {
        case: ReduceCase {
            team,
            chunk_bytes,
            producer: work,
            workers: cx.options.num_streams as u64,
        },
        can_stream,
        ring,
        pieces,
        accumulate: accumulates_in_place(program, i),
        apply: Apply::Reduce {
            p,
            spec,
            axis: logical,
            pt,
            team,
        },
    })
}

/// Writes the schedule of `decomposition` (see [`Apply`]).
pub(super) fn apply(program: &mut Program, apply: &Apply, decomposition: Decomposition) {
    let swizzled = matches!(
        decomposition,
        Decomposition::Ring | Decomposition::RingForward | Decomposition::RingBidirectional
    );
    match apply {
        Apply::Nothing => {}
        Apply::Gather { .. } | Apply::Reduce { .. }
            if decomposition == Decomposition::Collective => {}
        Apply::Gather {
            c,
            spec,
            axis,
            pt,
            team,
            consumer,
        } => {
            let stream = StreamSpec {
                axis: *axis,
                chunks: *team,
                swizzle: swizzled.then_some(*pt),
                depth: spec.device_chain(*axis).len(),
            };
            let mut cspec = spec.clone();
            cspec.stream = Some(stream);
            program.tensors[*c].schedule = Some(cspec.to_transforms());
            if let Some((o, k)) = *consumer {
                if let Ok(os) = Sharding::of(program, o) {
                    if os.stream().is_none() {
                        let mut ospec = os.spec.clone();
                        ospec.stream = Some(StreamSpec {
                            axis: k,
                            depth: ospec.device_chain(k).len(),
                            ..stream
                        });
                        program.tensors[o].schedule = Some(ospec.to_transforms());
                    }
                }
            }
        }
        Apply::Reduce {
            p,
            spec,
            axis,
            pt,
            team,
        } => {
            let mut pspec = spec.clone();
            pspec.stream = Some(StreamSpec {
                axis: *axis,
                chunks: *team,
                swizzle: swizzled.then_some(*pt),
                depth: spec.device_chain(*axis).len(),
            });
            program.tensors[*p].schedule = Some(pspec.to_transforms());
        }
    }
}
