//! `moe_dispatch` / `moe_combine` on GPUs through the NCCL MoE transport of
//! `meshflow-kernels` ([`NcclMoe`]): one engine per team and layer shape, created at the first
//! dispatch over its own communicator (made through the rendezvous like the team ones) and
//! reused by later steps and runs. In runs split into nodes, the blocks for team members on
//! other nodes go through the host proxy (see [`super::proxy`]).
//!
//! The transport owns its outputs; after a dispatch they are copied (on the stream) into the
//! program's `expert_x`, `expert_counts` and `routing`. The engine is sized at the dispatch,
//! before the expert width `F` of the combine is known: it is made with `F = H`, and a combine
//! with `F < H` runs on zero-padded rows (`F > H` is refused with an error saying so). Leading
//! batch axes (`[B.., T, H]`) are not supported on GPUs yet. Capacity overflows and bad
//! routing raised on the device are reported when the run finishes.

use meshflow_ir::DType;
use meshflow_kernels::moe::{MoeShape, MoeTransport, NcclMoe};
use meshflow_kernels::{DType as KDType, DeviceBuffer, StridedLayout};

use super::backend::CudaBackend;
use super::layout::kdtype;
use super::memory::CudaBuffer;
use super::teams::{self, TeamKey};
use crate::runtime::backend::{BackendError, TeamInfo, TensorView};

type TV = TensorView<CudaBuffer>;

/// One MoE engine: a team, a shape, its transport.
pub(super) struct MoeEngine {
    key: TeamKey,
    shape: MoeShape,
    transport: NcclMoe,
}

impl MoeEngine {
    /// The first failure of a transfer through the host proxy, if any.
    pub(super) fn route_failure(&self) -> Option<meshflow_kernels::KernelError> {
        self.transport.route_failure()
    }
}

impl std::fmt::Debug for MoeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeEngine")
            .field("team", &self.key.members)
            .field("shape", &self.shape)
            .finish()
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

impl CudaBackend {
    fn moe_engine(&mut self, team: &TeamInfo, shape: MoeShape) -> Result<usize, BackendError> {
        if let Some(i) = self
            .moe
            .iter()
            .position(|e| e.key.members == team.members && e.shape == shape)
        {
            return Ok(i);
        }
        let lib = self
            .nccl
            .clone()
            .ok_or_else(|| BackendError::Invalid("no NCCL library loaded".into()))?;
        let key = TeamKey {
            namespace: format!("{}/moe", self.namespace()),
            ordinal: self.device.ordinal(),
            members: team.members.clone(),
        };
        let comm = match teams::checkout(&key) {
            Some(c) => c,
            None => teams::create(
                self.rank,
                &lib,
                &self.device,
                self.rendezvous().map(|r| r.as_ref()),
                &key,
                team.my_index,
                self.config.timeout,
            )?,
        };
        let mut transport =
            NcclMoe::new(comm, &shape).map_err(self.err("creating the NCCL MoE transport"))?;
        if let Some(route) = self.new_route(&team.members, super::proxy::MOE_ROUTE)? {
            transport.set_route(route);
        }
        self.moe.push(MoeEngine {
            key,
            shape,
            transport,
        });
        Ok(self.moe.len() - 1)
    }

    /// `moe_dispatch(x, topk_idx -> expert_x, expert_counts, routing)`.
    pub(super) fn moe_dispatch(
        &mut self,
        team: &TeamInfo,
        x: &TV,
        topk_idx: &TV,
        expert_x: &TV,
        expert_counts: &TV,
        routing: &TV,
    ) -> Result<(), BackendError> {
        const WHAT: &str = "moe_dispatch";
        let rank = self.rank;
        if self.group.is_some() {
            return Err(invalid(rank, WHAT, "MoE ops cannot be coalesced on GPUs"));
        }
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
        let i = self.moe_engine(team, shape)?;
        let xb = self.input_region(x)?;
        let ib = self.input_region(topk_idx)?;
        let s = self.streams[self.current].clone();
        let e = self.err(WHAT);
        let engine = &mut self.moe[i];
        engine.transport.dispatch(&s, &xb, &ib).map_err(&e)?;
        let outs = [
            engine.transport.expert_x().clone(),
            engine.transport.expert_counts().clone(),
            engine.transport.routing().clone(),
        ];
        self.moe_last = Some(i);
        for (src, dst) in outs.iter().zip([expert_x, expert_counts, routing]) {
            let slot = self.output_slot(dst, &[])?;
            slot.buf.copy_from(&s, src).map_err(&e)?;
            self.finish_output(slot)?;
        }
        Ok(())
    }

