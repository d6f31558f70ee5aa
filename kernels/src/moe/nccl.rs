//! The NCCL transport: device histogram and packing, padded per-destination blocks moved with
//! grouped send/recv, device-side unpacking. No host reads of counts: the blocks are sized by
//! the bound `T · min(K, L)` rows (dispatch) and `min(L · C, T · min(K, L))` rows (combine), so
//! NCCL moves the padded size whatever the routing. That is the price of a host-sync-free
//! NCCL path; [`super::NvlinkMoe`] moves only the real rows.

use super::launch::{self, ExpertRows, NcclCombineRecv, NcclRecv};
use super::transport::{Core, MoeTransport, Phase};
use super::{MoeShape, MoeStatus};
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
    expert_x: DeviceBuffer,
    routing: DeviceBuffer,
    /// `[W]` blocks of rows (dispatch: `P` rows of H; combine: `Pc` rows of F).
    send_x: DeviceBuffer,
    recv_x: DeviceBuffer,
    /// `[W, P, 2]` i32 (dispatch: team-global token, k; combine: local token, k).
    send_meta: DeviceBuffer,
    recv_meta: DeviceBuffer,
    recv_cnt: DeviceBuffer,
    src_off: DeviceBuffer,
    dst_off: DeviceBuffer,
    src_total: DeviceBuffer,
    comb_send_cnt: DeviceBuffer,
    comb_recv_cnt: DeviceBuffer,
    slot_idx: DeviceBuffer,
    /// Sender workspace: rows per expert `[E]`, rank of each row in its expert `[T * K]`,
    /// offset of each expert in its destination's block `[E]`.
    cnt: DeviceBuffer,
    pos: DeviceBuffer,
    base: DeviceBuffer,
    /// Peers on other nodes are reached through the host proxy instead of NCCL.
    route: Option<StagedRoute>,
}

impl NcclMoe {
    /// Creates the transport for `comm`'s rank (the team is `comm`'s ranks, `shape.world` of
    /// them) on `comm`'s device; allocates every buffer.
    pub fn new(comm: Comm, shape: &MoeShape) -> Result<NcclMoe> {
        if comm.size() != shape.world {
            return Err(KernelError::InvalidArgument(format!(
                "NCCL communicator has {} ranks, the MoE team {}",
                comm.size(),
                shape.world
            )));
        }
        let device = comm.device().clone();
        let core = Core::new(&device, shape, comm.rank())?;
        let stream = Stream::new(&device)?;
        let (w, l, c) = (shape.world, shape.local_experts(), shape.capacity);
        let (pair, cpair) = (shape.pair_rows(), shape.combine_pair_rows());
        let block = (pair * shape.x_row_bytes()).max(cpair * shape.y_row_bytes());
        let alloc = |bytes: usize| DeviceBuffer::alloc(&device, bytes);
        let send_x = alloc(w * block)?;
        let send_meta = alloc(w * pair * 8)?;
        let t = NcclMoe {
            expert_x: alloc(l * c * shape.x_row_bytes())?,
            routing: alloc(l * c * 8)?,
            recv_x: alloc(w * block)?,
            recv_meta: alloc(w * pair * 8)?,
            recv_cnt: launch::zeroed_i32(&stream, w * l)?,
            src_off: launch::zeroed_i32(&stream, w * l)?,
            dst_off: launch::zeroed_i32(&stream, w * l)?,
            src_total: launch::zeroed_i32(&stream, w)?,
            comb_send_cnt: launch::zeroed_i32(&stream, w)?,
            comb_recv_cnt: launch::zeroed_i32(&stream, w)?,
            slot_idx: DeviceBuffer::alloc_elems(&device, DType::I32, shape.tokens * shape.top_k)?,
            cnt: launch::zeroed_i32(&stream, shape.experts)?,
            pos: launch::zeroed_i32(&stream, shape.tokens * shape.top_k)?,
            base: launch::zeroed_i32(&stream, shape.experts)?,
            send_x,
            send_meta,
            core,
            comm,
            route: None,
        };
        stream.synchronize()?;
        Ok(t)
    }

