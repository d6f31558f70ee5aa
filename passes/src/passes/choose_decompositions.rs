//! `choose_decompositions`: picks how each resharding `set` into an **unannotated** tensor is
//! decomposed, with egg and the cost model of [`crate::cost_model`].
//!
//! For an all-gather (`c = set(p)`, `p` split on axis `a` along `pt`, `c` replicated along
//! `pt`), an e-graph holds the variants in one e-class: `(collective c 1)` (one all-gather),
//! `(bcast c d)` (a stream loop of `d` broadcasts rooted at the loop index) and `(ring c d)`
//! (a stream loop of collective permutes, from `swizzle1d`), the second child being the chunk
//! count (one chunk per team member: the only count the decision table lowers for the
//! decomposed variants). Rewrite rules add the decomposed variants when they apply (team of
//! at least 2, the gathered axis outermost in `c`'s local buffer); the greedy extractor
//! picks the variant of least estimated time. A decomposed variant gives `c` a Stream split on
//! `a` (swizzled for the ring) and, when `c`'s single consumer is a compute op whose output is
//! unannotated, gives that output the matching Stream split so the consumer runs chunk by
//! chunk in the same loop (overlap).
//!
//! User annotations win: an annotated consumer is never changed (its decision is recorded as
//! such). `PassContext::decompositions` forces a variant by tensor name. Every decision is
//! recorded in `PassContext::explain`.

use egg::{EGraph, Extractor, Id, RecExpr, Rewrite, Runner};
use meshflow_ir::{OpKind, Program, TensorId};

use crate::analysis::{op_axis_map, Sharding, Spec, StreamSpec};
use crate::cost_model::{CostModel, GatherCase};
use crate::decision::{decide, Decision};
use crate::edit::decl;
use crate::error::{op_text, PassError};
use crate::explain::{ExplainRecord, VariantCost};
use crate::manager::{Decomposition, PassContext, ProgramPass};

pub use lang::DecompLang;

mod lang {
    // egg's macro cannot document variants: `(collective t 1)` one all-gather, `(bcast t s)`
    // a stream loop of broadcasts, `(ring t s)` a ring of collective permutes, `Num` a chunk
    // count, `Sym` the resharding's output tensor.
    #![allow(missing_docs)]
    use egg::{define_language, Id, Symbol};

    define_language! {
    /// Decompositions of one all-gather feeding its consumer.
    pub enum DecompLang {
        "collective" = Collective([Id; 2]),
        "bcast" = Bcast([Id; 2]),
        "ring" = Ring([Id; 2]),
        Num(i64),
        Sym(Symbol),
    }
    }
}

/// The pass.
pub struct ChooseDecompositions;