    /// `moe_combine(expert_y, expert_counts, routing, topk_weights -> out)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_combine(
        &mut self,
        team: &TeamInfo,
        expert_y: &TV,
        expert_counts: &TV,
        routing: &TV,
        topk_weights: &TV,
        out: &TV,
    ) -> Result<(), BackendError> {
        const WHAT: &str = "moe_combine";
        let rank = self.rank;
        if self.group.is_some() {
            return Err(invalid(rank, WHAT, "MoE ops cannot be coalesced on GPUs"));
        }
        let i = self
            .moe_last
            .filter(|&i| {
                self.moe
                    .get(i)
                    .is_some_and(|e| e.key.members == team.members)
            })
            .ok_or_else(|| invalid(rank, WHAT, "no moe_dispatch of this team precedes it"))?;
        let shape = self.moe[i].shape;
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
        let s = self.streams[self.current].clone();
        let e = self.err(WHAT);
        let y = self.input_region(expert_y)?;
        let counts = self.input_region(expert_counts)?;
        let routes = self.input_region(routing)?;
        let w = self.input_region(topk_weights)?;
        let weights = if topk_weights.dtype == DType::F32 {
            w
        } else {
            let wf = self.temp(topk_weights.numel() as usize * 4)?;
            self.kernels
                .cast(&s, &w, kdtype(topk_weights.dtype), &wf, KDType::F32)
                .map_err(&e)?;
            wf
        };
        let padded = |rows: usize, bytes_per_row: usize| rows * bytes_per_row;
        let (y_in, out_buf) = if f == h {
            (y, None)
        } else {
            let yp = self.temp(padded(l * c, h * es))?;
            yp.zero(&s).map_err(&e)?;
            let src = StridedLayout::contiguous(&[l * c, f]);
            let dst = StridedLayout {
                shape: vec![l * c, f],
                strides: vec![h, 1],
                offset: 0,
            };
            self.kernels
                .strided_copy(&s, kdtype(expert_y.dtype), &y, &src, &yp, &dst)
                .map_err(&e)?;
            (yp, Some(self.temp(padded(t, h * es))?))
        };
        let slot = self.output_slot(out, &[expert_y, topk_weights])?;
        let target: DeviceBuffer = out_buf.clone().unwrap_or_else(|| slot.buf.clone());
        self.moe[i]
            .transport
            .combine(&s, &y_in, &counts, &routes, &weights, &target)
            .map_err(&e)?;
        if let Some(ob) = out_buf {
            let src = StridedLayout {
                shape: vec![t, f],
                strides: vec![h, 1],
                offset: 0,
            };
            let dst = StridedLayout::contiguous(&[t, f]);
            self.kernels
                .strided_copy(&s, kdtype(out.dtype), &ob, &src, &slot.buf, &dst)
                .map_err(&e)?;
        }
        self.finish_output(slot)
    }

    /// Reads and clears every engine's device status (the device is idle); an error names the
    /// problem (capacity overflow, bad expert ids or routing, a peer timeout).
    pub(super) fn moe_check_status(&mut self) -> Result<(), BackendError> {
        let s = self.streams[0].clone();
        for eng in &self.moe {
            let st = eng.transport.status(&s).map_err(self.err("MoE status"))?;
            if st.is_ok() {
                continue;
            }
            eng.transport
                .clear_status(&s)
                .map_err(self.err("MoE status"))?;
            let mut why = Vec::new();
            if st.overflow() {
                why.push(format!(
                    "an expert received more rows than the capacity C={} (rows dropped)",
                    eng.shape.capacity
                ));
            }
            if st.bad_expert() {
                why.push("a topk_idx entry is not an expert id".to_string());
            }
            if st.bad_routing() {
                why.push("combine met counts or routing no dispatch produces".to_string());
            }
            if st.timeout() {
                why.push("a peer's rows never arrived (timeout)".to_string());
            }
            return Err(BackendError::Invalid(format!(
                "rank {}: MoE on team {:?}: {}",
                self.rank,
                eng.key.members,
                why.join("; ")
            )));
        }
        Ok(())
    }

    /// Hands the engines' communicators back to the cache (healthy ranks) or drops them.
    pub(super) fn moe_release(&mut self, healthy: bool) {
        for eng in self.moe.drain(..) {
            if healthy {
                teams::checkin(eng.key, eng.transport.into_comm());
            }
        }
        self.moe_last = None;
    }
}
