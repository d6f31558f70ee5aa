//! Communications on the CPU fabric, in two phases: [`start`] reads the send buffers and
//! delivers every outgoing message (never blocking); [`finish`] receives the incoming ones and
//! writes the receive buffers. A coalescing group starts all its members before finishing
//! any, like an NCCL group. Chunked kinds cut their buffers into equal contiguous chunks of
//! the row-major element order, as NCCL does (so a buffer `[1, 12]` splits into 4 chunks of
//! 3 elements: leading extent-1 axes never matter). Reductions combine contributions in team order (accumulating in
//! `f32`, or `i64` for integers, and rounding once), so every member gets the same bits.
//!
//! MoE combine is the one exchange in two rounds: `start` sends this member's `topk_weights`
//! to every member; `finish` receives them, reduces the local expert rows into one partial
//! per (token, member) (see `cpu_ops::pack_combine`), sends those back under a second key
//! ([`PARTIALS`]) and sums the partials it receives in member order.

use meshflow_ir::{CommKind, DType, DeviceId, ReduceOp};

use super::fabric::{MailKey, Operands, Payload};
use super::{CpuBackend, CpuBuffer};
use crate::runtime::backend::{BackendError, CommRequest, TensorView};
use crate::runtime::collective::{invalid, member_buffers, need, MemberViews};
use crate::runtime::cpu_ops::{self, MoeRows};
use crate::runtime::data::{Storage, TensorData};
use crate::runtime::view::View;

type TV = TensorView<CpuBuffer>;

/// Set in the sequence number of the second round of a MoE combine (the partials), so its
/// messages never share a key with the first (the weights). Sequence numbers stay far below.
pub(super) const PARTIALS: u64 = 1 << 63;

/// Where one piece of a result comes from.
#[derive(Debug)]
enum Src {
    Local(Payload),
    Remote(usize),
}

/// Which part of the receive buffer a piece fills.
#[derive(Copy, Clone, Debug)]
enum Part {
    Whole,
    /// Chunk `index` of the team-size equal chunks of the row-major elements.
    Chunk(u64),
}

#[derive(Debug)]
enum Finish {
    Nothing,
    Write {
        out: TV,
        parts: Vec<(Part, Src)>,
    },
    Reduce {
        out: TV,
        sources: Vec<Src>,
        op: ReduceOp,
    },
    Dispatch {
        outs: [TV; 3],
        sources: Vec<Src>,
    },
    Combine {
        /// `expert_y`, `expert_counts` and `routing` as read at the start.
        rows: [TensorData; 3],
        /// The members' weights (this member's own, the others' from the fabric).
        weights: Vec<Src>,
        tokens: u64,
        top_k: u64,
        out: TV,
    },
}

/// A started communication waiting for its incoming messages.
#[derive(Debug)]
pub(super) struct Exchange {
    name: &'static str,
    members: Vec<DeviceId>,
    tag: (u64, u64),
    finish: Finish,
    operands: Operands,
}

/// The buffers a request reads and writes.
pub(super) fn accesses<'r>(req: &'r CommRequest<'_, CpuBuffer>) -> (Vec<&'r TV>, Vec<&'r TV>) {
    match req {
        CommRequest::Collective {
            kind,
            team,
            input,
            output,
            root,
            ..
        } => {
            let (reads, writes) =
                crate::ordering::collective_accesses(*kind, *root == Some(team.my_index));
            (
                input.iter().copied().filter(|_| reads).collect(),
                output.iter().copied().filter(|_| writes).collect(),
            )
        }
        CommRequest::Permute { input, output, .. } => (vec![*input], vec![*output]),
        // The weights a dispatch carries count as read there (GPU backends send them then),
        // though this backend reads them at the combine.
        CommRequest::MoeDispatch {
            x,
            topk_idx,
            expert_x,
            expert_counts,
            routing,
            topk_weights,
            ..
        } => (
            [*x, *topk_idx].into_iter().chain(*topk_weights).collect(),
            vec![*expert_x, *expert_counts, *routing],
        ),
        CommRequest::MoeCombine {
            expert_y,
            expert_counts,
            routing,
            topk_weights,
            out,
            ..
        } => (
            vec![*expert_y, *expert_counts, *routing, *topk_weights],
            vec![*out],
        ),
    }
}

