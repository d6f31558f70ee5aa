//! Execution of compiled steps.

use std::time::Instant;

use meshflow_ir::{
    Arena, DeviceId, EntityRef, Expr, HostProgram, HostTensor, HostTensorId, LoopVar, MeshId,
    ParallelType,
};

use meshflow_ir::host::{EvalError, ExprEnv};

use super::plan::{Plan, Step, StreamSel};
use super::{SentWeights, State, StepError};
use meshflow_passes::Transport;

use crate::runtime::backend::{
    Backend, CommLabel, CommRequest, InstCtx, MoeWeightsAt, PreorderIndex, StreamIndex, TeamId,
    TensorView,
};
use crate::runtime::trace::TraceEvent;

/// A failed step: its instruction, the loop values, the error.
pub(super) type Failure = (PreorderIndex, Vec<i64>, StepError);

pub(super) struct Cx<'a, 'p, B: Backend> {
    pub program: &'p HostProgram,
    pub plan: &'a Plan<'p>,
    pub backend: &'a mut B,
    pub state: &'a mut State<B>,
    pub trace_epoch: Option<Instant>,
    pub texts: &'a Arena<PreorderIndex, String>,
}

struct Env<'a> {
    loops: &'a [Option<i64>],
    my: &'a [[Option<i64>; 3]],
    rank: DeviceId,
}

impl ExprEnv for Env<'_> {
    fn loop_value(&self, var: LoopVar) -> Option<i64> {
        self.loops.get(var.0 as usize).copied().flatten()
    }

    fn my_index(&self, mesh: MeshId, pt: ParallelType) -> Option<i64> {
        self.my.get(mesh.index())?[pt.device_rank()?]
    }

    fn rank(&self) -> DeviceId {
        self.rank
    }
}

fn invalid(message: impl Into<String>) -> StepError {
    StepError::Invalid(message.into())
}

