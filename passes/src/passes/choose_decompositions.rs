//! `choose_decompositions`: the schedule search. For every resharding it picks a [`Plan`] —
//! decomposition, chunk count, stream schedule and transport — of least predicted time under
//! the [cost model](crate::cost_model) (a machine profile), and writes it back as schedules
//! (the Stream split and swizzle of the tensor the decision is about) plus
//! [`PassContext::plans`], which `lower_to_host` follows.
//!
//! **Sites** (`sites.rs`): an all-gather `c = set(p)` into an unannotated `c` (plans: one
//! collective, a stream broadcast, a distance ring per iteration or prefetched, a forwarding
//! ring, a bidirectional ring); a reduce-scatter `z = set(y)` of unannotated partial sums `y`
//! computed by a compute op (one collective, a per-step reduce rooted at the loop index, a
//! forwarding ring of running sums in 1, 2 or 4 pieces per step, each with a separate add and,
//! where [`accumulates_in_place`](crate::analysis::accumulates_in_place), also accumulating
//! in place). Where the user annotated the
//! decomposition (a swizzled or plain Stream split), the search still picks what the
//! annotation leaves open (the ring's schedule or pieces) and prices it.
//!
//! **Search.** The plans of one site are few (about a dozen per transport), so they are
//! enumerated and priced in closed form. Sites compose through the transport, which the GPU
//! runtime applies to the whole program: for each transport the search sums the best time of
//! every priced site and keeps the transport of least total (NCCL on ties, which also runs
//! across processes); then each site takes its best plan over that transport — or, among the
//! plans within 1 % of the best, the simplest (fewer streams and instructions), since the
//! model's error is larger than that. An e-graph would add nothing here: no rewrite feeds
//! another and the costs are a sum over independent sites (egg stays where it earns its
//! place, the index algebra of [`crate::index`]).
//!
//! Options: [`PassOptions::decompositions`](crate::PassOptions::decompositions) forces a
//! decomposition by tensor name (an error on an annotated tensor or a decomposition the site
//! cannot take); [`PassOptions::pieces`](crate::PassOptions::pieces) the pieces per step of the
//! reduce-scatter ring (also on a ring the user annotated);
//! [`PassOptions::accumulate`](crate::PassOptions::accumulate) whether that ring accumulates
//! in place; the cost model's transport
//! forces the transport; a stream schedule other than
//! [`Auto`](crate::StreamSchedule::Auto) forces the distance ring's schedule. Every decision,
//! and the transport, is recorded in [`PassContext::explain`] with every candidate's predicted
//! time.

mod sites;

use meshflow_ir::Program;

use crate::cost_model::{Case, CostModel};
use crate::error::PassError;
use crate::explain::{ExplainRecord, VariantCost};
use crate::manager::{Decomposition, PassContext, ProgramPass};
use crate::plan::Plan;
use crate::profile::transport_key;
use crate::Transport;

use sites::{apply, local_copies, site, Site};

/// Plans within this fraction of the best count as ties, won by the simplest. It is small:
/// the model separates the schedules of one decomposition by fractions of a percent (on 2x
/// H200 it prices the per-iteration ring 0.2 % under the prefetched one at 16384x8192x8192 and
/// 0.3 % over it at 8192^3), and those small predicted gaps carry the order measured on
/// 2026-11-26 (the per-iteration ring 1.5-5.8 % ahead at 16384 in two runs; 2.3-4.0 % behind
/// at 8192^3 in the first, level in the second, `docs/schedule-search.md`); a 1 % tie gave the
/// per-iteration ring both shapes.
const TIE: f64 = 0.001;

/// The pass.
pub struct ChooseDecompositions;

