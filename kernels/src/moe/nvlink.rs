//! The NVLink transport: every rank owns one symmetric allocation (same layout on every rank)
//! that its peers map, either in this process (peer access) or through CUDA IPC.
//!
//! Per step `s` (epoch `s`, flags are never reset):
//! 1. `dispatch_send`: one kernel, one warp per `(t, k)` row: reserve a row in the receiver's
//!    per-expert counter (`atom.add.sys`; counters double-buffered by epoch parity), store the
//!    row (16-byte vectors) and its routing straight into the receiver's `expert_x` /
//!    `routing`; the last block raises `dispatch_flag[me] = s` in every receiver
//!    (`st.release.sys` after `__threadfence_system`).
//! 2. `dispatch_recv`: acquire all `W` flags, `counts = min(counter, C)` (overflow flagged), reset
//!    the other parity's counters for step `s + 1`, zero padding rows.
//! 3. `combine_send`: every valid expert row goes straight into slot `[t, k]` of its source's
//!    `[T, K, F]` receive area with `mark[t, k] = s`; then `combine_flag[me] = s` everywhere.
//! 4. `combine_recv`: acquire all flags, `out[t] = Σ_k w · slot[t, k]` over marked slots.
//!
//! Reuse across steps needs no acknowledgements: a peer writes into this rank's buffers in step
//! `s + 1` only after its `combine_recv(s)`, which waited for this rank's `combine_send(s)`, which
//! follows (in stream order) this rank's reads of step `s`'s dispatch outputs and counters; the
//! combine slots are likewise protected by `dispatch_recv(s + 1)` waiting for every sender.

use super::ipc::{self, IpcMapping, HANDLE_LEN};
use super::launch::{self, ExpertRows, NvlTargets};
use super::transport::{Core, MoeTransport, Phase};
use super::{MoeShape, MoeStatus};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// Byte offsets of the regions of the symmetric allocation (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SymLayout {
    /// `expert_x[L, C, H]`.
    x: usize,
    /// `routing[L, C, 2]` i32.
    routing: usize,
    /// `[2, L]` i32 row counters, by epoch parity.
    counters: usize,
    /// `[W]` u32 dispatch flags, one per sender.
    dispatch_flags: usize,
    /// `[W]` u32 combine flags, one per sender.
    combine_flags: usize,
    /// `[T, K, F]` combine receive slots.
    slots: usize,
    /// `[T, K]` u32 epoch marks of the slots.
    marks: usize,
    total: usize,
}

impl SymLayout {
    fn of(shape: &MoeShape) -> SymLayout {
        let (l, c, w) = (shape.local_experts(), shape.capacity, shape.world);
        let tk = shape.tokens * shape.top_k;
        let mut at = 0usize;
        let mut region = |bytes: usize| {
            let start = at;
            at = (at + bytes).div_ceil(256) * 256;
            start
        };
        SymLayout {
            x: region(l * c * shape.x_row_bytes()),
            routing: region(l * c * 8),
            counters: region(2 * l * 4),
            dispatch_flags: region(w * 4),
            combine_flags: region(w * 4),
            slots: region(tk * shape.y_row_bytes()),
            marks: region(tk * 4),
            total: at.max(256),
        }
    }

    fn counters(&self, shape: &MoeShape, epoch: u32) -> usize {
        self.counters + (epoch as usize % 2) * shape.local_experts() * 4
    }
}

/// Device address tables of the peers (`[W]` u64 each), built once the team is connected.
struct Tables {
    peer_sym: DeviceBuffer,
    dispatch_flag_ptrs: DeviceBuffer,
    combine_flag_ptrs: DeviceBuffer,
}

/// What keeps a peer's symmetric allocation reachable (the payloads are held for their `Drop`).
#[allow(dead_code)]
enum PeerMemory {
    /// This rank's own allocation.
    Own,
    /// Another device of this process (peer access).
    Local(DeviceBuffer),
    /// Another process's allocation, mapped over CUDA IPC.
    Ipc(IpcMapping),
}