impl ProgramPass for ChooseDecompositions {
    fn name(&self) -> &'static str {
        "choose_decompositions"
    }

    fn run(&self, program: &mut Program, cx: &mut PassContext) -> Result<(), PassError> {
        let mut seen = Vec::new();
        for i in 0..program.ops.len() {
            let op = &program.ops[i];
            if op.kind != OpKind::Set {
                continue;
            }
            let (p, c) = (op.inputs[0], op.outputs[0]);
            let ps = Sharding::of(program, p)?;
            let cs = Sharding::of(program, c)?;
            let mesh = |m| {
                program
                    .meshes
                    .get(m)
                    .map(|d| d.mesh.clone())
                    .ok_or_else(|| PassError::internal(self.name(), "unknown mesh"))
            };
            let (pm, cm) = (mesh(ps.mesh)?, mesh(cs.mesh)?);
            let decision = decide(&ps, &pm, &cs, &cm);
            if decision == Decision::LocalCopy {
                continue;
            }
            let c_name = decl(program, c)?.name.clone();
            let text = op_text(program, op);
            if cx.is_annotated(&c_name) {
                if cx.decompositions.contains_key(&c_name) {
                    return Err(PassError::Options(format!(
                        "`{c_name}` is annotated by the user; a decomposition cannot be forced on it"
                    )));
                }
                cx.explain.push(ExplainRecord {
                    tensor: c_name,
                    op: text,
                    communication: decision.describe(),
                    variants: vec![VariantCost {
                        variant: decision.describe(),
                        cost_us: None,
                    }],
                    chosen: decision.describe(),
                    reason: "annotated by the user".into(),
                });
                continue;
            }
            seen.push(c_name.clone());
            let forced = cx.decompositions.get(&c_name).copied();
            match decision {
                Decision::AllGather { pt, axis } if cs.stream().is_none() => {
                    let d = pm.size_of(pt).unwrap_or(1) as u64;
                    let plan = plan_gather(program, cx, c, &cs, axis, d)?;
                    let record = choose(&cx.cost_model, &plan, forced, &c_name, &text, &decision)?;
                    apply(program, &plan, c, &cs, axis, pt, record.0);
                    cx.explain.push(record.1);
                }
                _ => {
                    if let Some(f) = forced.filter(|f| *f != Decomposition::Collective) {
                        return Err(PassError::Options(format!(
                            "`{c_name}` is a {}, which has no `{}` decomposition",
                            decision.describe(),
                            f.name()
                        )));
                    }
                    cx.explain.push(ExplainRecord {
                        tensor: c_name,
                        op: text,
                        communication: decision.describe(),
                        variants: vec![VariantCost {
                            variant: "collective".into(),
                            cost_us: None,
                        }],
                        chosen: "collective".into(),
                        reason: "the only lowering of this resharding".into(),
                    });
                }
            }
        }
        if let Some(name) = cx.decompositions.keys().find(|n| !seen.contains(n)) {
            return Err(PassError::Options(format!(
                "no resharding into an unannotated tensor `{name}`; candidates: {}",
                if seen.is_empty() {
                    "none".to_string()
                } else {
                    seen.join(", ")
                }
            )));
        }
        Ok(())
    }
}

/// What the decision about one all-gather needs to know.
struct GatherPlan {
    case: GatherCase,
    /// The team size (= chunk count of the decomposed variants).
    team: u64,
    /// True when a Stream split over the gathered axis fits and its chunks are contiguous.
    can_stream: bool,
    /// The consumer's output and the axis of it that the gathered axis maps to, when the
    /// consumer can join the stream loop.
    consumer: Option<(TensorId, usize)>,
}