fn same_numel(name: &str, a: u64, b: u64, how: &str) -> Result<(), BackendError> {
    if a == b {
        Ok(())
    } else {
        Err(invalid(name, format!("{how}: {a} elements vs {b}")))
    }
}

/// Reads the `d` equal chunks of `i`, sends chunk `k` to member `k` and returns this member's
/// own (chunk `my`).
fn scatter_chunks(
    be: &CpuBackend,
    i: &TV,
    d: usize,
    my: usize,
    send: &impl Fn(&CpuBackend, usize, Payload) -> Result<(), BackendError>,
) -> Result<Storage, BackendError> {
    let mut own = None;
    for k in 0..d {
        let chunk = read(be, i, Some((k as u64, d as u64)))?;
        if k == my {
            own = Some(chunk);
        } else {
            send(be, k, Payload::Data(chunk))?;
        }
    }
    own.ok_or_else(|| BackendError::Invalid(format!("team index {my} is not below {d}")))
}

/// Reads `v` (or chunk `k` of `d` equal chunks of its row-major elements).
fn read(be: &CpuBackend, v: &TV, chunk: Option<(u64, u64)>) -> Result<Storage, BackendError> {
    let all = be.view(v)?.to_storage();
    match chunk {
        None => Ok(all),
        Some((k, d)) => {
            let n = all.len() as u64;
            if d == 0 || k >= d || !n.is_multiple_of(d) {
                return Err(BackendError::Invalid(format!(
                    "chunk {k} of {d} of {:?}",
                    v.shape
                )));
            }
            let c = (n / d) as usize;
            let k = k as usize;
            Ok(all.slice(k * c..(k + 1) * c))
        }
    }
}