/// Magic prefix of [`NvlinkMoe::export_handles`].
const HANDLE_MAGIC: &[u8; 8] = b"MFMOEIP1";

/// One rank's NVLink MoE transport (see the [module docs](super) and the protocol above).
pub struct NvlinkMoe {
    core: Core,
    layout: SymLayout,
    sym: DeviceBuffer,
    expert_x: DeviceBuffer,
    routing: DeviceBuffer,
    /// `[2]` u32 grid-completion counters (dispatch copy, combine send).
    done: DeviceBuffer,
    peers: Vec<PeerMemory>,
    tables: Option<Tables>,
    flag_timeout_ns: u64,
}

impl NvlinkMoe {
    fn unconnected(device: &Device, shape: &MoeShape, rank: usize) -> Result<NvlinkMoe> {
        let core = Core::new(device, shape, rank)?;
        let layout = SymLayout::of(shape);
        let stream = Stream::new(device)?;
        let sym = DeviceBuffer::alloc(device, layout.total)?;
        sym.zero(&stream)?;
        let (l, c) = (shape.local_experts(), shape.capacity);
        let t = NvlinkMoe {
            expert_x: sym.view(layout.x, l * c * shape.x_row_bytes())?,
            routing: sym.view(layout.routing, l * c * 8)?,
            done: launch::zeroed_i32(&stream, 2)?,
            sym,
            layout,
            core,
            peers: Vec::new(),
            tables: None,
            flag_timeout_ns: launch::FLAG_TIMEOUT_NS,
        };
        stream.synchronize()?;
        Ok(t)
    }

    /// Builds the address tables from every rank's symmetric base address.
    fn connect(&mut self, bases: &[u64], peers: Vec<PeerMemory>) -> Result<()> {
        let stream = Stream::new(&self.core.device)?;
        let me = self.core.rank as u64;
        let lay = self.layout;
        let table = |off: usize, per_rank: u64| {
            let addrs: Vec<u64> = bases.iter().map(|b| b + off as u64 + per_rank).collect();
            launch::address_table(&stream, &addrs)
        };
        self.tables = Some(Tables {
            peer_sym: table(0, 0)?,
            dispatch_flag_ptrs: table(lay.dispatch_flags, me * 4)?,
            combine_flag_ptrs: table(lay.combine_flags, me * 4)?,
        });
        self.peers = peers;
        Ok(())
    }

    /// Creates the transports of a team whose ranks are `devices` (one distinct GPU per rank,
    /// all in this process): enables peer access between every pair and exchanges the
    /// symmetric buffers' addresses. Rank `i` of the result runs on `devices[i]`; hand each to
    /// the thread driving that GPU.
    pub fn team(devices: &[Device], shape: &MoeShape) -> Result<Vec<NvlinkMoe>> {
        if devices.len() != shape.world {
            return Err(KernelError::InvalidArgument(format!(
                "NVLink MoE team of {} ranks given {} devices",
                shape.world,
                devices.len()
            )));
        }
        for (i, a) in devices.iter().enumerate() {
            for b in &devices[i + 1..] {
                if a.same_as(b) {
                    return Err(KernelError::InvalidArgument(format!(
                        "NVLink MoE team uses device {} twice (one GPU per rank)",
                        a.ordinal()
                    )));
                }
                a.enable_peer_access(b)?;
                b.enable_peer_access(a)?;
            }
        }
        let mut ranks = devices
            .iter()
            .enumerate()
            .map(|(r, d)| NvlinkMoe::unconnected(d, shape, r))
            .collect::<Result<Vec<_>>>()?;
        let bases: Vec<u64> = ranks.iter().map(|r| r.sym.addr()).collect();
        let syms: Vec<DeviceBuffer> = ranks.iter().map(|r| r.sym.clone()).collect();
        for (r, rank) in ranks.iter_mut().enumerate() {
            let peers = syms
                .iter()
                .enumerate()
                .map(|(p, b)| {
                    if p == r {
                        PeerMemory::Own
                    } else {
                        PeerMemory::Local(b.clone())
                    }
                })
                .collect();
            rank.connect(&bases, peers)?;
        }
        Ok(ranks)
    }

