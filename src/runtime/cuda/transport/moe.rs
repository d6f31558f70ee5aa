//! MoE dispatch and combine requests on GPUs, shared by the two MoE transports
//! (`moe_nccl.rs`, `moe_nvlink.rs`): an [`MoeTeams`] keeps one engine of `meshflow-kernels`
//! ([`MoeTransport`]) per team and layer shape, made at the first dispatch and reused by later
//! steps and runs; the engine source ([`EngineSource`]) says how engines are made and
//! released.
//!
//! A dispatch writes the program's `expert_x`, `expert_counts` and `routing` in place (the
//! engine's [`DispatchOutputs`]; no copy out of the engine's own buffers): a view that is
//! strided, shares a buffer with an input, or breaks the kernels' alignment (16 bytes for
//! FP8 dispatch's `expert_x`, 8 for `routing`) is written through a temporary instead. Padding
//! rows (past each count) are left as they were: unspecified, as `meshflow_ir::moe` allows
//! GPU transports (the combine never reads them). The engine is sized at the dispatch,
//! before the expert width `F` of the combine is known: it is made with `F = H`, and a combine
//! with `F < H` runs on zero-padded rows (`F > H` is refused with an error saying so). Leading
//! batch axes (`[B.., T, H]`) are not supported on GPUs yet. Capacity overflows and bad
//! routing raised on the device are reported when the run finishes.
//!
//! The top-k weights go to the engine at the dispatch when the request carries them (the
//! evaluator's choice, `runtime/evaluator/moe_weights.rs`): they travel with the rows, and the
//! combine then hands the engine none, after checking that it names the very view the
//! dispatch sent (else an error naming it). Otherwise the combine hands them over and the
//! engine first copies them to every peer (one more device exchange).

use meshflow_ir::{DType, DeviceId};
use meshflow_kernels::moe::{DispatchOutputs, DispatchRequest, MoeShape, MoeTransport, MoeWire};
use meshflow_kernels::{DType as KDType, DeviceBuffer, KernelError, StridedLayout};
use meshflow_passes::Transport;

use super::object::{CommTransport, PostCx, Posted};
use crate::runtime::backend::{BackendError, CommRequest, InstCtx, TeamInfo, TensorView};
use crate::runtime::cuda::core::{dev_err, DeviceCore};
use crate::runtime::cuda::layout::{kdtype, kwire};
use crate::runtime::cuda::memory::CudaBuffer;
use crate::runtime::cuda::operands::OutSlot;
use crate::runtime::cuda::profile::Opened;

type TV = TensorView<CudaBuffer>;

/// How the engines of one MoE transport are made and released.
pub(super) trait EngineSource {
    /// An engine (with whatever the source keeps beside it).
    type Engine;
    /// The transport the engines implement.
    const TRANSPORT: Transport;

    /// Makes this rank's engine of `team` for `shape`, encoding dispatched rows as `wire`.
    fn make(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<Self::Engine, BackendError>;

    /// The engine's dispatch/combine object.
    fn engine(e: &mut Self::Engine) -> &mut dyn MoeTransport;

    /// The first failure of a transfer the engine made without the host.
    fn route_failure(e: &Self::Engine) -> Option<KernelError> {
        let _ = e;
        None
    }

    /// Why a step with these engines cannot be recorded as a CUDA graph.
    fn capture_blocker(&self) -> Option<&'static str>;

    /// Releases an engine (healthy: its resources may be reused).
    fn release(e: Self::Engine, healthy: bool) {
        let _ = (e, healthy);
    }
}

/// One engine: a team, a shape, a wire, the engine.
struct Held<E> {
    members: Vec<DeviceId>,
    shape: MoeShape,
    wire: MoeWire,
    engine: E,
}

/// An MoE transport: the engines of one [`EngineSource`], by team and shape.
pub(super) struct MoeTeams<S: EngineSource> {
    source: S,
    engines: Vec<Held<S::Engine>>,
    /// The engine of the last dispatch (its combine follows).
    last: Option<usize>,
    /// The weights view the last dispatch carried, if it carried them (its combine must
    /// name the same view).
    sent: Option<TV>,
}

impl<S: EngineSource> MoeTeams<S> {
    pub fn new(source: S) -> MoeTeams<S> {
        MoeTeams {
            source,
            engines: Vec::new(),
            last: None,
            sent: None,
        }
    }