/// Starts a communication: reads the send buffers and delivers the outgoing messages.
pub(super) fn start(
    be: &mut CpuBackend,
    req: &CommRequest<'_, CpuBuffer>,
    tag: (u64, u64),
) -> Result<Exchange, BackendError> {
    let name = req.name();
    let team = req.team();
    let (d, my) = (team.members.len(), team.my_index);
    let me = be.device;
    let ops = operands(req);
    let send = |be: &CpuBackend, k: usize, p: Payload| -> Result<(), BackendError> {
        let key = (me, team.members[k], tag.0, tag.1);
        be.fabric.send_checked(
            key,
            p,
            Some(ops.clone()),
            be.max_in_flight,
            be.timeout,
            name,
        )
    };
    let others = (0..d).filter(|&k| k != my);
    let finish = match req {
        CommRequest::Collective {
            kind,
            input,
            output,
            root,
            op,
            ..
        } => {
            let r = root.unwrap_or(0);
            let MemberViews { send: i, recv: o } =
                member_buffers(name, *kind, (d, my, r), *input, *output)?;
            // The buffers the contract makes this member hold.
            let (si, ro) = (need(name, i, "send"), need(name, o, "receive"));
            // Chunk or whole `k` of the result: this member's own from `own`, else from `k`.
            let from =
                |own: &mut Option<Payload>, k: usize| match (k == my).then(|| own.take()).flatten()
                {
                    Some(p) => Src::Local(p),
                    None => Src::Remote(k),
                };
            match kind {
                CommKind::Gather | CommKind::Reduce if my != r => {
                    send(be, r, Payload::Data(read(be, si?, None)?))?;
                    Finish::Nothing
                }
                CommKind::AllGather | CommKind::Gather => {
                    let data = read(be, si?, None)?;
                    if *kind == CommKind::AllGather {
                        for k in others {
                            send(be, k, Payload::Data(data.clone()))?;
                        }
                    }
                    let mut own = Some(Payload::Data(data));
                    let parts = (0..d)
                        .map(|k| (Part::Chunk(k as u64), from(&mut own, k)))
                        .collect();
                    Finish::Write {
                        out: ro?.clone(),
                        parts,
                    }
                }
                CommKind::ReduceScatter | CommKind::AllReduce | CommKind::Reduce => {
                    let own = if *kind == CommKind::ReduceScatter {
                        scatter_chunks(be, si?, d, my, &send)?
                    } else {
                        let data = read(be, si?, None)?;
                        if *kind == CommKind::AllReduce {
                            for k in others {
                                send(be, k, Payload::Data(data.clone()))?;
                            }
                        }
                        data
                    };
                    let mut own = Some(Payload::Data(own));
                    Finish::Reduce {
                        out: ro?.clone(),
                        sources: (0..d).map(|k| from(&mut own, k)).collect(),
                        op: *op,
                    }
                }
                CommKind::Broadcast | CommKind::Scatter | CommKind::SendRecv if my == r => {
                    let own = if *kind == CommKind::Scatter {
                        scatter_chunks(be, si?, d, my, &send)?
                    } else {
                        let data = read(be, si?, None)?;
                        for k in others {
                            send(be, k, Payload::Data(data.clone()))?;
                        }
                        data
                    };
                    match o {
                        Some(o) => Finish::Write {
                            out: o.clone(),
                            parts: vec![(Part::Whole, Src::Local(Payload::Data(own)))],
                        },
                        None => Finish::Nothing,
                    }
                }
                CommKind::Broadcast | CommKind::Scatter | CommKind::SendRecv => Finish::Write {
                    out: ro?.clone(),
                    parts: vec![(Part::Whole, Src::Remote(r))],
                },
                CommKind::AllToAll => {
                    let mut own = Some(Payload::Data(scatter_chunks(be, si?, d, my, &send)?));
                    let parts = (0..d)
                        .map(|k| (Part::Chunk(k as u64), from(&mut own, k)))
                        .collect();
                    Finish::Write {
                        out: ro?.clone(),
                        parts,
                    }
                }
            }
        }
        CommRequest::Permute {
            send_peer,
            recv_peer,
            input,
            output,
            ..
        } => {
            same_numel(
                name,
                input.numel(),
                output.numel(),
                "send and receive sizes differ",
            )?;
            if *send_peer == my && *recv_peer == my {
                copy_local(be, input, output)?;
                Finish::Nothing
            } else {
                send(be, *send_peer, Payload::Data(read(be, input, None)?))?;
                Finish::Write {
                    out: (*output).clone(),
                    parts: vec![(Part::Whole, Src::Remote(*recv_peer))],
                }
            }
        }
        CommRequest::MoeDispatch {
            x,
            topk_idx,
            expert_x,
            expert_counts,
            routing,
            wire,
            ..
        } => {
            let s = &expert_x.shape;
            let local_experts = s
                .len()
                .checked_sub(3)
                .map(|nb| s[nb])
                .filter(|&l| l > 0)
                .ok_or_else(|| {
                    invalid(name, format!("expert_x must be [B.., L, C, H], has {s:?}"))
                })?;
            let msgs = cpu_ops::pack_dispatch(
                &be.view(x)?,
                &be.view(topk_idx)?,
                my,
                d,
                local_experts,
                *wire,
            )?;
            let sources = distribute(be, msgs, my, &send)?;
            Finish::Dispatch {
                outs: [
                    (*expert_x).clone(),
                    (*expert_counts).clone(),
                    (*routing).clone(),
                ],
                sources,
            }
        }
        CommRequest::MoeCombine {
            expert_y,
            expert_counts,
            routing,
            topk_weights,
            out,
            ..
        } => {
            let s = &out.shape;
            let tokens = s
                .len()
                .checked_sub(2)
                .map(|nb| s[nb])
                .filter(|&t| t > 0)
                .ok_or_else(|| invalid(name, format!("out must be [B.., T, F], has {s:?}")))?;
            let ws = &topk_weights.shape;
            let top_k = match ws.len().checked_sub(2) {
                Some(nb) if ws[..nb] == s[..nb] && ws[nb] == tokens => ws[nb + 1],
                _ => {
                    return Err(invalid(
                        name,
                        format!("topk_weights {ws:?} does not match out {s:?}"),
                    ))
                }
            };
            let rows = [
                be.view(expert_y)?.to_tensor(),
                be.view(expert_counts)?.to_tensor(),
                be.view(routing)?.to_tensor(),
            ];
            let w = Storage::F32(be.view(topk_weights)?.to_f32());
            let mut weights = Vec::with_capacity(d);
            for k in 0..d {
                if k == my {
                    weights.push(Src::Local(Payload::Data(w.clone())));
                } else {
                    send(be, k, Payload::Data(w.clone()))?;
                    weights.push(Src::Remote(k));
                }
            }
            Finish::Combine {
                rows,
                weights,
                tokens,
                top_k,
                out: (*out).clone(),
            }
        }
    };
    Ok(Exchange {
        name,
        members: team.members.clone(),
        tag,
        finish,
        operands: ops,
    })
}