    /// Creates rank `rank` of a multi-process team on `device`. Before use, every rank sends
    /// [`export_handles`](Self::export_handles) to every other (a rendezvous of the caller's
    /// choice) and calls [`import_handles`](Self::import_handles) with all of them.
    pub fn new_ipc(device: &Device, shape: &MoeShape, rank: usize) -> Result<NvlinkMoe> {
        NvlinkMoe::unconnected(device, shape, rank)
    }

    /// This rank's CUDA IPC handle and layout check, as bytes for the rendezvous.
    pub fn export_handles(&self) -> Result<Vec<u8>> {
        let handle = ipc::export(&self.sym)?;
        let mut out = Vec::with_capacity(HANDLE_MAGIC.len() + 16 + HANDLE_LEN);
        out.extend_from_slice(HANDLE_MAGIC);
        out.extend_from_slice(&(self.core.rank as u64).to_le_bytes());
        out.extend_from_slice(&(self.layout.total as u64).to_le_bytes());
        out.extend_from_slice(&handle);
        Ok(out)
    }

    /// Maps every peer's symmetric allocation from `handles[r]` (the export of rank `r`; this
    /// rank's own entry is checked and otherwise ignored) and connects the team.
    pub fn import_handles(&mut self, handles: &[Vec<u8>]) -> Result<()> {
        let w = self.core.shape.world;
        if handles.len() != w {
            return Err(KernelError::InvalidArgument(format!(
                "NVLink MoE import: {} handles for a team of {w}",
                handles.len()
            )));
        }
        let mut bases = Vec::with_capacity(w);
        let mut peers = Vec::with_capacity(w);
        for (r, bytes) in handles.iter().enumerate() {
            let handle = self.parse_handle(r, bytes)?;
            if r == self.core.rank {
                bases.push(self.sym.addr());
                peers.push(PeerMemory::Own);
            } else {
                let mapping = IpcMapping::open(&self.core.device, &handle)?;
                bases.push(mapping.addr());
                peers.push(PeerMemory::Ipc(mapping));
            }
        }
        self.connect(&bases, peers)
    }

    fn parse_handle(&self, rank: usize, bytes: &[u8]) -> Result<[u8; HANDLE_LEN]> {
        let bad = |why: &str| {
            Err(KernelError::InvalidArgument(format!(
                "NVLink MoE import: the handle of rank {rank} {why}"
            )))
        };
        let m = HANDLE_MAGIC.len();
        if bytes.len() != m + 16 + HANDLE_LEN || &bytes[..m] != HANDLE_MAGIC {
            return bad("is not an NVLink MoE export");
        }
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if word(m) != rank as u64 {
            return bad(&format!("names rank {}", word(m)));
        }
        if word(m + 8) != self.layout.total as u64 {
            return bad(&format!(
                "describes {} bytes, this rank's layout has {} (different shapes?)",
                word(m + 8),
                self.layout.total
            ));
        }
        let mut h = [0u8; HANDLE_LEN];
        h.copy_from_slice(&bytes[m + 16..]);
        Ok(h)
    }

    /// How long a receive waits on the device for a peer before giving up with
    /// [`MoeStatus::TIMEOUT`] (default 10 s; once raised, later waits give up at once until
    /// [`MoeTransport::clear_status`]).
    pub fn set_flag_timeout(&mut self, timeout: std::time::Duration) {
        self.flag_timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
    }

    fn tables(&self) -> Result<&Tables> {
        self.tables.as_ref().ok_or_else(|| {
            KernelError::InvalidArgument(format!(
                "NVLink MoE rank {} is not connected: call import_handles first",
                self.core.rank
            ))
        })
    }
}