    fn engine(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        shape: MoeShape,
        wire: MoeWire,
    ) -> Result<usize, BackendError> {
        if let Some(i) = self
            .engines
            .iter()
            .position(|e| e.members == team.members && e.shape == shape && e.wire == wire)
        {
            return Ok(i);
        }
        let engine = self.source.make(cx, team, &shape, wire)?;
        self.engines.push(Held {
            members: team.members.clone(),
            shape,
            wire,
            engine,
        });
        Ok(self.engines.len() - 1)
    }

    /// `moe_dispatch(x, topk_idx -> expert_x, expert_counts, routing)`, rows encoded as
    /// `wire` on the way.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        cx: &mut PostCx<'_>,
        op: &mut OpenAtWork<'_>,
        team: &TeamInfo,
        x: &TV,
        topk_idx: &TV,
        expert_x: &TV,
        expert_counts: &TV,
        routing: &TV,
        wire: meshflow_ir::MoeWire,
        topk_weights: Option<&TV>,
    ) -> Result<(), BackendError> {
        const WHAT: &str = "moe_dispatch";
        self.sent = None;
        let rank = cx.core.rank;
        let [t, h] = dims(rank, WHAT, x, "x")?;
        let [_, k] = dims(rank, WHAT, topk_idx, "topk_idx")?;
        let [l, c, _] = dims(rank, WHAT, expert_x, "expert_x")?;
        if topk_idx.dtype != DType::I32
            || expert_counts.dtype != DType::I32
            || routing.dtype != DType::I32
        {
            return Err(invalid(
                rank,
                WHAT,
                "topk_idx, expert_counts and routing must be i32 on GPUs",
            ));
        }
        let shape = MoeShape {
            world: team.members.len(),
            experts: l * team.members.len(),
            top_k: k,
            tokens: t,
            hidden: h,
            out_hidden: h,
            capacity: c,
            dtype: kdtype(x.dtype),
        };
        let wire = kwire(wire);
        wire.validate(&shape)
            .map_err(|e| invalid(rank, WHAT, format!("`x` {:?}: {e}", x.shape)))?;
        let i = self.engine(cx, team, shape, wire)?;
        let core = &mut *cx.core;
        // The engine writes the outputs in place: their own bytes when the views are packed,
        // apart from the inputs and aligned as the kernels store (else a temporary, copied
        // into the view after).
        let x_align = if wire == MoeWire::Native { 1 } else { 16 };
        let targets = [
            OutTarget::new(core, expert_x, &[x, topk_idx], x_align)?,
            OutTarget::new(core, expert_counts, &[x, topk_idx], 4)?,
            OutTarget::new(core, routing, &[x, topk_idx], 8)?,
        ];
        // Host preparation ends here: the first device work follows.
        op.open(core)?;
        let mut xb = core.input_region(x)?;
        if wire != MoeWire::Native && !xb.is_aligned(16) {
            // FP8 dispatch reads `x` in 16-byte vectors: stage a view that starts elsewhere.
            let staged = core.temp(xb.len())?;
            staged
                .copy_from(core.stream(), &xb)
                .map_err(core.err("moe_dispatch (aligning x)"))?;
            xb = staged;
        }
        let ib = core.input_region(topk_idx)?;
        let weights = match topk_weights {
            Some(w) => {
                let [wt, wk] = dims(rank, WHAT, w, "topk_weights")?;
                if [wt, wk] != [t, k] {
                    return Err(invalid(
                        rank,
                        WHAT,
                        format!(
                            "the weights carried with the dispatch have shape {:?}, topk_idx {:?}",
                            w.shape, topk_idx.shape
                        ),
                    ));
                }
                let region = core.input_region(w)?;
                Some((f32_weights(core, w, region, WHAT)?, w.clone()))
            }
            None => None,
        };
        let s = core.stream().clone();
        let e = core.err(WHAT);
        let [tx, tc, tr] = &targets;
        let req = DispatchRequest {
            x: &xb,
            topk_idx: &ib,
            weights: weights.as_ref().map(|(b, _)| b),
            zero_padding: false,
            outputs: Some(DispatchOutputs {
                expert_x: tx.buf(),
                expert_counts: tc.buf(),
                routing: tr.buf(),
            }),
        };
        S::engine(&mut self.engines[i].engine)
            .dispatch_with(&s, &req)
            .map_err(&e)?;
        self.last = Some(i);
        self.sent = weights.map(|(_, sent)| sent);
        for t in targets {
            t.finish(core, WHAT)?;
        }
        Ok(())
    }