/// What a request operates on, as peers compare it: for a collective, the send and
/// receive tensors and the chunk of them (view offsets); for the other kinds the tensors
/// only (each member's chunk of a permute is its own).
fn operands(req: &CommRequest<'_, CpuBuffer>) -> Operands {
    let at = |v: &TV, slice: bool| (v.tensor, if slice { v.offset } else { 0 });
    match req {
        CommRequest::Collective {
            kind,
            input,
            output,
            ..
        } => {
            let slice = *kind != CommKind::SendRecv;
            Operands {
                name: req.name(),
                input: input.map(|v| at(v, slice)),
                output: output.map(|v| at(v, slice)),
            }
        }
        CommRequest::Permute { input, output, .. } => Operands {
            name: req.name(),
            input: Some(at(input, false)),
            output: Some(at(output, false)),
        },
        CommRequest::MoeDispatch { x, expert_x, .. } => Operands {
            name: req.name(),
            input: Some(at(x, false)),
            output: Some(at(expert_x, false)),
        },
        CommRequest::MoeCombine { expert_y, out, .. } => Operands {
            name: req.name(),
            input: Some(at(expert_y, false)),
            output: Some(at(out, false)),
        },
    }
}

/// Sends `msgs[k]` to member `k` (keeping its own), returning the sources in team order.
fn distribute(
    be: &CpuBackend,
    msgs: Vec<MoeRows>,
    my: usize,
    send: &dyn Fn(&CpuBackend, usize, Payload) -> Result<(), BackendError>,
) -> Result<Vec<Src>, BackendError> {
    let mut sources = Vec::with_capacity(msgs.len());
    for (k, m) in msgs.into_iter().enumerate() {
        if k == my {
            sources.push(Src::Local(Payload::Moe(m)));
        } else {
            send(be, k, Payload::Moe(m))?;
            sources.push(Src::Remote(k));
        }
    }
    Ok(sources)
}

fn copy_local(be: &mut CpuBackend, input: &TV, output: &TV) -> Result<(), BackendError> {
    let data = read(be, input, None)?;
    be.write_views(&[output], |outs| {
        outs[0]
            .assign_storage(&data)
            .map_err(|e| BackendError::Invalid(e.to_string()))
    })
}

fn receive(be: &CpuBackend, ex: &Exchange, src: Src) -> Result<Payload, BackendError> {
    match src {
        Src::Local(p) => Ok(p),
        Src::Remote(k) => {
            let key: MailKey = (ex.members[k], be.device, ex.tag.0, ex.tag.1);
            let what = format!("{} on team {:?}", ex.name, ex.members);
            be.fabric
                .recv_checked(key, be.timeout, &what, Some(&ex.operands))
        }
    }
}

