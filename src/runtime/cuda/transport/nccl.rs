//! The NCCL transport: every collective kind and collective permutes (grouped send/recv; a
//! device copy when a rank sends to itself) on the current stream, through the team's
//! communicator. Inside a coalescing group the calls are issued at the group's end.

use meshflow_ir::{CommKind, ReduceOp};
use meshflow_kernels::nccl::{self, Comm, NcclLib};
use meshflow_kernels::{DType as KDType, DeviceBuffer, ReduceOp as KReduceOp, Stream};
use meshflow_passes::Transport;

use super::object::{CommTransport, PostCx, Posted};
use crate::runtime::backend::{BackendError, CommRequest, InstCtx, TeamInfo, TensorView};
use crate::runtime::collective::{member_buffers, need, MemberViews};
use crate::runtime::cuda::layout::{elem_bytes, kdtype};
use crate::runtime::cuda::memory::CudaBuffer;

type TV = TensorView<CudaBuffer>;

/// The NCCL transport (stateless: the communicators are the rank's, per team).
#[derive(Debug, Default)]
pub(crate) struct NcclTransport;

impl CommTransport for NcclTransport {
    fn kind(&self) -> Transport {
        Transport::Nccl
    }

    fn post(
        &mut self,
        cx: &mut PostCx<'_>,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        let name = request.name();
        let opened = cx.core.begin_op(name, Transport::Nccl, ctx)?;
        match request {
            CommRequest::Collective {
                kind,
                team,
                input,
                output,
                root,
                op,
                ..
            } => collective(
                cx,
                name,
                *kind,
                team,
                *input,
                *output,
                root.unwrap_or(0),
                *op,
            )?,
            CommRequest::Permute {
                team,
                send_peer,
                recv_peer,
                input,
                output,
                ..
            } => permute(cx, team, *send_peer, *recv_peer, input, output)?,
            CommRequest::MoeDispatch { .. } | CommRequest::MoeCombine { .. } => {
                return Err(BackendError::Invalid(format!(
                    "{name} goes through an MoE transport, not the NCCL one"
                )))
            }
        }
        Ok(Posted::OnStream(opened))
    }
}

/// Sends `send` to team index `.1` and receives `recv` from team index `.1` in one NCCL group
/// on `stream` (either may be absent).
pub(super) fn send_recv(
    lib: &NcclLib,
    comm: &Comm,
    send: Option<(&DeviceBuffer, usize)>,
    recv: Option<(&DeviceBuffer, usize)>,
    dtype: KDType,
    stream: &Stream,
) -> Result<(), meshflow_kernels::KernelError> {
    nccl::group(lib, || {
        if let Some((buf, peer)) = send {
            comm.send(buf, dtype, peer, stream)?;
        }
        if let Some((buf, peer)) = recv {
            comm.recv(buf, dtype, peer, stream)?;
        }
        Ok(())
    })
}

fn reduce_op(op: ReduceOp) -> KReduceOp {
    match op {
        ReduceOp::Sum => KReduceOp::Sum,
        ReduceOp::Max => KReduceOp::Max,
        ReduceOp::Min => KReduceOp::Min,
        ReduceOp::Avg => KReduceOp::Avg,
    }
}