    /// `moe_combine(expert_y, expert_counts, routing, topk_weights -> out)`.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        cx: &mut PostCx<'_>,
        op: &mut OpenAtWork<'_>,
        team: &TeamInfo,
        expert_y: &TV,
        expert_counts: &TV,
        routing: &TV,
        topk_weights: &TV,
        out: &TV,
    ) -> Result<(), BackendError> {
        const WHAT: &str = "moe_combine";
        let core = &mut *cx.core;
        let rank = core.rank;
        let i = self
            .last
            .filter(|&i| {
                self.engines
                    .get(i)
                    .is_some_and(|e| e.members == team.members)
            })
            .ok_or_else(|| invalid(rank, WHAT, "no moe_dispatch of this team precedes it"))?;
        let shape = self.engines[i].shape;
        let [l, c, f] = dims(rank, WHAT, expert_y, "expert_y")?;
        let [t, f_out] = dims(rank, WHAT, out, "out")?;
        if l != shape.local_experts() || c != shape.capacity || t != shape.tokens || f != f_out {
            return Err(invalid(
                rank,
                WHAT,
                format!(
                    "expert_y {:?} / out {:?} do not match the dispatch {shape:?}",
                    expert_y.shape, out.shape
                ),
            ));
        }
        let h = shape.out_hidden;
        if f > h {
            return Err(invalid(
                rank,
                WHAT,
                format!("expert width F={f} is larger than the token width H={h}; the GPU MoE engine is sized at the dispatch and handles F <= H"),
            ));
        }
        let es = kdtype(expert_y.dtype).size_bytes();
        // Weights the dispatch carried are not handed over again: the combine must name them.
        let carried = match self.sent.take() {
            Some(sent) if sent == *topk_weights => true,
            Some(sent) => {
                return Err(invalid(
                    rank,
                    WHAT,
                    format!(
                        "`topk_weights` ({:?}: {:?} at offset {} of {:?}) is not the weights \
                         view its moe_dispatch carried ({:?}: {:?} at offset {} of {:?})",
                        topk_weights.tensor,
                        topk_weights.shape,
                        topk_weights.offset,
                        topk_weights.buffer,
                        sent.tensor,
                        sent.shape,
                        sent.offset,
                        sent.buffer
                    ),
                ))
            }
            None => false,
        };
        let slot = core.output_slot(out, &[expert_y, topk_weights])?;
        // Host preparation ends here: the first device work follows.
        op.open(core)?;
        let s = core.stream().clone();
        let e = core.err(WHAT);
        let y = core.input_region(expert_y)?;
        let counts = core.input_region(expert_counts)?;
        let routes = core.input_region(routing)?;
        let weights = if carried {
            None
        } else {
            let w = core.input_region(topk_weights)?;
            Some(f32_weights(core, topk_weights, w, WHAT)?)
        };
        let (y_in, out_buf) = if f == h {
            (y, None)
        } else {
            let yp = core.temp(l * c * h * es)?;
            yp.zero(&s).map_err(&e)?;
            let src = StridedLayout::contiguous(&[l * c, f]);
            let dst = StridedLayout {
                shape: vec![l * c, f],
                strides: vec![h, 1],
                offset: 0,
            };
            core.kernels
                .strided_copy(&s, kdtype(expert_y.dtype), &y, &src, &yp, &dst)
                .map_err(&e)?;
            (yp, Some(core.temp(t * h * es)?))
        };
        let target: DeviceBuffer = out_buf.clone().unwrap_or_else(|| slot.buf.clone());
        S::engine(&mut self.engines[i].engine)
            .combine(&s, &y_in, &counts, &routes, weights.as_ref(), &target)
            .map_err(&e)?;
        if let Some(ob) = out_buf {
            let src = StridedLayout {
                shape: vec![t, f],
                strides: vec![h, 1],
                offset: 0,
            };
            let dst = StridedLayout::contiguous(&[t, f]);
            core.kernels
                .strided_copy(&s, kdtype(out.dtype), &ob, &src, &slot.buf, &dst)
                .map_err(&e)?;
        }
        core.finish_output(slot)
    }
}