fn plan_gather(
    program: &Program,
    cx: &PassContext,
    c: TensorId,
    cs: &Sharding,
    axis: usize,
    team: u64,
) -> Result<GatherPlan, PassError> {
    let cd = decl(program, c)?;
    let cmesh = program
        .meshes
        .get(cd.mesh)
        .map(|m| &m.mesh)
        .ok_or_else(|| PassError::internal("choose_decompositions", "unknown mesh"))?;
    let local = cs.local_value_shape();
    let bytes = |shape: &[u64], dtype: meshflow_ir::DType| {
        shape.iter().product::<u64>() as f64 * dtype.size_bytes() as f64
    };
    let gathered_bytes = bytes(&local, cd.ty.dtype);
    let with_stream = |spec: &Spec, axis: usize, swizzle| {
        let mut s = spec.clone();
        s.stream = Some(StreamSpec {
            axis,
            chunks: team,
            swizzle,
            depth: spec.device_chain(axis).len(),
        });
        s
    };
    let can_stream = team >= 2
        && local.iter().take(axis).all(|&e| e == 1)
        && with_stream(&cs.spec, axis, None).fits(&cd.ty, cmesh)
        && with_stream(&cs.spec, axis, None).divides(&cd.ty);
    let mut consumer = None;
    let (mut flops, mut cbytes, mut dtype) = (0.0, 0.0, cd.ty.dtype);
    let uses = program.uses(c);
    if let [u] = uses.as_slice() {
        let op = &program.ops[*u];
        let compute = !matches!(
            op.kind,
            OpKind::Set | OpKind::MoeDispatch | OpKind::MoeCombine
        );
        if let (true, Some(&o)) = (compute, op.outputs.first()) {
            let os = Sharding::of(program, o)?;
            let od = decl(program, o)?;
            let out_local = program_local_shape(&os);
            let numel: f64 = os.local_value_shape().iter().product::<u64>() as f64;
            dtype = od.ty.dtype;
            flops = match op.kind {
                OpKind::Linear | OpKind::Matmul | OpKind::GroupedMatmul => {
                    let k: u64 = od
                        .ty
                        .axes
                        .iter()
                        .zip(&out_local)
                        .filter(|(a, _)| a.reduction)
                        .map(|(_, &e)| e)
                        .product();
                    2.0 * numel * k as f64
                }
                _ => numel,
            };
            cbytes = numel * dtype.size_bytes() as f64;
            for &t in &op.inputs {
                let s = Sharding::of(program, t)?;
                cbytes += bytes(&s.local_value_shape(), decl(program, t)?.ty.dtype);
            }
            let j = op.inputs.iter().position(|&t| t == c);
            let map = op_axis_map(program, op);
            let k = j.and_then(|j| map.first()?.iter().position(|src| src.contains(&(j, axis))));
            if let Some(k) = k.filter(|&k| od.ty.axes.get(k).is_some_and(|a| !a.reduction)) {
                let omesh = program.meshes.get(od.mesh).map(|m| &m.mesh);
                let fits = os.stream().is_none()
                    && os.spec.device_chain(k) == cs.spec.device_chain(axis)
                    && omesh.is_some_and(|m| {
                        with_stream(&os.spec, k, None).fits(&od.ty, m)
                            && with_stream(&os.spec, k, None).divides(&od.ty)
                    });
                let already = os.stream().is_some_and(|s| s.axis == k && s.chunks == team);
                if (fits && !cx.is_annotated(&od.name)) || already {
                    consumer = Some((o, k));
                }
            }
        }
    }
    Ok(GatherPlan {
        case: GatherCase {
            team,
            gathered_bytes,
            consumer_flops: flops,
            consumer_bytes: cbytes,
            dtype,
            overlappable: consumer.is_some(),
        },
        team,
        can_stream,
        consumer,
    })
}

fn program_local_shape(s: &Sharding) -> Vec<u64> {
    s.layout.local_shape()
}

struct CostFn<'a> {
    model: &'a CostModel,
    case: GatherCase,
    egraph: &'a EGraph<DecompLang, ()>,
}

impl CostFn<'_> {
    fn chunks(&self, id: Id) -> u64 {
        self.egraph[id]
            .nodes
            .iter()
            .find_map(|n| match n {
                DecompLang::Num(k) => u64::try_from(*k).ok(),
                _ => None,
            })
            .unwrap_or(1)
    }

    fn variant(&self, node: &DecompLang) -> Option<(Decomposition, u64, f64)> {
        Some(match node {
            DecompLang::Collective([_, s]) => (
                Decomposition::Collective,
                self.chunks(*s),
                self.model.collective(&self.case),
            ),
            DecompLang::Ring([_, s]) => {
                let s = self.chunks(*s);
                (Decomposition::Ring, s, self.model.ring(&self.case, s))
            }
            DecompLang::Bcast([_, s]) => {
                let s = self.chunks(*s);
                (
                    Decomposition::StreamBroadcast,
                    s,
                    self.model.stream_broadcast(&self.case, s),
                )
            }
            _ => return None,
        })
    }
}

impl egg::CostFunction<DecompLang> for CostFn<'_> {
    type Cost = f64;
    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &DecompLang, _costs: C) -> f64 {
        self.variant(enode).map_or(0.0, |(_, _, c)| c.max(0.0))
    }
}

fn label(d: Decomposition, s: u64) -> String {
    format!("{}(s={s})", d.name())
}