/// The device a source of an exchange is (this rank for local data).
fn src_rank(be: &CpuBackend, ex: &Exchange, src: &Src) -> usize {
    match src {
        Src::Local(_) => be.device,
        Src::Remote(k) => ex.members[*k],
    }
}

/// Data from a peer must have the element type of the receive buffer: real transports move
/// bytes, so peers that disagree on the dtype would corrupt data or hang.
fn same_dtype(
    name: &'static str,
    peer: usize,
    got: DType,
    want: DType,
) -> Result<(), BackendError> {
    if got == want {
        Ok(())
    } else {
        Err(invalid(
            name,
            format!(
                "rank {peer} sent {got} data for a {want} receive buffer (the ranks disagree \
                 on the element type)"
            ),
        ))
    }
}

fn data(ex: &Exchange, p: Payload) -> Result<Storage, BackendError> {
    match p {
        Payload::Data(s) => Ok(s),
        Payload::Moe(_) => Err(invalid(
            ex.name,
            "a peer sent MoE rows for this collective (the ranks run different programs)",
        )),
    }
}

fn moe(ex: &Exchange, p: Payload) -> Result<MoeRows, BackendError> {
    match p {
        Payload::Moe(m) => Ok(m),
        Payload::Data(_) => Err(invalid(
            ex.name,
            "a peer sent tensor data for this MoE op (the ranks run different programs)",
        )),
    }
}