impl<S: EngineSource> CommTransport for MoeTeams<S> {
    fn kind(&self) -> Transport {
        S::TRANSPORT
    }

    fn post(
        &mut self,
        cx: &mut PostCx<'_>,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        let name = request.name();
        if cx.core.group.is_some() {
            return Err(invalid(
                cx.core.rank,
                name,
                "MoE ops cannot be coalesced on GPUs",
            ));
        }
        let mut op = OpenAtWork::new(name, S::TRANSPORT, ctx);
        match request {
            CommRequest::MoeDispatch {
                team,
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                wire,
                topk_weights,
                ..
            } => self.dispatch(
                cx,
                &mut op,
                team,
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                *wire,
                *topk_weights,
            )?,
            CommRequest::MoeCombine {
                team,
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
                ..
            } => self.combine(
                cx,
                &mut op,
                team,
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
            )?,
            CommRequest::Collective { .. } | CommRequest::Permute { .. } => {
                return Err(BackendError::Invalid(format!(
                    "{name} is not carried by an MoE transport"
                )))
            }
        }
        Ok(Posted::OnStream(op.into_opened(cx.core)?))
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        self.source.capture_blocker()
    }

    fn transfer_failure(&self, rank: DeviceId) -> Option<BackendError> {
        let e = self
            .engines
            .iter()
            .find_map(|h| S::route_failure(&h.engine))?;
        Some(dev_err(rank, "a transfer through the host proxy", e))
    }

    /// Reads and clears every engine's device status (the device is idle); an error names the
    /// problem (capacity overflow, bad expert ids or routing). A device wait for a peer that
    /// gave up (the peer was known lost, or the timeout passed) is an
    /// [`BackendError::Aborted`] or [`BackendError::Timeout`] naming the instruction and the
    /// peer.
    fn check_status(&mut self, core: &DeviceCore) -> Result<(), BackendError> {
        let s = core.streams[0].clone();
        for held in &mut self.engines {
            let capacity = held.shape.capacity;
            let eng = S::engine(&mut held.engine);
            let st = eng.status(&s).map_err(core.err("MoE status"))?;
            if st.is_ok() {
                continue;
            }
            eng.clear_status(&s).map_err(core.err("MoE status"))?;
            if st.timeout() {
                return Err(gave_up(core, &held.members, st));
            }
            let mut why = Vec::new();
            if st.overflow() {
                why.push(format!(
                    "an expert received more rows than the capacity C={capacity} (rows dropped)"
                ));
            }
            if st.bad_expert() {
                why.push("a topk_idx entry is not an expert id".to_string());
            }
            if st.bad_routing() {
                why.push("combine met counts or routing no dispatch produces".to_string());
            }
            return Err(BackendError::Invalid(format!(
                "rank {}: MoE on team {:?}: {}",
                core.rank,
                held.members,
                why.join("; ")
            )));
        }
        Ok(())
    }

    fn release(&mut self, healthy: bool) {
        for held in self.engines.drain(..) {
            S::release(held.engine, healthy);
        }
        self.last = None;
        self.sent = None;
    }
}

/// The profiling interval of one MoE request, opened at its first device work rather than when
/// the request arrives: the host's preparation (the engine lookup, the checks, the output
/// slots) stays outside it, so that the interval spans what the device does, as the event
/// before an engine's first kernel does when the kernels are timed alone. While the device
/// has work queued, the two are the same; when it has caught up (small steps), the
/// preparation would otherwise land inside the interval.
struct OpenAtWork<'a> {
    name: &'static str,
    transport: Transport,
    ctx: InstCtx<'a>,
    /// `Some` once opened (the inner `None`: not profiled, or inside a coalescing group).
    opened: Option<Option<Opened>>,
}

impl<'a> OpenAtWork<'a> {
    fn new(name: &'static str, transport: Transport, ctx: InstCtx<'a>) -> Self {
        OpenAtWork {
            name,
            transport,
            ctx,
            opened: None,
        }
    }

    /// Opens the interval on the current stream (once; later calls do nothing).
    fn open(&mut self, core: &mut DeviceCore) -> Result<(), BackendError> {
        if self.opened.is_none() {
            self.opened = Some(core.begin_op(self.name, self.transport, self.ctx)?);
        }
        Ok(())
    }