    /// The transports of a team whose ranks are `devices` (one GPU each, all in this process),
    /// over communicators made with `ncclCommInitAll`. Rank `i` runs on `devices[i]`.
    pub fn team(devices: &[Device], shape: &MoeShape) -> Result<Vec<NcclMoe>> {
        let lib = nccl::NcclLib::load()?;
        Comm::init_all(&lib, devices)?
            .into_iter()
            .map(|c| NcclMoe::new(c, shape))
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

/// Exchanges, with every peer `p`, block `p` of each send buffer of `blocks` (`counts` (i32),
/// `rows` (bytes) and `meta` (i32)) for block `p` of the matching receive buffer (each tuple
/// is `(send, recv, bytes per block)`): one NCCL group with the peers of this node, and the
/// three blocks as one message through `route` with peers on other nodes. Nothing to do on a
/// team of one.
fn exchange(
    comm: &Comm,
    route: Option<&mut StagedRoute>,
    stream: &Stream,
    rank: usize,
    blocks: [(&DeviceBuffer, &DeviceBuffer, usize, DType); 3],
) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let peers: Vec<usize> = (0..comm.size()).filter(|p| *p != rank).collect();
    let remote = |p: usize| route.as_ref().is_some_and(|r| r.is_remote(p));
    let (far, near): (Vec<usize>, Vec<usize>) = peers.iter().partition(|&&p| remote(p));
    let block_views = |p: usize, send: bool| -> Result<Vec<DeviceBuffer>> {
        blocks
            .iter()
            .filter(|b| b.2 > 0)
            .map(|&(s, r, bytes, _)| (if send { s } else { r }).view(p * bytes, bytes))
            .collect()
    };
    // The sends to other nodes first (they only wait for this rank's packing), then the NCCL
    // group of this node, then the messages of the other nodes.
    let mut tag = route.map(|r| (r.next_tag(), r));
    if let Some((tag, r)) = &mut tag {
        for &p in &far {
            let parts = block_views(p, true)?;
            r.send(stream, p, *tag, &parts.iter().collect::<Vec<_>>())?;
        }
    }
    if !near.is_empty() {
        nccl::group(comm.lib(), || {
            for &p in &near {
                for (send, recv, bytes, dtype) in blocks {
                    if bytes == 0 {
                        continue;
                    }
                    comm.send(&send.view(p * bytes, bytes)?, dtype, p, stream)?;
                    comm.recv(&recv.view(p * bytes, bytes)?, dtype, p, stream)?;
                }
            }
            Ok(())
        })?;
    }
    if let Some((tag, r)) = &mut tag {
        for &p in &far {
            let parts = block_views(p, false)?;
            r.recv(stream, p, *tag, &parts.iter().collect::<Vec<_>>())?;
        }
    }
    Ok(())
}

impl MoeTransport for NcclMoe {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn shape(&self) -> &MoeShape {
        &self.core.shape
    }

    fn rank(&self) -> usize {
        self.core.rank
    }

    fn device(&self) -> &Device {
        &self.core.device
    }

