//! Communications over NCCL on the current stream (one communicator per team): every
//! collective kind, collective permute as grouped send/recv (a device copy when a rank sends
//! to itself; through the host proxy when a peer is on another node, see [`super::proxy`]),
//! and MoE dispatch/combine ([`super::moe`]).

use meshflow_ir::{CommKind, ReduceOp};
use meshflow_kernels::nccl::{self, Comm};
use meshflow_kernels::ReduceOp as KReduceOp;

use super::backend::CudaBackend;
use super::layout::{elem_bytes, kdtype};
use super::memory::CudaBuffer;
use crate::runtime::backend::{BackendError, CommRequest, TeamInfo, TensorView};

type TV = TensorView<CudaBuffer>;

fn reduce_op(op: ReduceOp) -> KReduceOp {
    match op {
        ReduceOp::Sum => KReduceOp::Sum,
        ReduceOp::Max => KReduceOp::Max,
        ReduceOp::Min => KReduceOp::Min,
        ReduceOp::Avg => KReduceOp::Avg,
    }
}

fn need<'a>(name: &str, v: Option<&'a TV>, what: &str) -> Result<&'a TV, BackendError> {
    v.ok_or_else(|| {
        BackendError::Invalid(format!(
            "{name}: this rank takes part but does not hold the {what} buffer"
        ))
    })
}

/// Chunked kinds cut the row-major elements into `d` equal contiguous chunks (NCCL's
/// semantics), whatever the shape: `[1, 12]` over 4 ranks is 4 chunks of 3 elements.
fn divisible(name: &str, v: &TV, d: usize, what: &str) -> Result<(), BackendError> {
    if d > 0 && v.numel().is_multiple_of(d as u64) {
        Ok(())
    } else {
        Err(BackendError::Invalid(format!(
            "{name}: the {what} buffer of shape {:?} ({} elements) cannot be cut into {d} equal \
             chunks",
            v.shape,
            v.numel()
        )))
    }
}

impl CudaBackend {
    pub(super) fn comm_of(&self, team: &TeamInfo) -> Result<&Comm, BackendError> {
        self.team_comm
            .get(team.slot)
            .and_then(|&i| self.comms.get(i))
            .map(|(_, c)| c)
            .ok_or_else(|| {
                BackendError::Invalid(format!(
                    "rank {}: no communicator for team {:?}",
                    self.rank, team.members
                ))
            })
    }