impl<'p, B: Backend> Cx<'_, 'p, B> {
    fn eval(&self, e: &Expr) -> Result<i64, EvalError> {
        e.eval(&Env {
            loops: &self.state.loops,
            my: &self.plan.my,
            rank: self.backend.device(),
        })
    }

    fn name(&self, t: HostTensorId) -> &str {
        &self.program.tensors[t].name
    }

    fn view(&self, t: HostTensorId) -> Result<&TensorView<B::Buffer>, StepError> {
        view_in(self.program, &self.state.views, t)
    }

    fn stream(&self, sel: &StreamSel<'_>) -> Result<StreamIndex, StepError> {
        match sel {
            StreamSel::Var(v) => self
                .state
                .saved
                .get(v.0 as usize)
                .copied()
                .flatten()
                .ok_or_else(|| {
                    invalid(format!(
                        "stream variable {v} is used before get_current_stream"
                    ))
                }),
            StreamSel::Worker(e) => {
                let pool = self.backend.stream_pool_size().max(1) as i64;
                Ok(StreamIndex::worker(self.eval(e)?.rem_euclid(pool) as usize))
            }
        }
    }

    fn team_index(&self, e: &Expr, team: TeamId, what: &str) -> Result<usize, StepError> {
        let v = self.eval(e)?;
        let size = self.plan.team(team).members.len();
        usize::try_from(v)
            .ok()
            .filter(|&i| i < size)
            .ok_or_else(|| invalid(format!("{what} {v} is not a team index in 0..{size}")))
    }

    /// Runs a block; on failure returns the failing instruction and its loop values.
    pub fn block(&mut self, steps: &[Step<'p>]) -> Result<(), Failure> {
        for step in steps {
            if let Step::Loop {
                at,
                var,
                start,
                stop,
                body,
            } = step
            {
                let fail = |s: &Self, e: StepError| (*at, s.state.iteration.clone(), e);
                let lo = self.eval(start).map_err(|e| fail(self, e.into()))?;
                let hi = self.eval(stop).map_err(|e| fail(self, e.into()))?;
                let slot = var.0 as usize;
                for v in lo..hi {
                    self.state.loops[slot] = Some(v);
                    self.state.iteration.push(v);
                    let r = self.block(body);
                    self.state.iteration.pop();
                    r?;
                }
                self.state.loops[slot] = None;
                continue;
            }
            let at = step_at(step);
            self.state.at = Some(at);
            let started = self.trace_epoch.map(|_| Instant::now());
            let stream = self.state.current;
            if let Err(e) = self.step(at, step) {
                return Err((at, self.state.iteration.clone(), e));
            }
            if let (Some(epoch), Some(t0)) = (self.trace_epoch, started) {
                let label = step_label(step);
                let transport = label.and_then(|l| self.backend.transport_of(l));
                let moe_weights = label.and_then(|l| self.plan.comms[l].moe_weights);
                self.record(epoch, t0, at, stream, (transport, moe_weights));
            }
        }
        Ok(())
    }

    fn record(
        &mut self,
        epoch: Instant,
        t0: Instant,
        at: PreorderIndex,
        stream: StreamIndex,
        (transport, moe_weights): (Option<Transport>, Option<MoeWeightsAt>),
    ) {
        let inst = self.plan.insts[at];
        self.state.trace.push(TraceEvent {
            rank: self.backend.device(),
            stream: stream.0,
            name: inst.kind.name(),
            text: self.texts.get(at).cloned().unwrap_or_default(),
            iteration: self.state.iteration.clone(),
            start_us: t0.duration_since(epoch).as_secs_f64() * 1e6,
            dur_us: t0.elapsed().as_secs_f64() * 1e6,
            transport,
            moe_weights,
        });
    }

    fn step(&mut self, at: PreorderIndex, step: &Step<'p>) -> Result<(), StepError> {
        // The loop values are copied into a reused buffer so that the state keeps them (for
        // reports after a panic) while the step borrows the state mutably.
        let mut iteration = std::mem::take(&mut self.state.scratch);
        iteration.clear();
        iteration.extend_from_slice(&self.state.iteration);
        let r = self.step_inner(at, step, &iteration);
        self.state.scratch = iteration;
        r
    }

    fn step_inner(
        &mut self,
        at: PreorderIndex,
        step: &Step<'p>,
        iteration: &[i64],
    ) -> Result<(), StepError> {
        let ctx = InstCtx {
            preorder: at,
            iteration,
        };
        match step {
            Step::Loop { .. } => Ok(()),
            Step::Allocate { tensor, .. } => self.allocate(*tensor),
            Step::Deallocate { tensor, .. } => self.deallocate(*tensor),
            Step::GetStream { dst, .. } => {
                self.state.saved[dst.0 as usize] = Some(self.state.current);
                Ok(())
            }
            Step::SetStream { stream, .. } => {
                let s = self.stream(stream)?;
                self.backend.set_current_stream(s)?;
                self.state.current = s;
                Ok(())
            }
            Step::Sync { stream, .. } => {
                let s = self.stream(stream)?;
                Ok(self.backend.synchronize(s, ctx)?)
            }
            Step::Shard {
                out,
                input,
                axis,
                chunks,
                index,
                ..
            } => self.shard(*out, *input, *axis, *chunks, index),
            Step::Narrow {
                out,
                input,
                axis,
                start,
                length,
                ..
            } => self.narrow(*out, *input, *axis, start, length),
            Step::Collective {
                label,
                kind,
                team,
                input,
                output,
                root,
                op,
                ..
            } => {
                let root = match root {
                    Some(r) => Some(self.team_index(r, *team, "root")?),
                    None if kind.is_rooted() => {
                        return Err(invalid(format!("{} needs a root", kind.name())))
                    }
                    None => None,
                };
                let views = &self.state.views;
                let input = input.map(|t| view_in(self.program, views, t)).transpose()?;
                let output = output
                    .map(|t| view_in(self.program, views, t))
                    .transpose()?;
                let req = CommRequest::Collective {
                    label: *label,
                    kind: *kind,
                    team: self.plan.team(*team),
                    input,
                    output,
                    root,
                    op: *op,
                };
                let handle = self.backend.post(&req, ctx)?;
                self.state.pending[*label] = Some(handle);
                Ok(())
            }
            Step::Permute {
                label,
                team,
                send,
                recv,
                input,
                output,
                ..
            } => {
                let send_peer = self.team_index(send, *team, "send peer")?;
                let recv_peer = self.team_index(recv, *team, "recv peer")?;
                let views = &self.state.views;
                let req = CommRequest::Permute {
                    label: *label,
                    team: self.plan.team(*team),
                    send_peer,
                    recv_peer,
                    input: view_in(self.program, views, *input)?,
                    output: view_in(self.program, views, *output)?,
                };
                let handle = self.backend.post(&req, ctx)?;
                self.state.pending[*label] = Some(handle);
                Ok(())
            }
            Step::Dispatch {
                label,
                team,
                t,
                wire,
                weights,
                ..
            } => {
                if !self.backend.supports_moe_wire(*wire) {
                    return Err(invalid(format!(
                        "rank {}: this backend cannot move MoE tokens as `{wire}` yet (its \
                         moe_dispatch supports the native wire only)",
                        self.backend.device()
                    )));
                }
                let views = &self.state.views;
                let req = CommRequest::MoeDispatch {
                    label: *label,
                    team: self.plan.team(*team),
                    x: view_in(self.program, views, t[0])?,
                    topk_idx: view_in(self.program, views, t[1])?,
                    expert_x: view_in(self.program, views, t[2])?,
                    expert_counts: view_in(self.program, views, t[3])?,
                    routing: view_in(self.program, views, t[4])?,
                    wire: *wire,
                    topk_weights: weights
                        .map(|w| view_in(self.program, views, w))
                        .transpose()?,
                };
                let sent = match &req {
                    CommRequest::MoeDispatch {
                        topk_weights: Some(w),
                        ..
                    } => Some(SentWeights::of(w)),
                    _ => None,
                };
                let handle = self.backend.post(&req, ctx)?;
                self.state.pending[*label] = Some(handle);
                self.state.moe_sent[*label] = sent;
                Ok(())
            }
            Step::Combine {
                label,
                team,
                t,
                early,
                ..
            } => {
                let views = &self.state.views;
                if let Some(d) = early {
                    let w = view_in(self.program, views, t[3])?;
                    if self.state.moe_sent[*d].as_ref() != Some(&SentWeights::of(w)) {
                        return Err(invalid(format!(
                            "`{}` is not the weights view its moe_dispatch {} carried (the \
                             dispatch sent the top-k weights with the tokens; the combine must \
                             name the same, unchanged view)",
                            self.program.tensors[t[3]].name,
                            self.plan
                                .comm(*d)
                                .map_or_else(String::new, |c| format!("c{}", c.0)),
                        )));
                    }
                }
                let req = CommRequest::MoeCombine {
                    label: *label,
                    team: self.plan.team(*team),
                    expert_y: view_in(self.program, views, t[0])?,
                    expert_counts: view_in(self.program, views, t[1])?,
                    routing: view_in(self.program, views, t[2])?,
                    topk_weights: view_in(self.program, views, t[3])?,
                    out: view_in(self.program, views, t[4])?,
                };
                let handle = self.backend.post(&req, ctx)?;
                self.state.pending[*label] = Some(handle);
                Ok(())
            }
            Step::Wait { label, .. } => {
                if let Some(c) = &self.state.pending[*label] {
                    self.backend.wait(c, ctx)?;
                } else {
                    tracing::trace!("wait on a label with no instance posted yet: no-op");
                }
                Ok(())
            }
            Step::BeginGroup { .. } => {
                if self.state.in_group {
                    return Err(invalid("start_coalescing inside another group"));
                }
                self.backend.begin_group()?;
                self.state.in_group = true;
                Ok(())
            }
            Step::EndGroup { label, .. } => {
                if !self.state.in_group {
                    return Err(invalid("end_coalescing without start_coalescing"));
                }
                self.state.in_group = false;
                let handle = self.backend.end_group(*label, ctx)?;
                self.state.pending[*label] = Some(handle);
                Ok(())
            }
            Step::Compute {
                op,
                inputs,
                outputs,
                ..
            } => {
                let views = &self.state.views;
                let ins = views_in(self.program, views, inputs)?;
                let outs = views_in(self.program, views, outputs)?;
                // An empty piece of an uneven shard: nothing to compute.
                if !outs.is_empty() && outs.iter().all(|o| o.numel() == 0) {
                    return Ok(());
                }
                Ok(self.backend.compute(op, &ins, &outs, ctx)?)
            }
            Step::Kernel {
                kernel,
                inputs,
                outputs,
                args,
                ..
            } => {
                let mut values = std::mem::take(&mut self.state.args);
                values.clear();
                for a in args.iter() {
                    match self.eval(a) {
                        Ok(v) => values.push(v),
                        Err(e) => {
                            self.state.args = values;
                            return Err(e.into());
                        }
                    }
                }
                let views = &self.state.views;
                let program = self.program;
                let backend = &mut *self.backend;
                let r = (|| {
                    let ins = views_in(program, views, inputs)?;
                    let outs = views_in(program, views, outputs)?;
                    Ok::<_, StepError>(backend.call_kernel(*kernel, &ins, &outs, &values, ctx)?)
                })();
                self.state.args = values;
                r
            }
        }
    }

    fn allocate(&mut self, id: HostTensorId) -> Result<(), StepError> {
        let t = id;
        let decl = &self.program.tensors[id];
        match decl.role {
            meshflow_ir::Role::Input => {
                return Err(invalid(format!(
                    "`{}` is an input; it cannot be allocated",
                    decl.name
                )))
            }
            // Bound at the start of the run (allocated there, or a caller-owned buffer).
            meshflow_ir::Role::Output if self.state.views[t].is_some() => return Ok(()),
            _ => {}
        }
        if let Some(old) = self.state.owned[t].take() {
            self.backend.deallocate(old)?;
        }
        let buffer = self.backend.allocate(decl.dtype, &decl.shape)?;
        self.state.owned[t] = Some(buffer);
        self.state.views[t] = Some(TensorView {
            tensor: id,
            buffer,
            dtype: decl.dtype,
            offset: 0,
            strides: crate::runtime::view::contiguous_strides(&decl.shape),
            shape: decl.shape.clone(),
        });
        Ok(())
    }

    fn deallocate(&mut self, t: HostTensorId) -> Result<(), StepError> {
        let decl = &self.program.tensors[t];
        if decl.role != meshflow_ir::Role::Internal {
            return Err(invalid(format!(
                "`{}` is a program {}; it cannot be deallocated",
                decl.name,
                if decl.role == meshflow_ir::Role::Input {
                    "input"
                } else {
                    "output"
                }
            )));
        }
        let buffer = self.state.owned[t]
            .take()
            .ok_or_else(|| invalid(format!("`{}` is not allocated", decl.name)))?;
        self.state.views[t] = None;
        Ok(self.backend.deallocate(buffer)?)
    }

    /// `out` = chunk `index` of `chunks` equal chunks of `input` along `axis`.
    fn shard(
        &mut self,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        chunks: u64,
        index: &Expr,
    ) -> Result<(), StepError> {
        let i = self.eval(index)?;
        let program = self.program;
        self.bind_range(
            out,
            input,
            axis,
            |extent, _| {
                if chunks == 0 || extent % chunks != 0 {
                    return Err(invalid(format!(
                        "{chunks} chunks do not divide axis {axis} of `{}` (extent {extent})",
                        program.tensors[input].name
                    )));
                }
                let index = u64::try_from(i)
                    .ok()
                    .filter(|&x| x < chunks)
                    .ok_or_else(|| invalid(format!("chunk index {i} is outside 0..{chunks}")))?;
                let part = extent / chunks;
                Ok((index * part, part))
            },
            Fit::Exact,
        )
    }

    /// `out` = elements `[start, start + length)` of `input` along `axis`.
    fn narrow(
        &mut self,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        start: &Expr,
        length: &Expr,
    ) -> Result<(), StepError> {
        let (s, l) = (self.eval(start)?, self.eval(length)?);
        let program = self.program;
        self.bind_range(
            out,
            input,
            axis,
            |extent, decl| {
                let cap = decl.shape.get(axis).copied().unwrap_or(0);
                match (u64::try_from(s), u64::try_from(l)) {
                    (Ok(s), Ok(l)) if s.checked_add(l).is_some_and(|e| e <= extent) && l <= cap => {
                        Ok((s, l))
                    }
                    _ => Err(invalid(format!(
                        "elements [{s}, {s} + {l}) along axis {axis} do not fit `{}` (extent \
                         {extent}) or the capacity {cap} of `{}`",
                        program.tensors[input].name, decl.name
                    ))),
                }
            },
            Fit::Within,
        )
    }

    /// Makes `out` the view of elements `[start, start + len)` of `input` along `axis`, where
    /// `range` picks `(start, len)` from the extent of that axis and the declaration of `out`,
    /// and the view must `fit` that declaration. On an error `out` is left without a view.
    fn bind_range(
        &mut self,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        range: impl FnOnce(u64, &HostTensor) -> Result<(u64, u64), StepError>,
        fit: Fit,
    ) -> Result<(), StepError> {
        let mut slot = self.state.views[out].take();
        let r = (|| {
            let parent = self.view(input)?;
            let extent = *parent.shape.get(axis).ok_or_else(|| {
                invalid(format!(
                    "axis {axis} out of range for `{}` of shape {:?}",
                    self.name(input),
                    parent.shape
                ))
            })?;
            let decl = &self.program.tensors[out];
            let (start, len) = range(extent, decl)?;
            let view = slot.get_or_insert_with(|| TensorView {
                tensor: out,
                buffer: parent.buffer,
                dtype: parent.dtype,
                offset: 0,
                shape: Vec::new(),
                strides: Vec::new(),
            });
            view.tensor = out;
            view.buffer = parent.buffer;
            view.dtype = parent.dtype;
            view.shape.clone_from(&parent.shape);
            view.strides.clone_from(&parent.strides);
            view.shape[axis] = len;
            view.offset = parent.offset + start * parent.strides[axis];
            fit.check(view, decl)
        })();
        if r.is_err() {
            slot = None;
        }
        self.state.views[out] = slot;
        r
    }
}