    fn dispatch_send(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer,
        topk_idx: &DeviceBuffer,
    ) -> Result<()> {
        self.core.check_dispatch_inputs(x, topk_idx)?;
        let NcclMoe {
            core,
            comm,
            send_x,
            recv_x,
            send_meta,
            recv_meta,
            recv_cnt,
            cnt,
            pos,
            base,
            route,
            ..
        } = self;
        core.step(
            "dispatch_send",
            Phase::Idle,
            Phase::DispatchSent,
            stream,
            |c| {
                let s = c.shape;
                launch::route(&c.kernels, stream, &s, topk_idx, cnt, pos, base, &c.status)?;
                launch::nccl_dispatch_pack(
                    &c.kernels, stream, &s, c.rank, x, topk_idx, pos, base, send_x, send_meta,
                )?;
                let l = s.local_experts();
                exchange(
                    comm,
                    route.as_mut(),
                    stream,
                    c.rank,
                    [
                        (cnt, recv_cnt, l * 4, DType::I32),
                        (send_x, recv_x, s.pair_rows() * s.x_row_bytes(), DType::U8),
                        (send_meta, recv_meta, s.pair_rows() * 8, DType::I32),
                    ],
                )
            },
        )
    }

    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()> {
        let bufs = NcclRecv {
            send_x: &self.send_x,
            recv_x: &self.recv_x,
            send_meta: &self.send_meta,
            recv_meta: &self.recv_meta,
            recv_cnt: &self.recv_cnt,
            src_off: &self.src_off,
            dst_off: &self.dst_off,
            src_total: &self.src_total,
        };
        let (expert_x, routing, own_cnt) = (&self.expert_x, &self.routing, &self.cnt);
        self.core.step(
            "dispatch_recv",
            Phase::DispatchSent,
            Phase::Dispatched,
            stream,
            |c| {
                launch::nccl_dispatch_recv(
                    &c.kernels, stream, &c.shape, c.rank, own_cnt, &bufs, &c.counts, expert_x,
                    routing, &c.status,
                )
            },
        )
    }

    fn expert_x(&self) -> &DeviceBuffer {
        &self.expert_x
    }

    fn expert_counts(&self) -> &DeviceBuffer {
        &self.core.counts
    }

    fn routing(&self) -> &DeviceBuffer {
        &self.routing
    }

    fn combine_send(
        &mut self,
        stream: &Stream,
        expert_y: &DeviceBuffer,
        expert_counts: &DeviceBuffer,
        routing: &DeviceBuffer,
    ) -> Result<()> {
        self.core
            .check_combine_inputs(expert_y, expert_counts, routing)?;
        let NcclMoe {
            core,
            comm,
            send_x,
            recv_x,
            send_meta,
            recv_meta,
            comb_send_cnt,
            comb_recv_cnt,
            route,
            ..
        } = self;
        core.step(
            "combine_send",
            Phase::Dispatched,
            Phase::CombineSent,
            stream,
            |c| {
                let s = c.shape;
                let rows = ExpertRows {
                    y: expert_y,
                    counts: expert_counts,
                    routing,
                };
                comb_send_cnt.zero(stream)?;
                launch::nccl_combine_pack(
                    &c.kernels,
                    stream,
                    &s,
                    &rows,
                    comb_send_cnt,
                    send_x,
                    send_meta,
                    &c.status,
                )?;
                let cpair = s.combine_pair_rows();
                exchange(
                    comm,
                    route.as_mut(),
                    stream,
                    c.rank,
                    [
                        (comb_send_cnt, comb_recv_cnt, 4, DType::I32),
                        (send_x, recv_x, cpair * s.y_row_bytes(), DType::U8),
                        (send_meta, recv_meta, cpair * 8, DType::I32),
                    ],
                )
            },
        )
    }

    fn combine_recv(
        &mut self,
        stream: &Stream,
        weights: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<()> {
        self.core.check_combine_outputs(weights, out)?;
        let bufs = NcclCombineRecv {
            send_cnt: &self.comb_send_cnt,
            recv_cnt: &self.comb_recv_cnt,
            send_x: &self.send_x,
            recv_x: &self.recv_x,
            send_meta: &self.send_meta,
            recv_meta: &self.recv_meta,
            slot_idx: &self.slot_idx,
        };
        self.core.step(
            "combine_recv",
            Phase::CombineSent,
            Phase::Idle,
            stream,
            |c| {
                launch::nccl_combine_recv(
                    &c.kernels, stream, &c.shape, c.rank, &bufs, weights, out, &c.status,
                )
            },
        )
    }

    fn status(&self, stream: &Stream) -> Result<MoeStatus> {
        self.core.read_status(stream)
    }

    fn clear_status(&self, stream: &Stream) -> Result<()> {
        self.core.status.zero(stream)
    }
}
