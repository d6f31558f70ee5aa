//! The NCCL transport: one kernel routes and packs one wire row per (token, destination) into
//! per-destination blocks (`[16-byte count header][T rows]`; the row to this rank itself carries
//! only the metadata, the kernel fans the token out to the local experts directly), one grouped
//! send/recv per peer moves them, one kernel fans the received ones out. The combine reduces into per-source blocks of `T`
//! partial rows (row `j` answers the source's row `j`), one grouped send/recv, one kernel sums.
//! No host reads of counts: NCCL moves whole blocks (sized by the bound `T` rows), whatever the
//! routing; [`super::NvlinkMoe`] moves only the rows used.

use super::kernel_calls::{self, LateWeights, SourceRows};
use super::layout::{nccl_block_bytes, NCCL_HEADER as HEADER};
use super::transport::{
    core_accessors, zeroed_u32, CombineRequest, Core, DispatchRequest, MoeTransport, Phase,
};
use super::{MoeShape, MoeWire};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::nccl::{self, Comm};
use crate::proxy::StagedRoute;
use crate::stream::Stream;

/// One rank's NCCL MoE transport (see the [module docs](super)).
pub struct NcclMoe {
    core: Core,
    comm: Comm,
    /// Bytes of one dispatch block: the header and `T` wire rows.
    block_bytes: usize,
    /// `[W]` dispatch blocks out and in.
    send: DeviceBuffer,
    recv: DeviceBuffer,
    /// `[W, T]` combine partial rows out and in.
    comb_send: DeviceBuffer,
    comb_recv: DeviceBuffer,
    /// `[W, T, K]` f32 weights received from every peer (combine without dispatch weights).
    w_recv: DeviceBuffer,
    /// `[2]` u32 grid counters (dispatch send, dispatch receive).
    done: DeviceBuffer,
    /// Peers on other nodes are reached through the host proxy instead of NCCL.
    route: Option<StagedRoute>,
}

impl NcclMoe {
    /// Creates the transport for `comm`'s rank (the team is `comm`'s ranks, `shape.world` of
    /// them) on `comm`'s device, with native rows; allocates every buffer.
    pub fn new(comm: Comm, shape: &MoeShape) -> Result<NcclMoe> {
        NcclMoe::with_wire(comm, shape, MoeWire::Native)
    }

    /// [`NcclMoe::new`] with token rows encoded as `wire`.
    pub fn with_wire(comm: Comm, shape: &MoeShape, wire: MoeWire) -> Result<NcclMoe> {
        if comm.size() != shape.world {
            return Err(KernelError::InvalidArgument(format!(
                "NCCL communicator has {} ranks, the MoE team {}",
                comm.size(),
                shape.world
            )));
        }
        let device = comm.device().clone();
        let core = Core::new(&device, shape, wire, comm.rank())?;
        let stream = Stream::new(&device)?;
        let (w, t, k) = (shape.world, shape.tokens, shape.top_k);
        let block_bytes = nccl_block_bytes(shape, wire);
        let zeroed = |bytes: usize| -> Result<DeviceBuffer> {
            let b = DeviceBuffer::alloc(&device, bytes.max(16))?;
            b.zero(&stream)?;
            Ok(b)
        };
        let part = w * t * shape.y_row_bytes();
        let me = NcclMoe {
            block_bytes,
            send: zeroed(w * block_bytes)?,
            recv: zeroed(w * block_bytes)?,
            comb_send: zeroed(part)?,
            comb_recv: zeroed(part)?,
            w_recv: zeroed(w * t * k * 4)?,
            done: zeroed_u32(&device, &stream, 2)?,
            core,
            comm,
            route: None,
        };
        stream.synchronize()?;
        Ok(me)
    }

    /// The transports of a team whose ranks are `devices` (one GPU each, all in this process),
    /// over communicators made with `ncclCommInitAll`. Rank `i` runs on `devices[i]`.
    pub fn team(devices: &[Device], shape: &MoeShape) -> Result<Vec<NcclMoe>> {
        NcclMoe::team_with_wire(devices, shape, MoeWire::Native)
    }