    /// The opened interval (opened now if no device work came before).
    fn into_opened(mut self, core: &mut DeviceCore) -> Result<Option<Opened>, BackendError> {
        self.open(core)?;
        Ok(self.opened.flatten())
    }
}

/// `w` (this rank's top-k weights, at `region`) as the f32 the engines take: the region
/// itself, or a cast into a temporary.
fn f32_weights(
    core: &mut DeviceCore,
    w: &TV,
    region: DeviceBuffer,
    what: &str,
) -> Result<DeviceBuffer, BackendError> {
    if w.dtype == DType::F32 {
        return Ok(region);
    }
    let wf = core.temp(w.numel() as usize * 4)?;
    let s = core.stream().clone();
    core.kernels
        .cast(&s, &region, kdtype(w.dtype), &wf, KDType::F32)
        .map_err(core.err(what))?;
    Ok(wf)
}

/// The error of an engine whose device wait for a peer gave up (`st` has
/// [`MoeStatus::TIMEOUT`](meshflow_kernels::moe::MoeStatus::TIMEOUT)).
fn gave_up(
    core: &DeviceCore,
    members: &[DeviceId],
    st: meshflow_kernels::moe::MoeStatus,
) -> BackendError {
    let op = match st.gave_up_in() {
        Some("dispatch") => "moe_dispatch",
        Some("combine") => "moe_combine",
        _ => "moe_dispatch and moe_combine",
    };
    let peer = st.waited_for().and_then(|i| members.get(i).copied());
    let whom = peer.map_or_else(|| "a peer".to_string(), |p| format!("rank {p}"));
    if st.aborted() {
        BackendError::Aborted {
            failed_rank: peer.unwrap_or(core.rank),
            reason: format!(
                "rank {}: {op} on team {members:?} stopped waiting on the device for {whom} \
                 (known to have stopped)",
                core.rank
            ),
        }
    } else {
        BackendError::Timeout {
            peer: peer.unwrap_or(core.rank),
            waited: core.timeout,
            what: format!(
                "{op} on team {members:?}: the device waited for {whom}'s rows or partials"
            ),
        }
    }
}

/// Where a dispatch writes one output: the view's slot ([`DeviceCore::output_slot`]), or an
/// aligned temporary when the slot's address breaks the kernels' alignment, copied into the
/// slot after the dispatch.
struct OutTarget {
    slot: OutSlot,
    staged: Option<DeviceBuffer>,
}

impl OutTarget {
    fn new(
        core: &mut DeviceCore,
        v: &TV,
        avoid: &[&TV],
        align: usize,
    ) -> Result<OutTarget, BackendError> {
        let slot = core.output_slot(v, avoid)?;
        let staged = if slot.buf.is_aligned(align) {
            None
        } else {
            Some(core.temp(slot.buf.len())?)
        };
        Ok(OutTarget { slot, staged })
    }

    /// The bytes the engine writes.
    fn buf(&self) -> &DeviceBuffer {
        self.staged.as_ref().unwrap_or(&self.slot.buf)
    }

    /// After the dispatch: the staged bytes into the slot, the slot into the view.
    fn finish(self, core: &mut DeviceCore, what: &str) -> Result<(), BackendError> {
        if let Some(t) = &self.staged {
            self.slot
                .buf
                .copy_from(core.stream(), t)
                .map_err(core.err(&format!("{what} (aligning an output)")))?;
        }
        core.finish_output(self.slot)
    }
}

fn invalid(rank: usize, what: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Invalid(format!("rank {rank}: {what}: {message}"))
}

fn dims<const N: usize>(
    rank: usize,
    what: &str,
    v: &TV,
    names: &str,
) -> Result<[usize; N], BackendError> {
    if v.shape.len() != N {
        return Err(invalid(
            rank,
            what,
            format!(
                "`{names}` must have {N} axes on GPUs (no leading batch axes yet), has shape {:?}",
                v.shape
            ),
        ));
    }
    let mut out = [0usize; N];
    for (o, &s) in out.iter_mut().zip(&v.shape) {
        *o = usize::try_from(s).map_err(|_| invalid(rank, what, "extent does not fit usize"))?;
    }
    Ok(out)
}