    /// Issues `request` on the current stream (outputs through temporaries when strided).
    pub(super) fn post_request(
        &mut self,
        request: &CommRequest<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        let name = request.name();
        match request {
            CommRequest::Collective {
                kind,
                team,
                input,
                output,
                root,
                op,
                ..
            } => self.collective(name, *kind, team, *input, *output, root.unwrap_or(0), *op),
            CommRequest::Permute {
                team,
                send_peer,
                recv_peer,
                input,
                output,
                ..
            } => self.permute_comm(team, *send_peer, *recv_peer, input, output),
            CommRequest::MoeDispatch {
                team,
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                ..
            } => self.moe_dispatch(team, x, topk_idx, expert_x, expert_counts, routing),
            CommRequest::MoeCombine {
                team,
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
                ..
            } => self.moe_combine(team, expert_y, expert_counts, routing, topk_weights, out),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn collective(
        &mut self,
        name: &'static str,
        kind: CommKind,
        team: &TeamInfo,
        input: Option<&TV>,
        output: Option<&TV>,
        root: usize,
        op: ReduceOp,
    ) -> Result<(), BackendError> {
        let (d, my) = (team.members.len(), team.my_index);
        let dtype = input
            .or(output)
            .map(|v| v.dtype)
            .ok_or_else(|| BackendError::Invalid(format!("{name}: no buffers on this rank")))?;
        let kd = kdtype(dtype);
        let call = format!("{name} on team {:?}", team.members);
        let e = self.err(&call);
        match kind {
            CommKind::AllGather
            | CommKind::ReduceScatter
            | CommKind::AllReduce
            | CommKind::AllToAll => {
                let (i, o) = (need(name, input, "send")?, need(name, output, "receive")?);
                match kind {
                    CommKind::AllGather => divisible(name, o, d, "receive")?,
                    CommKind::ReduceScatter => divisible(name, i, d, "send")?,
                    CommKind::AllToAll => {
                        divisible(name, i, d, "send")?;
                        divisible(name, o, d, "receive")?;
                    }
                    _ => {}
                }
                let send = self.input_region(i)?;
                let slot = self.output_slot(o, &[i])?;
                let comm = self.comm_of(team)?;
                let s = &self.streams[self.current];
                match kind {
                    CommKind::AllGather => comm.all_gather(&send, &slot.buf, kd, s),
                    CommKind::ReduceScatter => {
                        comm.reduce_scatter(&send, &slot.buf, kd, reduce_op(op), s)
                    }
                    CommKind::AllReduce => comm.all_reduce(&send, &slot.buf, kd, reduce_op(op), s),
                    _ => comm.all_to_all(&send, &slot.buf, kd, s),
                }
                .map_err(e)?;
                self.finish_output(slot)
            }
            CommKind::Broadcast => {
                if my == root {
                    let i = need(name, input, "send")?;
                    let send = self.input_region(i)?;
                    let slot = match output {
                        Some(o) => Some(self.output_slot(o, &[i])?),
                        None => None,
                    };
                    let recv = match &slot {
                        Some(s) => s.buf.clone(),
                        None => self.temp(i.numel() as usize * elem_bytes(dtype))?,
                    };
                    let comm = self.comm_of(team)?;
                    comm.broadcast(&send, &recv, kd, root, &self.streams[self.current])
                        .map_err(e)?;
                    match slot {
                        Some(s) => self.finish_output(s),
                        None => Ok(()),
                    }
                } else {
                    let o = need(name, output, "receive")?;
                    let slot = self.output_slot(o, &[])?;
                    let comm = self.comm_of(team)?;
                    comm.broadcast(&slot.buf, &slot.buf, kd, root, &self.streams[self.current])
                        .map_err(e)?;
                    self.finish_output(slot)
                }
            }
            CommKind::Gather | CommKind::Reduce => {
                let i = need(name, input, "send")?;
                let send = self.input_region(i)?;
                let slot = if my == root {
                    let o = need(name, output, "receive")?;
                    if kind == CommKind::Gather {
                        divisible(name, o, d, "receive")?;
                    }
                    Some(self.output_slot(o, &[i])?)
                } else {
                    None
                };
                let comm = self.comm_of(team)?;
                let s = &self.streams[self.current];
                let recv = slot.as_ref().map(|x| &x.buf);
                if kind == CommKind::Gather {
                    comm.gather(&send, recv, kd, root, s)
                } else {
                    comm.reduce(&send, recv, kd, reduce_op(op), root, s)
                }
                .map_err(e)?;
                match slot {
                    Some(s) => self.finish_output(s),
                    None => Ok(()),
                }
            }
            CommKind::Scatter => {
                let send = if my == root {
                    let i = need(name, input, "send")?;
                    divisible(name, i, d, "send")?;
                    Some(self.input_region(i)?)
                } else {
                    None
                };
                let avoid: Vec<&TV> = input.into_iter().collect();
                let (recv, slot) = match (output, &send) {
                    (Some(o), _) => {
                        let slot = self.output_slot(o, &avoid)?;
                        (slot.buf.clone(), Some(slot))
                    }
                    // The root may hold no receive buffer: its own chunk lands in a temporary.
                    (None, Some(sb)) => (self.temp(sb.len() / d.max(1))?, None),
                    (None, None) => return need(name, None, "receive").map(drop),
                };
                let comm = self.comm_of(team)?;
                comm.scatter(send.as_ref(), &recv, kd, root, &self.streams[self.current])
                    .map_err(e)?;
                match slot {
                    Some(s) => self.finish_output(s),
                    None => Ok(()),
                }
            }
            CommKind::SendRecv => {
                if d != 2 {
                    return Err(BackendError::Invalid(format!(
                        "{name}: needs a team of two, has {d} members"
                    )));
                }
                if my == root {
                    let i = need(name, input, "send")?;
                    let send = self.input_region(i)?;
                    let comm = self.comm_of(team)?;
                    comm.send(&send, kd, 1 - my, &self.streams[self.current])
                        .map_err(e)
                } else {
                    let o = need(name, output, "receive")?;
                    let slot = self.output_slot(o, &[])?;
                    let comm = self.comm_of(team)?;
                    comm.recv(&slot.buf, kd, root, &self.streams[self.current])
                        .map_err(e)?;
                    self.finish_output(slot)
                }
            }
        }
    }

    fn permute_comm(
        &mut self,
        team: &TeamInfo,
        send_peer: usize,
        recv_peer: usize,
        input: &TV,
        output: &TV,
    ) -> Result<(), BackendError> {
        const NAME: &str = "collective_permute";
        if input.numel() != output.numel() || input.dtype != output.dtype {
            return Err(BackendError::Invalid(format!(
                "{NAME}: send and receive differ ({} {} vs {} {} elements)",
                input.numel(),
                input.dtype,
                output.numel(),
                output.dtype
            )));
        }
        let my = team.my_index;
        if send_peer == my && recv_peer == my {
            // To itself: a device copy, no NCCL.
            let send = self.input_region(input)?;
            let slot = self.output_slot(output, &[input])?;
            slot.buf
                .copy_from(&self.streams[self.current], &send)
                .map_err(self.err("collective_permute (local copy)"))?;
            return self.finish_output(slot);
        }
        if self.permute_through_proxy(team, send_peer, recv_peer, input, output)? {
            return Ok(());
        }
        let kd = kdtype(input.dtype);
        let send = self.input_region(input)?;
        let slot = self.output_slot(output, &[input])?;
        let call = format!("{NAME} on team {:?}", team.members);
        let e = self.err(&call);
        let lib = self
            .nccl
            .clone()
            .ok_or_else(|| BackendError::Invalid("no NCCL library loaded".into()))?;
        let comm = self.comm_of(team)?;
        let s = &self.streams[self.current];
        nccl::group(&lib, || {
            comm.send(&send, kd, send_peer, s)?;
            comm.recv(&slot.buf, kd, recv_peer, s)
        })
        .map_err(e)?;
        self.finish_output(slot)
    }
}