    /// [`NcclMoe::team`] with token rows encoded as `wire`.
    pub fn team_with_wire(
        devices: &[Device],
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<Vec<NcclMoe>> {
        let lib = nccl::NcclLib::load()?;
        Comm::init_all(&lib, devices)?
            .into_iter()
            .map(|c| NcclMoe::with_wire(c, shape, wire))
            .collect()
    }

    /// The communicator.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Gives the communicator back (e.g. to build a transport of another shape).
    pub fn into_comm(self) -> Comm {
        self.comm
    }

    /// Reaches the team members `route` says are on other nodes through the host proxy
    /// (blocks staged through pinned host memory in stream order; see [`StagedRoute`]); the
    /// others stay on NCCL. The route's team must be this transport's team, in order.
    pub fn set_route(&mut self, route: StagedRoute) {
        self.route = Some(route);
    }

    /// The first failure of a transfer through the host proxy, if any (see
    /// [`StagedRoute::failure`]).
    pub fn route_failure(&self) -> Option<KernelError> {
        self.route.as_ref().and_then(|r| r.failure())
    }
}

/// Where the fan-out and the combine find the rows of every source: this rank's own rows in
/// its send blocks, the others' in the receive blocks, each count in its block's header.
fn sources<'a>(
    send: &'a DeviceBuffer,
    recv: &'a DeviceBuffer,
    block_bytes: usize,
) -> SourceRows<'a> {
    SourceRows {
        own: send,
        other: recv,
        block_bytes,
        row_off: HEADER,
        own_cnt: send,
        other_cnt: recv,
        cnt_stride: block_bytes,
    }
}

/// One exchange block: `bytes` per peer, peer `p`'s part of the send buffer at `p *
/// send_stride` (0: the same part for every peer) and of the receive buffer at `p * bytes`.
#[derive(Clone, Copy)]
struct Block<'a> {
    send: &'a DeviceBuffer,
    send_stride: usize,
    recv: &'a DeviceBuffer,
    bytes: usize,
}

/// Exchanges `block` with every peer: one NCCL group with the peers of this node, one message
/// through `route` with peers on other nodes. Nothing to do on a team of one.
fn exchange(
    comm: &Comm,
    route: Option<&mut StagedRoute>,
    stream: &Stream,
    rank: usize,
    block: Block<'_>,
) -> Result<()> {
    if comm.size() == 1 || block.bytes == 0 {
        return Ok(());
    }
    let peers: Vec<usize> = (0..comm.size()).filter(|p| *p != rank).collect();
    let remote = |p: usize| route.as_ref().is_some_and(|r| r.is_remote(p));
    let (far, near): (Vec<usize>, Vec<usize>) = peers.iter().partition(|&&p| remote(p));
    let send_view = |p: usize| block.send.view(p * block.send_stride, block.bytes);
    let recv_view = |p: usize| block.recv.view(p * block.bytes, block.bytes);
    // The sends to other nodes first (they only wait for this rank's packing), then the NCCL
    // group of this node, then the messages of the other nodes.
    let mut tag = route.map(|r| (r.next_tag(), r));
    if let Some((tag, r)) = &mut tag {
        for &p in &far {
            r.send(stream, p, *tag, &[&send_view(p)?])?;
        }
    }
    if !near.is_empty() {
        nccl::group(comm.lib(), || {
            for &p in &near {
                comm.send(&send_view(p)?, DType::U8, p, stream)?;
                comm.recv(&recv_view(p)?, DType::U8, p, stream)?;
            }
            Ok(())
        })?;
    }
    if let Some((tag, r)) = &mut tag {
        for &p in &far {
            r.recv(stream, p, *tag, &[&recv_view(p)?])?;
        }
    }
    Ok(())
}