impl ProgramPass for ChooseDecompositions {
    fn name(&self) -> &'static str {
        "choose_decompositions"
    }

    fn run(&self, program: &mut Program, cx: &mut PassContext) -> Result<(), PassError> {
        let mut all = Vec::new();
        for i in 0..program.ops.len() {
            if let Some(s) = site(program, cx, i)? {
                all.push(restrict(s, cx)?);
            }
        }
        // A forced decomposition of a resharding that moves nothing between devices (every
        // team it would use has one device) keeps the collective (a local copy) and has no
        // other decomposition.
        let mut local = local_copies(program)?;
        local.retain(|n| !all.iter().any(|s| &s.tensor == n));
        for (name, &forced) in &cx.options.decompositions {
            if local.contains(name) && forced != Decomposition::Collective {
                return Err(PassError::Options(format!(
                    "`{name}` cannot be decomposed as `{}`: its resharding moves nothing between \
                     devices (every team it would use has one device)",
                    forced.name()
                )));
            }
        }
        for (name, &on) in &cx.options.accumulate {
            if local.contains(name) && on {
                return Err(PassError::Options(format!(
                    "`{name}` cannot accumulate in place: its resharding moves nothing between \
                     devices (every team it would use has one device)"
                )));
            }
        }
        for (name, &pieces) in &cx.options.pieces {
            if local.contains(name) && pieces != 1 {
                return Err(PassError::Options(format!(
                    "`{name}` cannot be cut into {pieces} pieces per ring step: its resharding \
                     moves nothing between devices (every team it would use has one device)"
                )));
            }
        }
        if let Some(name) = cx
            .options
            .decompositions
            .keys()
            .chain(cx.options.pieces.keys())
            .chain(cx.options.accumulate.keys())
            .find(|n| !all.iter().any(|s| &s.tensor == *n) && !local.contains(*n))
        {
            let open: Vec<&str> = all
                .iter()
                .filter(|s| s.fixed.is_none())
                .map(|s| s.tensor.as_str())
                .collect();
            return Err(PassError::Options(format!(
                "no resharding decided by `{name}`; candidates: {}",
                if open.is_empty() {
                    "none".to_string()
                } else {
                    open.join(", ")
                }
            )));
        }
        let model = &cx.options.cost_model;
        let transports = model.transports();
        let totals: Vec<(Transport, f64)> = transports
            .iter()
            .map(|&t| {
                let total = all
                    .iter()
                    .filter_map(|s| best(model, s, t).map(|(_, c)| c))
                    .sum::<f64>();
                (t, total)
            })
            .collect();
        let priced = all.iter().any(|s| s.case.is_some() && !s.shapes.is_empty());
        let transport = totals
            .iter()
            .copied()
            .reduce(|a, b| if b.1 < a.1 * (1.0 - 1e-9) { b } else { a })
            .map(|(t, _)| t)
            .unwrap_or(Transport::Nccl);
        // Apply in program order; a site is re-read after the earlier ones changed the program.
        for i in 0..program.ops.len() {
            let Some(s) = site(program, cx, i)? else {
                continue;
            };
            let s = restrict(s, cx)?;
            let record = decide(&cx.options.cost_model, &s, transport);
            if let Some(plan) = record.0 {
                apply(program, &s.apply, plan.decomposition);
                cx.plans.insert(s.tensor.clone(), plan);
            }
            cx.explain.push(record.1);
        }
        if priced {
            cx.transport = Some(transport);
            cx.explain.push(ExplainRecord {
                tensor: String::new(),
                op: "the program".into(),
                communication: "transport".into(),
                variants: totals
                    .iter()
                    .map(|&(t, c)| VariantCost {
                        variant: transport_key(t).into(),
                        cost_us: Some(c),
                    })
                    .collect(),
                chosen: transport_key(transport).into(),
                reason: if totals.len() == 1 {
                    "forced by the options".into()
                } else {
                    "least predicted total over the decisions above".into()
                },
            });
        }
        Ok(())
    }
}

/// `s` with its plans cut down to a forced decomposition and forced pieces (an error when it
/// cannot take them).
fn restrict(s: Site, cx: &PassContext) -> Result<Site, PassError> {
    let s = restrict_decomposition(s, cx)?;
    let s = restrict_pieces(s, cx)?;
    restrict_accumulate(s, cx)
}

/// `s` with its plans cut down to a forced choice of accumulating in place: on, only the
/// rings that accumulate in place stay (an error where there is none); off, they go.
fn restrict_accumulate(mut s: Site, cx: &PassContext) -> Result<Site, PassError> {
    let Some(&on) = cx.options.accumulate.get(&s.tensor) else {
        return Ok(s);
    };
    if !on {
        s.shapes.retain(|x| !x.3);
        return Ok(s);
    }
    if !s.shapes.iter().any(|x| x.3) {
        return Err(PassError::Options(format!(
            "`{}` ({}) cannot accumulate in place: only the ring of running sums of a \
             reduce-scatter (`ring_forward` of partial sums) does, where the partial sums are \
             computed by a `linear` read by the reduce-scatter alone, all of one dtype",
            s.tensor, s.communication
        )));
    }
    s.shapes.retain(|x| x.3);
    s.fixed = Some("forced by the options");
    Ok(s)
}

/// `s` with its plans cut down to a forced decomposition (an error when it cannot take it).
fn restrict_decomposition(mut s: Site, cx: &PassContext) -> Result<Site, PassError> {
    let Some(&forced) = cx.options.decompositions.get(&s.tensor) else {
        return Ok(s);
    };
    if s.shapes.is_empty() && forced == Decomposition::Collective && !s.annotated {
        return Ok(s);
    }
    if s.annotated {
        return Err(PassError::Options(format!(
            "`{}` is annotated by the user; a decomposition cannot be forced on it",
            s.tensor
        )));
    }
    let available: Vec<Decomposition> = {
        let mut v: Vec<Decomposition> = s.shapes.iter().map(|x| x.0).collect();
        v.dedup();
        v
    };
    if !available.contains(&forced) {
        let names: Vec<&str> = available.iter().map(|d| d.name()).collect();
        return Err(PassError::Options(format!(
            "`{}` ({}) cannot be decomposed as `{}` (available: {})",
            s.tensor,
            s.communication,
            forced.name(),
            if names.is_empty() {
                "collective".to_string()
            } else {
                names.join(", ")
            }
        )));
    }
    s.shapes.retain(|x| x.0 == forced);
    s.fixed = Some("forced by the options");
    Ok(s)
}

