//! The per-rank plan: a host program compiled once for one rank into dense tables, so that
//! executing an instruction needs no string or hash-map lookups.
//!
//! Instructions this rank does not take part in are dropped here: a tensor exists only on the
//! devices of its mesh, a communication involves exactly its team, and a `wait` on a label
//! this rank never posts is a no-op.
//!
//! Every operand keeps its typed handle: tensors are [`HostTensorId`]s, loop and stream
//! variables the IR's [`LoopVar`] and [`StreamVar`], teams [`TeamId`], communications
//! [`CommLabel`] and kernels [`KernelId`].

use std::collections::BTreeMap;

use meshflow_ir::{
    Arena, CommId, CommKind, ComputeOp, DeviceId, EntityRef, Expr, HostProgram, HostTensorId, Inst,
    InstKind, LoopVar, ReduceOp, StreamRef, StreamVar, Team,
};

use super::moe_weights::{pair_moe_weights, MoeWeightPairs};
use super::RuntimeError;
use crate::runtime::backend::{
    Backend, CommInfo, CommLabel, CommOp, KernelId, MoeWeightsAt, PreorderIndex, TeamId, TeamInfo,
};

/// Which stream an instruction names.
#[derive(Debug)]
pub(crate) enum StreamSel<'p> {
    Var(StreamVar),
    Worker(&'p Expr),
}

/// One compiled instruction. `at` is the position of the source instruction in pre-order.
#[derive(Debug)]
pub(crate) enum Step<'p> {
    Allocate {
        at: PreorderIndex,
        tensor: HostTensorId,
    },
    Deallocate {
        at: PreorderIndex,
        tensor: HostTensorId,
    },
    Loop {
        at: PreorderIndex,
        var: LoopVar,
        start: &'p Expr,
        stop: &'p Expr,
        body: Vec<Step<'p>>,
    },
    GetStream {
        at: PreorderIndex,
        dst: StreamVar,
    },
    SetStream {
        at: PreorderIndex,
        stream: StreamSel<'p>,
    },
    Sync {
        at: PreorderIndex,
        stream: StreamSel<'p>,
    },
    Shard {
        at: PreorderIndex,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        chunks: u64,
        index: &'p Expr,
    },
    Narrow {
        at: PreorderIndex,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        start: &'p Expr,
        length: &'p Expr,
    },
    Collective {
        at: PreorderIndex,
        label: CommLabel,
        kind: CommKind,
        team: TeamId,
        input: Option<HostTensorId>,
        output: Option<HostTensorId>,
        root: Option<&'p Expr>,
        op: ReduceOp,
    },
    Permute {
        at: PreorderIndex,
        label: CommLabel,
        team: TeamId,
        send: &'p Expr,
        recv: &'p Expr,
        input: HostTensorId,
        output: HostTensorId,
    },
    /// `[x, topk_idx, expert_x, expert_counts, routing]`, tokens encoded as `wire`; with
    /// `weights`, the top-k weights of its combine travel with it (see `moe_weights.rs`).
    Dispatch {
        at: PreorderIndex,
        label: CommLabel,
        team: TeamId,
        t: [HostTensorId; 5],
        wire: meshflow_ir::MoeWire,
        weights: Option<HostTensorId>,
    },
    /// `[expert_y, expert_counts, routing, topk_weights, out]`; `early`: the label of the
    /// dispatch that carried `topk_weights` already.
    Combine {
        at: PreorderIndex,
        label: CommLabel,
        team: TeamId,
        t: [HostTensorId; 5],
        early: Option<CommLabel>,
    },
    Wait {
        at: PreorderIndex,
        label: CommLabel,
    },
    BeginGroup {
        at: PreorderIndex,
    },
    EndGroup {
        at: PreorderIndex,
        label: CommLabel,
    },
    Compute {
        at: PreorderIndex,
        op: &'p ComputeOp,
        inputs: Vec<HostTensorId>,
        outputs: Vec<HostTensorId>,
    },
    Kernel {
        at: PreorderIndex,
        kernel: KernelId,
        inputs: Vec<HostTensorId>,
        outputs: Vec<HostTensorId>,
        args: &'p [Expr],
    },
}