impl MoeTransport for NcclMoe {
    core_accessors!();

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn dispatch_send(&mut self, stream: &Stream, req: &DispatchRequest<'_>) -> Result<()> {
        self.core.check_dispatch(req)?;
        let NcclMoe {
            core,
            comm,
            block_bytes,
            send,
            recv,
            done,
            route,
            ..
        } = self;
        let block_bytes = *block_bytes;
        core.step(
            "dispatch_send",
            Phase::Idle,
            Phase::DispatchSent,
            stream,
            |c| {
                c.weights_at_dispatch = req.weights.is_some();
                c.set_outputs(req)?;
                let (inp, st) = c.send_parts(req)?;
                kernel_calls::nccl_dispatch_send(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.wire,
                    c.rank,
                    &inp,
                    &st,
                    send,
                    block_bytes,
                    &done.view(0, 4)?,
                )?;
                let block = Block {
                    send,
                    send_stride: block_bytes,
                    recv,
                    bytes: block_bytes,
                };
                exchange(comm, route.as_mut(), stream, c.rank, block)?;
                c.zero_padding = req.zero_padding;
                Ok(())
            },
        )
    }

    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()> {
        let done = self.done.view(4, 4)?;
        let NcclMoe {
            core,
            block_bytes,
            send,
            recv,
            ..
        } = self;
        let src = sources(send, recv, *block_bytes);
        core.step(
            "dispatch_recv",
            Phase::DispatchSent,
            Phase::Dispatched,
            stream,
            |c| {
                let out = c.recv_outputs(&done)?;
                kernel_calls::dispatch_recv(
                    &c.kernels, stream, &c.shape, c.wire, c.rank, None, &src, &out,
                )?;
                c.finish_padding(stream)
            },
        )
    }

    fn combine_send(&mut self, stream: &Stream, req: &CombineRequest<'_>) -> Result<()> {
        self.core.check_combine(req)?;
        let NcclMoe {
            core,
            comm,
            block_bytes,
            send,
            recv,
            comb_send,
            comb_recv,
            w_recv,
            route,
            ..
        } = self;
        let src = sources(send, recv, *block_bytes);
        core.step(
            "combine_send",
            Phase::Dispatched,
            Phase::CombineSent,
            stream,
            |c| {
                let s = c.shape;
                let tk4 = s.tokens * s.top_k * 4;
                let late = match req.weights {
                    Some(w) => {
                        let block = Block {
                            send: w,
                            send_stride: 0,
                            recv: w_recv,
                            bytes: tk4,
                        };
                        exchange(comm, route.as_mut(), stream, c.rank, block)?;
                        Some(LateWeights {
                            w_self: w,
                            w_peers: w_recv,
                        })
                    }
                    None => None,
                };
                kernel_calls::nccl_combine_send(
                    &c.kernels,
                    stream,
                    &s,
                    c.wire,
                    c.rank,
                    &src,
                    req.expert_y,
                    &c.fan,
                    late.as_ref(),
                    comb_send,
                    &c.status,
                )?;
                let part = s.tokens * s.y_row_bytes();
                let block = Block {
                    send: comb_send,
                    send_stride: part,
                    recv: comb_recv,
                    bytes: part,
                };
                exchange(comm, route.as_mut(), stream, c.rank, block)
            },
        )
    }

    fn combine_recv(&mut self, stream: &Stream, out: &DeviceBuffer) -> Result<()> {
        self.core.check_out(out)?;
        let NcclMoe {
            core,
            comb_send,
            comb_recv,
            ..
        } = self;
        core.step(
            "combine_recv",
            Phase::CombineSent,
            Phase::Idle,
            stream,
            |c| {
                kernel_calls::combine_recv(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.rank,
                    None,
                    comb_send,
                    comb_recv,
                    &c.sent_pos,
                    out,
                    &c.status,
                )
            },
        )
    }

    fn received_rows(&self, stream: &Stream) -> Result<Vec<usize>> {
        let rank = self.core.rank;
        self.core.read_counts(stream, |s| {
            let blocks = if s == rank { &self.send } else { &self.recv };
            blocks.view(s * self.block_bytes, 4)
        })
    }
}