/// `s` with its plans cut down to forced pieces per ring step. One piece is what every plan
/// but the cut reduce-scatter ring has, so it only drops the cut rings; more pieces leave only
/// the reduce-scatter ring cut that many ways (an error where there is none).
fn restrict_pieces(mut s: Site, cx: &PassContext) -> Result<Site, PassError> {
    let Some(&pieces) = cx.options.pieces.get(&s.tensor) else {
        return Ok(s);
    };
    if pieces == 1 && s.shapes.iter().all(|x| x.1 == 1) {
        return Ok(s);
    }
    if !s.shapes.iter().any(|x| x.1 == pieces) {
        let mut cuts: Vec<u64> = s
            .shapes
            .iter()
            .filter(|x| {
                x.0 == Decomposition::RingForward && matches!(s.case, Some(Case::Reduce(_)))
            })
            .map(|x| x.1)
            .collect();
        cuts.dedup();
        let cuts: Vec<String> = cuts.iter().map(u64::to_string).collect();
        return Err(PassError::Options(format!(
            "`{}` ({}) cannot be cut into {pieces} pieces per ring step: {}",
            s.tensor,
            s.communication,
            if cuts.is_empty() {
                "pieces apply to the ring of running sums of a reduce-scatter (`ring_forward` of \
                 partial sums), which this resharding does not take"
                    .to_string()
            } else {
                format!("its ring takes {} pieces", cuts.join(", "))
            }
        )));
    }
    s.shapes.retain(|x| x.1 == pieces);
    if pieces > 1 {
        s.fixed = Some("forced by the options");
    }
    Ok(s)
}

fn plan_of(shape: &sites::Shape, transport: Transport) -> Plan {
    Plan {
        decomposition: shape.0,
        pieces: shape.1,
        schedule: shape.2,
        transport,
        accumulate: shape.3,
    }
}

/// The plans of `s` over transport `t` with their predicted times, in candidate order.
fn priced(model: &CostModel, s: &Site, t: Transport) -> Vec<(Plan, f64)> {
    let Some(case) = &s.case else {
        return Vec::new();
    };
    s.shapes
        .iter()
        .filter_map(|shape| {
            let plan = plan_of(shape, t);
            model.cost(case, &plan).map(|c| (plan, c))
        })
        .collect()
}

/// The chosen plan of `s` over `t`: the simplest of those within [`TIE`] of the fastest.
fn best(model: &CostModel, s: &Site, t: Transport) -> Option<(Plan, f64)> {
    let all = priced(model, s, t);
    let fastest = all.iter().map(|x| x.1).reduce(f64::min)?;
    all.into_iter()
        .filter(|x| x.1 <= fastest * (1.0 + TIE))
        .min_by(|a, b| {
            a.0.complexity()
                .cmp(&b.0.complexity())
                .then(a.1.total_cmp(&b.1))
        })
}

/// The plan of `s` over `transport` (`None` for sites that are not priced) and its record.
fn decide(model: &CostModel, s: &Site, transport: Transport) -> (Option<Plan>, ExplainRecord) {
    let team = s.case.map_or(1, |c| c.team());
    let mut variants: Vec<VariantCost> = Vec::new();
    for t in model.transports() {
        for (plan, c) in priced(model, s, t) {
            variants.push(VariantCost {
                variant: plan.label(team),
                cost_us: Some(c),
            });
        }
    }
    let chosen = best(model, s, transport);
    let Some((plan, cost)) = chosen else {
        let what = if s.annotated {
            s.communication.clone()
        } else {
            "collective".to_string()
        };
        return (
            None,
            ExplainRecord {
                tensor: s.tensor.clone(),
                op: s.text.clone(),
                communication: s.communication.clone(),
                variants: vec![VariantCost {
                    variant: what.clone(),
                    cost_us: None,
                }],
                chosen: what,
                reason: s.fixed.unwrap_or("the only lowering").into(),
            },
        );
    };
    let fastest = priced(model, s, transport)
        .into_iter()
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let mut reason = match fastest {
        Some((f, fc)) if f != plan => format!(
            "{cost:.2} us, within {:.0} % of {} ({fc:.2} us) and simpler",
            TIE * 100.0,
            f.label(team)
        ),
        _ => format!("least predicted time ({cost:.2} us)"),
    };
    if let Some(f) = s.fixed {
        reason = format!("{f}; {reason}");
    }
    if let Some(Case::Gather(g)) = &s.case {
        if !g.overlappable && plan.decomposition != Decomposition::Collective {
            reason.push_str("; the consumer cannot join the stream loop, so nothing overlaps");
        }
    }
    (
        Some(plan),
        ExplainRecord {
            tensor: s.tensor.clone(),
            op: s.text.clone(),
            communication: s.communication.clone(),
            variants,
            chosen: plan.label(team),
            reason,
        },
    )
}