#[allow(clippy::too_many_arguments)]
fn collective(
    cx: &mut PostCx<'_>,
    name: &'static str,
    kind: CommKind,
    team: &TeamInfo,
    input: Option<&TV>,
    output: Option<&TV>,
    root: usize,
    op: ReduceOp,
) -> Result<(), BackendError> {
    let (d, my) = (team.members.len(), team.my_index);
    let MemberViews {
        send: input,
        recv: output,
    } = member_buffers(name, kind, (d, my, root), input, output)?;
    let dtype = input
        .or(output)
        .map(|v| v.dtype)
        .ok_or_else(|| BackendError::Invalid(format!("{name}: no buffers on this rank")))?;
    let kd = kdtype(dtype);
    let call = format!("{name} on team {:?}", team.members);
    let e = cx.core.err(&call);
    match kind {
        CommKind::AllGather
        | CommKind::ReduceScatter
        | CommKind::AllReduce
        | CommKind::AllToAll => {
            let (i, o) = (need(name, input, "send")?, need(name, output, "receive")?);
            let send = cx.core.input_region(i)?;
            let slot = cx.core.output_slot(o, &[i])?;
            let comm = cx.comms.of(cx.core.rank, team)?;
            let s = cx.core.stream();
            match kind {
                CommKind::AllGather => comm.all_gather(&send, &slot.buf, kd, s),
                CommKind::ReduceScatter => {
                    comm.reduce_scatter(&send, &slot.buf, kd, reduce_op(op), s)
                }
                CommKind::AllReduce => comm.all_reduce(&send, &slot.buf, kd, reduce_op(op), s),
                _ => comm.all_to_all(&send, &slot.buf, kd, s),
            }
            .map_err(e)?;
            cx.core.finish_output(slot)
        }
        CommKind::Broadcast => {
            if my == root {
                let i = need(name, input, "send")?;
                let send = cx.core.input_region(i)?;
                let slot = match output {
                    Some(o) => Some(cx.core.output_slot(o, &[i])?),
                    None => None,
                };
                let recv = match &slot {
                    Some(s) => s.buf.clone(),
                    None => cx.core.temp(i.numel() as usize * elem_bytes(dtype))?,
                };
                let comm = cx.comms.of(cx.core.rank, team)?;
                comm.broadcast(&send, &recv, kd, root, cx.core.stream())
                    .map_err(e)?;
                match slot {
                    Some(s) => cx.core.finish_output(s),
                    None => Ok(()),
                }
            } else {
                let o = need(name, output, "receive")?;
                let slot = cx.core.output_slot(o, &[])?;
                let comm = cx.comms.of(cx.core.rank, team)?;
                comm.broadcast(&slot.buf, &slot.buf, kd, root, cx.core.stream())
                    .map_err(e)?;
                cx.core.finish_output(slot)
            }
        }
        CommKind::Gather | CommKind::Reduce => {
            let i = need(name, input, "send")?;
            let send = cx.core.input_region(i)?;
            let slot = if my == root {
                let o = need(name, output, "receive")?;
                Some(cx.core.output_slot(o, &[i])?)
            } else {
                None
            };
            let comm = cx.comms.of(cx.core.rank, team)?;
            let s = cx.core.stream();
            let recv = slot.as_ref().map(|x| &x.buf);
            if kind == CommKind::Gather {
                comm.gather(&send, recv, kd, root, s)
            } else {
                comm.reduce(&send, recv, kd, reduce_op(op), root, s)
            }
            .map_err(e)?;
            match slot {
                Some(s) => cx.core.finish_output(s),
                None => Ok(()),
            }
        }
        CommKind::Scatter => {
            let send = if my == root {
                let i = need(name, input, "send")?;
                Some(cx.core.input_region(i)?)
            } else {
                None
            };
            let avoid: Vec<&TV> = input.into_iter().collect();
            let (recv, slot) = match (output, &send) {
                (Some(o), _) => {
                    let slot = cx.core.output_slot(o, &avoid)?;
                    (slot.buf.clone(), Some(slot))
                }
                // The root may hold no receive buffer: its own chunk lands in a temporary.
                (None, Some(sb)) => (cx.core.temp(sb.len() / d.max(1))?, None),
                (None, None) => return need::<CudaBuffer>(name, None, "receive").map(drop),
            };
            let comm = cx.comms.of(cx.core.rank, team)?;
            comm.scatter(send.as_ref(), &recv, kd, root, cx.core.stream())
                .map_err(e)?;
            match slot {
                Some(s) => cx.core.finish_output(s),
                None => Ok(()),
            }
        }
        CommKind::SendRecv => {
            if my == root {
                let i = need(name, input, "send")?;
                let send = cx.core.input_region(i)?;
                let comm = cx.comms.of(cx.core.rank, team)?;
                comm.send(&send, kd, 1 - my, cx.core.stream()).map_err(e)
            } else {
                let o = need(name, output, "receive")?;
                let slot = cx.core.output_slot(o, &[])?;
                let comm = cx.comms.of(cx.core.rank, team)?;
                comm.recv(&slot.buf, kd, root, cx.core.stream())
                    .map_err(e)?;
                cx.core.finish_output(slot)
            }
        }
    }
}

/// A collective permute over NCCL (a device copy when the rank sends to itself).
fn permute(
    cx: &mut PostCx<'_>,
    team: &TeamInfo,
    send_peer: usize,
    recv_peer: usize,
    input: &TV,
    output: &TV,
) -> Result<(), BackendError> {
    const NAME: &str = "collective_permute";
    check_permute(input, output)?;
    let my = team.my_index;
    if send_peer == my && recv_peer == my {
        return cx.core.local_copy(NAME, input, output);
    }
    let kd = kdtype(input.dtype);
    let send = cx.core.input_region(input)?;
    let slot = cx.core.output_slot(output, &[input])?;
    let e = cx.core.err(&format!("{NAME} on team {:?}", team.members));
    let comm = cx.comms.of(cx.core.rank, team)?;
    send_recv(
        cx.comms.loaded()?,
        comm,
        Some((&send, send_peer)),
        Some((&slot.buf, recv_peer)),
        kd,
        cx.core.stream(),
    )
    .map_err(e)?;
    cx.core.finish_output(slot)
}

/// Checks that a permute's send and receive views have the same size and type.
pub(super) fn check_permute(input: &TV, output: &TV) -> Result<(), BackendError> {
    if input.numel() != output.numel() || input.dtype != output.dtype {
        return Err(BackendError::Invalid(format!(
            "collective_permute: send and receive differ ({} {} vs {} {} elements)",
            input.numel(),
            input.dtype,
            output.numel(),
            output.dtype
        )));
    }
    Ok(())
}