/// A host program compiled for one rank.
#[derive(Debug)]
pub(crate) struct Plan<'p> {
    /// Every instruction in pre-order (the `at` of a step indexes this).
    pub insts: Arena<PreorderIndex, &'p Inst>,
    /// Per pre-order instruction, the loop variables enclosing it (outermost first).
    pub enclosing: Arena<PreorderIndex, Vec<LoopVar>>,
    pub steps: Vec<Step<'p>>,
    /// The teams of this rank, indexed by [`TeamId`].
    pub teams: Arena<TeamId, TeamInfo>,
    /// Every communication label, indexed by [`CommLabel`].
    pub comms: Arena<CommLabel, CommInfo>,
    /// Per label, the label of the coalescing group it was posted in, if any.
    pub group_of: Arena<CommLabel, Option<CommLabel>>,
    pub loop_vars: usize,
    pub stream_vars: usize,
    /// Per mesh, this rank's team index along DIDx, DIDy, DIDz.
    pub my: Vec<[Option<i64>; 3]>,
    /// Per tensor, whether this rank holds it.
    pub held: Arena<HostTensorId, bool>,
}

impl Plan<'_> {
    /// The team `id`.
    pub fn team(&self, id: TeamId) -> &TeamInfo {
        &self.teams[id]
    }

    /// The program's label of `label`.
    pub fn comm(&self, label: CommLabel) -> Option<CommId> {
        self.comms.get(label).map(|c| c.comm)
    }
}

/// An arena of `n` copies of `value` (a dense table indexed by a typed handle).
pub(crate) fn table<K: EntityRef, V: Clone>(n: usize, value: V) -> Arena<K, V> {
    let mut a = Arena::new();
    for _ in 0..n {
        a.push(value.clone());
    }
    a
}

struct Builder<'p, 'b, B: Backend> {
    program: &'p HostProgram,
    backend: &'b B,
    rank: DeviceId,
    plan: Plan<'p>,
    label_index: BTreeMap<CommId, CommLabel>,
    team_index: BTreeMap<Vec<DeviceId>, TeamId>,
    /// Labels posted by a step this rank runs.
    posted: Arena<CommLabel, bool>,
    loop_stack: Vec<LoopVar>,
    /// Labels posted since the last `start_coalescing`, when inside a group.
    group: Option<Vec<CommLabel>>,
    /// The MoE dispatches that carry their combine's weights.
    moe: MoeWeightPairs,
}

impl<'p> Plan<'p> {
    /// Compiles `program` for `rank`.
    pub fn build<B: Backend>(
        program: &'p HostProgram,
        backend: &B,
        rank: DeviceId,
    ) -> Result<Plan<'p>, RuntimeError> {
        let mut label_index = BTreeMap::new();
        let mut loop_vars = 0usize;
        let mut stream_vars = 0usize;
        program.walk(&mut |inst, _| {
            let mut label = |c: CommId| {
                let n = CommLabel::new(label_index.len());
                label_index.entry(c).or_insert(n);
            };
            if let Some(c) = inst.kind.comm_id() {
                label(c);
            }
            match &inst.kind {
                InstKind::Wait { comm } => label(*comm),
                InstKind::ForLoop { index, .. } => loop_vars = loop_vars.max(index.0 as usize + 1),
                InstKind::GetCurrentStream { dst } => {
                    stream_vars = stream_vars.max(dst.0 as usize + 1)
                }
                InstKind::SetCurrentStream {
                    stream: StreamRef::Var(v),
                }
                | InstKind::Synchronize {
                    stream: StreamRef::Var(v),
                } => stream_vars = stream_vars.max(v.0 as usize + 1),
                _ => {}
            }
        });
        let mut comms: Arena<CommLabel, CommInfo> = table(
            label_index.len(),
            CommInfo {
                comm: CommId(0),
                name: "wait",
                op: None,
                team: None,
                grouped: false,
                moe_weights: None,
            },
        );
        for (&c, &l) in &label_index {
            comms[l].comm = c;
        }
        let my = program
            .meshes
            .values()
            .map(|m| {
                let mut out = [None; 3];
                for pt in meshflow_ir::ParallelType::DEVICE {
                    if let (Some(k), Some(i)) = (pt.device_rank(), m.mesh.team_index(rank, pt)) {
                        out[k] = Some(i as i64);
                    }
                }
                out
            })
            .collect();
        let mut held = Arena::new();
        for t in program.tensors.values() {
            held.push(
                program
                    .meshes
                    .get(t.mesh)
                    .is_some_and(|m| m.mesh.contains(rank)),
            );
        }
        let labels = label_index.len();
        let mut b = Builder {
            program,
            backend,
            rank,
            plan: Plan {
                insts: Arena::new(),
                enclosing: Arena::new(),
                steps: Vec::new(),
                teams: Arena::new(),
                group_of: table(labels, None),
                comms,
                loop_vars,
                stream_vars,
                my,
                held,
            },
            posted: table(labels, false),
            label_index,
            team_index: BTreeMap::new(),
            loop_stack: Vec::new(),
            group: None,
            moe: pair_moe_weights(program),
        };
        let steps = b.block(&program.body)?;
        // Drop waits on labels this rank never posts.
        let posted = std::mem::take(&mut b.posted);
        let mut plan = b.plan;
        plan.steps = prune_waits(steps, &posted);
        Ok(plan)
    }
}