/// Receives the incoming messages of a started communication and writes its outputs.
pub(super) fn finish(be: &mut CpuBackend, mut ex: Exchange) -> Result<(), BackendError> {
    let name = ex.name;
    match std::mem::replace(&mut ex.finish, Finish::Nothing) {
        Finish::Nothing => Ok(()),
        Finish::Write { out, parts } => {
            let mut pieces = Vec::with_capacity(parts.len());
            for (part, src) in parts {
                let peer = src_rank(be, &ex, &src);
                let p = receive(be, &ex, src)?;
                let piece = data(&ex, p)?;
                same_dtype(name, peer, piece.dtype(), out.dtype)?;
                pieces.push((part, piece));
            }
            // Chunks cover the receive buffer in order: concatenate them, then write once.
            let mut whole: Option<Storage> = None;
            let mut next = 0u64;
            for (part, piece) in pieces {
                match part {
                    Part::Whole => whole = Some(piece),
                    Part::Chunk(k) if k == next => {
                        next += 1;
                        match &mut whole {
                            None => whole = Some(piece),
                            Some(w) => {
                                if !w.extend_from(&piece, 0..piece.len()) {
                                    return Err(invalid(name, "received chunks of mixed types"));
                                }
                            }
                        }
                    }
                    Part::Chunk(..) => {
                        return Err(invalid(name, "receive chunks out of order"));
                    }
                }
            }
            let Some(whole) = whole else {
                return Ok(());
            };
            be.write_views(&[&out], |outs| {
                outs[0]
                    .assign_storage(&whole)
                    .map_err(|e| invalid(name, format!("received data does not fit: {e}")))
            })
        }
        Finish::Reduce { out, sources, op } => {
            let mut parts = Vec::with_capacity(sources.len());
            for src in sources {
                let peer = src_rank(be, &ex, &src);
                let p = receive(be, &ex, src)?;
                let part = data(&ex, p)?;
                same_dtype(name, peer, part.dtype(), out.dtype)?;
                parts.push(part);
            }
            for p in &parts {
                same_numel(
                    name,
                    p.len() as u64,
                    out.numel(),
                    "a contribution does not fit the receive buffer",
                )?;
            }
            be.write_views(&[&out], |outs| {
                let r = if out.dtype.is_float() {
                    outs[0].assign_f32(&reduce_f32(&parts, op))
                } else {
                    outs[0].assign_i64(&reduce_i64(&parts, op))
                };
                r.map_err(|e| invalid(name, e))
            })
        }
        Finish::Dispatch { outs, sources } => {
            let mut msgs = Vec::with_capacity(sources.len());
            for src in sources {
                let p = receive(be, &ex, src)?;
                msgs.push(moe(&ex, p)?);
            }
            let my = ex.members.iter().position(|&m| m == be.device).unwrap_or(0);
            let [a, b, c] = &outs;
            be.write_views(&[a, b, c], |v| match v {
                [ex_x, counts, routing] => {
                    cpu_ops::unpack_dispatch(&msgs, my, ex_x, counts, routing).map_err(Into::into)
                }
                _ => Err(invalid(name, "three outputs expected")),
            })
        }
        Finish::Combine {
            rows,
            weights,
            tokens,
            top_k,
            out,
        } => {
            let mut ws = Vec::with_capacity(weights.len());
            for src in weights {
                let peer = src_rank(be, &ex, &src);
                let p = receive(be, &ex, src)?;
                let w = data(&ex, p)?;
                same_dtype(name, peer, w.dtype(), DType::F32)?;
                ws.push(w.to_f32_vec());
            }
            let [y, counts, routing] = &rows;
            let msgs = cpu_ops::pack_combine(
                &View::of(y),
                &View::of(counts),
                &View::of(routing),
                &ws,
                tokens,
                top_k,
            )?;
            // Round two, under its own key: the partials go back to the tokens' members.
            let my = ex.members.iter().position(|&m| m == be.device).unwrap_or(0);
            let second = Exchange {
                name,
                members: ex.members.clone(),
                tag: (ex.tag.0, ex.tag.1 | PARTIALS),
                finish: Finish::Nothing,
                operands: ex.operands.clone(),
            };
            let mut sources = Vec::with_capacity(msgs.len());
            for (k, m) in msgs.into_iter().enumerate() {
                if k == my {
                    sources.push(Src::Local(Payload::Moe(m)));
                } else {
                    let key = (be.device, second.members[k], second.tag.0, second.tag.1);
                    be.fabric.send_checked(
                        key,
                        Payload::Moe(m),
                        Some(second.operands.clone()),
                        be.max_in_flight,
                        be.timeout,
                        name,
                    )?;
                    sources.push(Src::Remote(k));
                }
            }
            let mut partials = Vec::with_capacity(sources.len());
            for src in sources {
                let p = receive(be, &second, src)?;
                partials.push(moe(&second, p)?);
            }
            be.write_views(&[&out], |outs| {
                cpu_ops::unpack_combine(&partials, &mut outs[0]).map_err(Into::into)
            })
        }
    }
}

fn reduce_f32(parts: &[Storage], op: ReduceOp) -> Vec<f32> {
    let mut it = parts.iter();
    let mut acc = it.next().map(Storage::to_f32_vec).unwrap_or_default();
    for p in it {
        for (a, b) in acc.iter_mut().zip(p.to_f32_vec()) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
            };
        }
    }
    if op == ReduceOp::Avg && !parts.is_empty() {
        let n = parts.len() as f32;
        acc.iter_mut().for_each(|a| *a /= n);
    }
    acc
}

fn reduce_i64(parts: &[Storage], op: ReduceOp) -> Vec<i64> {
    let mut it = parts.iter();
    let mut acc = it.next().map(Storage::to_i64_vec).unwrap_or_default();
    for p in it {
        for (a, b) in acc.iter_mut().zip(p.to_i64_vec()) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                ReduceOp::Max => (*a).max(b),
                ReduceOp::Min => (*a).min(b),
            };
        }
    }
    if op == ReduceOp::Avg && !parts.is_empty() {
        let n = parts.len() as i64;
        acc.iter_mut().for_each(|a| *a /= n);
    }
    acc
}