/// How a view bound by [`Cx::bind_range`] must match the declaration of its tensor.
#[derive(Clone, Copy, Debug)]
enum Fit {
    /// The declared shape exactly (a chunk of `shard_by_stream`, [`Cx::shard`]).
    Exact,
    /// At most the declared extents, which are capacities: the view of an uneven piece may be
    /// shorter ([`Cx::narrow`]).
    Within,
}

impl Fit {
    /// Accepts `view` as the tensor `decl` declares: its dtype, and a shape that fits.
    fn check<Buf>(self, view: &TensorView<Buf>, decl: &HostTensor) -> Result<(), StepError> {
        let (fits, what) = match self {
            Fit::Exact => (decl.shape == view.shape, "the chunk"),
            Fit::Within => (
                decl.shape.len() == view.shape.len()
                    && decl.shape.iter().zip(&view.shape).all(|(d, v)| v <= d),
                "the narrowed view",
            ),
        };
        if fits && decl.dtype == view.dtype {
            return Ok(());
        }
        Err(invalid(format!(
            "{what} is {}{:?} but `{}` is declared {}{:?}",
            view.dtype, view.shape, decl.name, decl.dtype, decl.shape
        )))
    }
}

/// The view of tensor `t` (a free function so that it borrows only the view table).
fn view_in<'s, Buf>(
    program: &HostProgram,
    views: &'s Arena<HostTensorId, Option<TensorView<Buf>>>,
    t: HostTensorId,
) -> Result<&'s TensorView<Buf>, StepError> {
    views[t].as_ref().ok_or_else(|| {
        invalid(format!(
            "`{}` has no buffer here (not allocated, or deallocated)",
            program.tensors[t].name
        ))
    })
}