fn prune_waits<'p>(steps: Vec<Step<'p>>, posted: &Arena<CommLabel, bool>) -> Vec<Step<'p>> {
    steps
        .into_iter()
        .filter_map(|s| match s {
            Step::Wait { label, .. } if !posted[label] => None,
            Step::Loop {
                at,
                var,
                start,
                stop,
                body,
            } => Some(Step::Loop {
                at,
                var,
                start,
                stop,
                body: prune_waits(body, posted),
            }),
            s => Some(s),
        })
        .collect()
}

impl<'p, B: Backend> Builder<'p, '_, B> {
    fn err(&self, at: PreorderIndex, message: String) -> RuntimeError {
        let inst = self.plan.insts[at];
        RuntimeError::Plan {
            rank: self.rank,
            inst: meshflow_ir::text::inst_to_string(self.program, inst),
            message,
        }
    }

    fn tensor(&self, at: PreorderIndex, t: HostTensorId) -> Result<HostTensorId, RuntimeError> {
        if self.program.tensors.contains(t) {
            Ok(t)
        } else {
            Err(self.err(at, format!("names unknown tensor {t:?}")))
        }
    }

    fn held(&self, t: HostTensorId) -> bool {
        self.plan.held[t]
    }

    fn name(&self, t: HostTensorId) -> &str {
        &self.program.tensors[t].name
    }

    /// All tensors held, none held (`Ok(false)`: skip), or an error naming the missing one.
    fn all_or_none(&self, at: PreorderIndex, ts: &[HostTensorId]) -> Result<bool, RuntimeError> {
        let (Some(&have), Some(&miss)) = (
            ts.iter().find(|&&t| self.held(t)),
            ts.iter().find(|&&t| !self.held(t)),
        ) else {
            return Ok(ts.iter().all(|&t| self.held(t)));
        };
        Err(self.err(
            at,
            format!(
                "rank {} holds `{}` but not `{}` (their meshes differ)",
                self.rank,
                self.name(have),
                self.name(miss)
            ),
        ))
    }

    /// The team of `team` on this rank, or `None` when the rank is not a member.
    fn team(&mut self, team: &Team) -> Option<TeamId> {
        let members = team.resolve(&self.program.meshes, self.rank)?;
        let my_index = members.iter().position(|&d| d == self.rank)?;
        let next = TeamId::new(self.plan.teams.len());
        let id = *self.team_index.entry(members.clone()).or_insert(next);
        if id == next {
            self.plan.teams.push(TeamInfo {
                id,
                members,
                my_index,
            });
        }
        Some(id)
    }

    fn label(&mut self, c: CommId) -> CommLabel {
        // Every label was collected before building.
        self.label_index[&c]
    }

    /// Records that this rank posts `c` (what, in which team) and returns its label.
    fn post(
        &mut self,
        at: PreorderIndex,
        c: CommId,
        op: CommOp,
        team: Option<TeamId>,
    ) -> CommLabel {
        let l = self.label(c);
        self.posted[l] = true;
        let info = &mut self.plan.comms[l];
        if info.op.is_none() {
            info.name = self.plan.insts[at].kind.name();
            info.op = Some(op);
            info.team = team;
            info.grouped = self.group.is_some();
        }
        if let Some(g) = self.group.as_mut() {
            g.push(l);
        }
        l
    }

    fn block(&mut self, block: &'p [Inst]) -> Result<Vec<Step<'p>>, RuntimeError> {
        let mut steps = Vec::with_capacity(block.len());
        for inst in block {
            if u32::try_from(self.plan.insts.len()).is_err() {
                return Err(self.err(PreorderIndex(0), "too many instructions".into()));
            }
            let at = self.plan.insts.push(inst);
            self.plan.enclosing.push(self.loop_stack.clone());
            if let Some(step) = self.inst(at, inst)? {
                steps.push(step);
            }
        }
        Ok(steps)
    }

    fn inst(
        &mut self,
        at: PreorderIndex,
        inst: &'p Inst,
    ) -> Result<Option<Step<'p>>, RuntimeError> {
        let step = match &inst.kind {
            InstKind::Allocate { tensor } | InstKind::Deallocate { tensor } => {
                let t = self.tensor(at, *tensor)?;
                if !self.held(t) {
                    return Ok(None);
                }
                if matches!(inst.kind, InstKind::Allocate { .. }) {
                    Step::Allocate { at, tensor: t }
                } else {
                    Step::Deallocate { at, tensor: t }
                }
            }
            InstKind::ForLoop {
                index,
                start,
                stop,
                body,
            } => {
                self.loop_stack.push(*index);
                let body = self.block(body);
                self.loop_stack.pop();
                Step::Loop {
                    at,
                    var: *index,
                    start,
                    stop,
                    body: body?,
                }
            }
            InstKind::GetCurrentStream { dst } => Step::GetStream { at, dst: *dst },
            InstKind::SetCurrentStream { stream } => Step::SetStream {
                at,
                stream: stream_sel(stream),
            },
            InstKind::Synchronize { stream } => Step::Sync {
                at,
                stream: stream_sel(stream),
            },
            InstKind::ShardByStream {
                out,
                input,
                axis,
                chunks,
                index,
            } => {
                let (o, i) = (self.tensor(at, *out)?, self.tensor(at, *input)?);
                if !self.all_or_none(at, &[o, i])? {
                    return Ok(None);
                }
                Step::Shard {
                    at,
                    out: o,
                    input: i,
                    axis: *axis,
                    chunks: *chunks,
                    index,
                }
            }
            InstKind::Narrow {
                out,
                input,
                axis,
                start,
                length,
            } => {
                let (o, i) = (self.tensor(at, *out)?, self.tensor(at, *input)?);
                if !self.all_or_none(at, &[o, i])? {
                    return Ok(None);
                }
                Step::Narrow {
                    at,
                    out: o,
                    input: i,
                    axis: *axis,
                    start,
                    length,
                }
            }
            InstKind::Communication {
                id,
                kind,
                team,
                input,
                output,
                root,
                op,
            } => {
                let Some(team) = self.team(team) else {
                    return Ok(None);
                };
                let (i, o) = (self.tensor(at, *input)?, self.tensor(at, *output)?);
                let op = op.unwrap_or(ReduceOp::Sum);
                let dtype = self.program.tensors[i].dtype;
                let what = CommOp::Collective {
                    kind: *kind,
                    op,
                    dtype,
                };
                Step::Collective {
                    at,
                    label: self.post(at, *id, what, Some(team)),
                    kind: *kind,
                    team,
                    input: self.held(i).then_some(i),
                    output: self.held(o).then_some(o),
                    root: root.as_ref(),
                    op,
                }
            }
            InstKind::CollectivePermute {
                id,
                team,
                send_peer,
                recv_peer,
                input,
                output,
            } => {
                let Some(team) = self.team(team) else {
                    return Ok(None);
                };
                let (i, o) = (self.tensor(at, *input)?, self.tensor(at, *output)?);
                if !self.all_or_none(at, &[i, o])? {
                    return Err(self.err(
                        at,
                        format!("rank {} is in the team but holds neither buffer", self.rank),
                    ));
                }
                Step::Permute {
                    at,
                    label: self.post(at, *id, CommOp::Permute, Some(team)),
                    team,
                    send: send_peer,
                    recv: recv_peer,
                    input: i,
                    output: o,
                }
            }
            InstKind::MoeDispatch {
                id,
                team,
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                wire,
            } => {
                let Some(team) = self.team(team) else {
                    return Ok(None);
                };
                let t = self.five(at, [*x, *topk_idx, *expert_x, *expert_counts, *routing])?;
                let weights = self.moe.early.get(id).copied();
                if let Some(w) = weights {
                    self.five(at, [w; 5])?;
                }
                let label = self.post(at, *id, CommOp::MoeDispatch, Some(team));
                self.plan.comms[label].moe_weights = Some(if weights.is_some() {
                    MoeWeightsAt::Dispatch
                } else {
                    MoeWeightsAt::Combine
                });
                Step::Dispatch {
                    at,
                    label,
                    team,
                    t,
                    wire: *wire,
                    weights,
                }
            }
            InstKind::MoeCombine {
                id,
                team,
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
            } => {
                let Some(team) = self.team(team) else {
                    return Ok(None);
                };
                let t = self.five(
                    at,
                    [*expert_y, *expert_counts, *routing, *topk_weights, *out],
                )?;
                let early = self.moe.combine_of.get(id).map(|d| self.label_index[d]);
                let label = self.post(at, *id, CommOp::MoeCombine, Some(team));
                self.plan.comms[label].moe_weights = Some(if early.is_some() {
                    MoeWeightsAt::Dispatch
                } else {
                    MoeWeightsAt::Combine
                });
                Step::Combine {
                    at,
                    label,
                    team,
                    t,
                    early,
                }
            }
            InstKind::Wait { comm } => Step::Wait {
                at,
                label: self.label(*comm),
            },
            InstKind::StartCoalescing => {
                self.group = Some(Vec::new());
                Step::BeginGroup { at }
            }
            InstKind::EndCoalescing { id } => {
                let members = self.group.take().unwrap_or_default();
                let label = self.post(at, *id, CommOp::Group, None);
                for m in members {
                    self.plan.group_of[m] = Some(label);
                }
                Step::EndGroup { at, label }
            }
            InstKind::Compute {
                op,
                inputs,
                outputs,
            } => {
                let (ins, outs) = (self.tensors(at, inputs)?, self.tensors(at, outputs)?);
                let all: Vec<HostTensorId> = ins.iter().chain(&outs).copied().collect();
                if !self.all_or_none(at, &all)? {
                    return Ok(None);
                }
                Step::Compute {
                    at,
                    op,
                    inputs: ins,
                    outputs: outs,
                }
            }
            InstKind::CallKernel {
                kernel,
                inputs,
                outputs,
                args,
            } => {
                let (ins, outs) = (self.tensors(at, inputs)?, self.tensors(at, outputs)?);
                let all: Vec<HostTensorId> = ins.iter().chain(&outs).copied().collect();
                if !self.all_or_none(at, &all)? {
                    return Ok(None);
                }
                let id = self.backend.kernel(kernel).ok_or_else(|| {
                    self.err(at, format!("no kernel named `{kernel}` is registered"))
                })?;
                Step::Kernel {
                    at,
                    kernel: id,
                    inputs: ins,
                    outputs: outs,
                    args,
                }
            }
        };
        Ok(Some(step))
    }

    fn tensors(
        &self,
        at: PreorderIndex,
        ts: &[HostTensorId],
    ) -> Result<Vec<HostTensorId>, RuntimeError> {
        ts.iter().map(|&t| self.tensor(at, t)).collect()
    }

    fn five(
        &self,
        at: PreorderIndex,
        ts: [HostTensorId; 5],
    ) -> Result<[HostTensorId; 5], RuntimeError> {
        for &t in &ts {
            let t = self.tensor(at, t)?;
            if !self.held(t) {
                return Err(self.err(
                    at,
                    format!(
                        "rank {} is in the team but does not hold `{}`",
                        self.rank,
                        self.name(t)
                    ),
                ));
            }
        }
        Ok(ts)
    }
}

fn stream_sel(s: &StreamRef) -> StreamSel<'_> {
    match s {
        StreamRef::Var(v) => StreamSel::Var(*v),
        StreamRef::Worker(e) => StreamSel::Worker(e),
    }
}