impl MoeTransport for NvlinkMoe {
    fn name(&self) -> &'static str {
        "nvlink"
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
        self.tables()?;
        let NvlinkMoe {
            core,
            layout,
            done,
            tables,
            ..
        } = self;
        let tables = tables
            .as_ref()
            .ok_or_else(|| KernelError::InvalidArgument("not connected".into()))?;
        core.step(
            "dispatch_send",
            Phase::Idle,
            Phase::DispatchSent,
            stream,
            |c| {
                c.epoch = c.epoch.wrapping_add(1);
                let s = c.shape;
                let dispatch_done = done.view(0, 4)?;
                let targets = NvlTargets {
                    peer_sym: &tables.peer_sym,
                    x_off: layout.x,
                    routing_off: layout.routing,
                    counter_off: layout.counters(&s, c.epoch),
                    flag_ptrs: &tables.dispatch_flag_ptrs,
                    done: &dispatch_done,
                };
                launch::nvl_dispatch_send(
                    &c.kernels, stream, &s, c.rank, x, topk_idx, &targets, &c.status, c.epoch,
                )
            },
        )
    }

    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()> {
        let NvlinkMoe {
            core,
            layout,
            sym,
            expert_x,
            routing,
            flag_timeout_ns,
            ..
        } = self;
        core.step(
            "dispatch_recv",
            Phase::DispatchSent,
            Phase::Dispatched,
            stream,
            |c| {
                let s = c.shape;
                let l4 = s.local_experts() * 4;
                let flags = sym.view(layout.dispatch_flags, s.world * 4)?;
                let counters = sym.view(layout.counters(&s, c.epoch), l4)?;
                let next = sym.view(layout.counters(&s, c.epoch.wrapping_add(1)), l4)?;
                launch::nvl_dispatch_recv(
                    &c.kernels,
                    stream,
                    &s,
                    &flags,
                    c.epoch,
                    *flag_timeout_ns,
                    &counters,
                    &next,
                    &c.counts,
                    expert_x,
                    routing,
                    &c.status,
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
        self.tables()?;
        let NvlinkMoe {
            core,
            layout,
            done,
            tables,
            ..
        } = self;
        let tables = tables
            .as_ref()
            .ok_or_else(|| KernelError::InvalidArgument("not connected".into()))?;
        core.step(
            "combine_send",
            Phase::Dispatched,
            Phase::CombineSent,
            stream,
            |c| {
                let combine_done = done.view(4, 4)?;
                let rows = ExpertRows {
                    y: expert_y,
                    counts: expert_counts,
                    routing,
                };
                launch::nvl_combine_send(
                    &c.kernels,
                    stream,
                    &c.shape,
                    &rows,
                    &tables.peer_sym,
                    layout.slots,
                    layout.marks,
                    c.epoch,
                    &c.status,
                    &combine_done,
                    &tables.combine_flag_ptrs,
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
        let NvlinkMoe {
            core,
            layout,
            sym,
            flag_timeout_ns,
            ..
        } = self;
        core.step(
            "combine_recv",
            Phase::CombineSent,
            Phase::Idle,
            stream,
            |c| {
                let s = c.shape;
                let tk = s.tokens * s.top_k;
                let flags = sym.view(layout.combine_flags, s.world * 4)?;
                let slots = sym.view(layout.slots, tk * s.y_row_bytes())?;
                let marks = sym.view(layout.marks, tk * 4)?;
                launch::nvl_combine_recv(
                    &c.kernels,
                    stream,
                    &s,
                    &flags,
                    c.epoch,
                    *flag_timeout_ns,
                    &c.status,
                    &slots,
                    &marks,
                    weights,
                    out,
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

impl Drop for NvlinkMoe {
    fn drop(&mut self) {
        // Kernels of this rank may still use the peer mappings: let them finish before the IPC
        // mappings close. (Peers writing into this rank's memory are the caller's to finish.)
        if self.peers.iter().any(|p| matches!(p, PeerMemory::Ipc(_))) {
            if let Err(e) = self.core.device.synchronize() {
                tracing::warn!(
                    rank = self.core.rank,
                    "synchronize before unmapping peers failed: {e}"
                );
            }
        }
    }
}