/// The views of `tensors`, in order (see [`view_in`]).
fn views_in<'s, Buf>(
    program: &HostProgram,
    views: &'s Arena<HostTensorId, Option<TensorView<Buf>>>,
    tensors: &[HostTensorId],
) -> Result<Vec<&'s TensorView<Buf>>, StepError> {
    tensors
        .iter()
        .map(|&t| view_in(program, views, t))
        .collect()
}

/// The communication label a step posts, if it posts one.
fn step_label(step: &Step<'_>) -> Option<CommLabel> {
    match step {
        Step::Collective { label, .. }
        | Step::Permute { label, .. }
        | Step::Dispatch { label, .. }
        | Step::Combine { label, .. }
        | Step::EndGroup { label, .. } => Some(*label),
        Step::Allocate { .. }
        | Step::Deallocate { .. }
        | Step::Loop { .. }
        | Step::GetStream { .. }
        | Step::SetStream { .. }
        | Step::Sync { .. }
        | Step::Shard { .. }
        | Step::Narrow { .. }
        | Step::Wait { .. }
        | Step::BeginGroup { .. }
        | Step::Compute { .. }
        | Step::Kernel { .. } => None,
    }
}

fn step_at(step: &Step<'_>) -> PreorderIndex {
    match step {
        Step::Allocate { at, .. }
        | Step::Deallocate { at, .. }
        | Step::Loop { at, .. }
        | Step::GetStream { at, .. }
        | Step::SetStream { at, .. }
        | Step::Sync { at, .. }
        | Step::Shard { at, .. }
        | Step::Narrow { at, .. }
        | Step::Collective { at, .. }
        | Step::Permute { at, .. }
        | Step::Dispatch { at, .. }
        | Step::Combine { at, .. }
        | Step::Wait { at, .. }
        | Step::BeginGroup { at }
        | Step::EndGroup { at, .. }
        | Step::Compute { at, .. }
        | Step::Kernel { at, .. } => *at,
    }
}