/// Runs the e-graph for one all-gather; returns the chosen variant and the record.
fn choose(
    model: &CostModel,
    plan: &GatherPlan,
    forced: Option<Decomposition>,
    tensor: &str,
    text: &str,
    decision: &Decision,
) -> Result<(Decomposition, ExplainRecord), PassError> {
    let start: RecExpr<DecompLang> = format!("(collective {tensor} 1)")
        .parse()
        .map_err(|e| PassError::internal("choose_decompositions", format!("{e}")))?;
    let mut rules: Vec<Rewrite<DecompLang, ()>> = Vec::new();
    if plan.can_stream {
        let d = plan.team;
        for (name, rhs) in [("gather-to-ring", "ring"), ("gather-to-bcast", "bcast")] {
            let lhs: egg::Pattern<DecompLang> = "(collective ?t 1)"
                .parse()
                .map_err(|e| PassError::internal("choose_decompositions", format!("{e}")))?;
            let rhs: egg::Pattern<DecompLang> = format!("({rhs} ?t {d})")
                .parse()
                .map_err(|e| PassError::internal("choose_decompositions", format!("{e}")))?;
            rules.push(
                Rewrite::new(name, lhs, rhs)
                    .map_err(|e| PassError::internal("choose_decompositions", e))?,
            );
        }
    }
    let runner = Runner::<DecompLang, (), ()>::default()
        .with_expr(&start)
        .with_iter_limit(4)
        .with_node_limit(100)
        .run(&rules);
    let root = runner.roots[0];
    let egraph = &runner.egraph;
    let cost = CostFn {
        model,
        case: plan.case,
        egraph,
    };
    let mut variants: Vec<(Decomposition, u64, f64)> = egraph[root]
        .nodes
        .iter()
        .filter_map(|n| cost.variant(n))
        .collect();
    variants.sort_by_key(|(d, s, _)| (Decomposition::ALL.iter().position(|x| x == d), *s));
    let extractor = Extractor::new(
        egraph,
        CostFn {
            model,
            case: plan.case,
            egraph,
        },
    );
    let (best_cost, _) = extractor.find_best(root);
    let (mut chosen, mut chunks) = cost
        .variant(extractor.find_best_node(root))
        .map_or((Decomposition::Collective, 1), |(d, s, _)| (d, s));
    let mut reason = format!("lowest estimated time ({best_cost:.2} us)");
    if let Some(f) = forced {
        let Some(&(d, s, _)) = variants.iter().find(|(d, _, _)| *d == f) else {
            return Err(PassError::Options(format!(
                "`{tensor}` cannot be decomposed as `{}` (available: {})",
                f.name(),
                variants
                    .iter()
                    .map(|(d, _, _)| d.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        chosen = d;
        chunks = s;
        reason = "forced by the options".into();
    }
    let record = ExplainRecord {
        tensor: tensor.to_string(),
        op: text.to_string(),
        communication: decision.describe(),
        variants: variants
            .iter()
            .map(|&(d, s, c)| VariantCost {
                variant: label(d, s),
                cost_us: Some(c),
            })
            .collect(),
        chosen: label(chosen, chunks),
        reason: if plan.case.overlappable || chosen == Decomposition::Collective {
            reason
        } else {
            format!("{reason}; the consumer cannot join the stream loop, so nothing overlaps")
        },
    };
    Ok((chosen, record))
}

fn apply(
    program: &mut Program,
    plan: &GatherPlan,
    c: TensorId,
    cs: &Sharding,
    axis: usize,
    pt: meshflow_ir::ParallelType,
    chosen: Decomposition,
) {
    let swizzle = match chosen {
        Decomposition::Collective => return,
        Decomposition::Ring => Some(pt),
        Decomposition::StreamBroadcast => None,
    };
    let stream = StreamSpec {
        axis,
        chunks: plan.team,
        swizzle,
        depth: cs.spec.device_chain(axis).len(),
    };
    let mut spec = cs.spec.clone();
    spec.stream = Some(stream);
    program.tensors[c].schedule = Some(spec.to_transforms());
    if let Some((o, k)) = plan.consumer {
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
