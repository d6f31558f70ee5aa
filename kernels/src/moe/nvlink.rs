//! The NVLink transport: every rank owns one symmetric allocation (same layout on every rank)
//! that its peers map, either in this process (peer access) or through CUDA IPC. One kernel per
//! phase, no host work between them, the step number (epoch) on the device: a whole step can be
//! captured in a CUDA graph and replayed.
//!
//! Per step `s` (epoch `s`, flags are never reset):
//! 1. `dispatch_send`: one block per token reads it once and stores its wire row straight into
//!    each receiver's `rows[me][pos]` (`pos` from a local counter, no remote atomics); the row
//!    to this rank itself carries only the metadata, the block fans the token out to the local
//!    experts directly. The last block writes the receivers' `counts[me]` and raises
//!    `dispatch_flags[me] = s` (`st.release.sys` after a system-scope fence), then stores `s`
//!    as the local epoch.
//! 2. `dispatch_recv`: acquire all `W` flags, fan every row received from another rank out to
//!    the local experts (one block per row), counts by the last block.
//! 3. `combine_send`: (weights not given at dispatch: one kernel copies this rank's `[T, K]`
//!    weights into every peer's `weights[me]` and raises `weight_flags[me]`, the next waits for
//!    them) one block per received row reduces its local expert rows into one partial stored in
//!    the source's `partials[me][pos]`; then `combine_flags[me] = s` everywhere.
//! 4. `combine_recv`: acquire all flags, `out[t] = Σ_r partials[r][sent_pos[t, r]]` in rank
//!    order.
//!
//! The fused kernels ([`MoeKernels::Fused`], the default; `moe_fused.cu` states their protocol)
//! run one kernel per phase instead: the dispatch in `dispatch_send`, the combine in
//! `combine_recv`, with per-chunk flags instead of the all-rank flags.
//!
//! Reuse across steps needs no acknowledgements: a peer writes into this rank's areas in step
//! `s + 1` only after its `combine_recv(s)`, which waited for this rank's `combine_send(s)`,
//! which follows (in stream order) every read of step `s`'s rows, counts and weights; the
//! partials are likewise protected by `dispatch_recv(s + 1)` waiting for every sender.

use super::fused::{self, FusedCombine, FusedDispatch, FusedOptions, MoeKernels};
use super::kernel_calls::{self, FlagWait, NvlLocal, PeerRegions, SourceRows};
use super::layout::SymLayout;
use super::transport::{
    core_accessors, zeroed_u32, CombineRequest, Core, DispatchRequest, MoeTransport, Phase,
};
use super::{MoeShape, MoeWire, WireLayout};
use crate::abort::AbortWord;
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::ipc::{IpcHandle, IPC_HANDLE_BYTES as HANDLE_LEN};
use crate::stream::Stream;

/// The `[W]` u64 table of every rank's symmetric base address, built once the team is
/// connected.
struct Tables {
    peer_sym: DeviceBuffer,
}

/// What keeps a peer's symmetric allocation reachable (the payloads are held for their `Drop`).
#[allow(dead_code)]
enum PeerMemory {
    /// This rank's own allocation.
    Own,
    /// Another device of this process (peer access).
    Local(DeviceBuffer),
    /// Another process's allocation, mapped over CUDA IPC.
    Ipc(DeviceBuffer),
}

/// Set to `0` to keep the NVLink MoE kernels from polling the abort word (a lost peer is then
/// noticed at the flag timeout only): a switch for comparisons, not for production.
pub const ABORT_POLL_ENV: &str = "MESHFLOW_MOE_ABORT_POLL";

/// Whether new engines' kernels poll their abort word (see [`ABORT_POLL_ENV`]).
fn abort_polling_enabled() -> bool {
    std::env::var(ABORT_POLL_ENV).map_or(true, |v| v.trim() != "0")
}

/// Magic prefix of [`NvlinkMoe::export_handles`].
const HANDLE_MAGIC: &[u8; 8] = b"MFMOEIP2";

/// Slots of the `[8]` u32 device state: the epoch, then the grid counters of the kernels.
const STATE_WORDS: usize = 8;
const STATE_DISPATCH_RECV_DONE: usize = 4;

/// One rank's NVLink MoE transport (see the [module docs](super) and the protocol above).
pub struct NvlinkMoe {
    core: Core,
    layout: SymLayout,
    sym: DeviceBuffer,
    /// `[8]` u32: `[0]` the epoch, `[1]` dispatch send, `[2]` weights, `[3]` combine send and
    /// `[4]` dispatch receive grid counters.
    state: DeviceBuffer,
    peers: Vec<PeerMemory>,
    tables: Option<Tables>,
    flag_timeout_ns: u64,
    /// Polled by every peer wait of the kernels (see [`NvlinkMoe::abort_word`]).
    abort: AbortWord,
    /// Which kernels run the phases.
    generation: MoeKernels,
    /// The variants of the fused kernels.
    fused: FusedOptions,
    /// `[W]` i32 received-row counters of the fused dispatch (zeroed by it after use).
    recv_cnt: DeviceBuffer,
    /// The fused combine's `expert_y` and whether its weights came with it, from
    /// `combine_send` to `combine_recv`.
    pending_combine: Option<(DeviceBuffer, bool)>,
}

impl NvlinkMoe {
    fn unconnected(
        device: &Device,
        shape: &MoeShape,
        wire: MoeWire,
        rank: usize,
    ) -> Result<NvlinkMoe> {
        let core = Core::new(device, shape, wire, rank)?;
        let abort = AbortWord::new(device)?;
        if abort_polling_enabled() {
            core.watch_abort(&abort)?;
        } else {
            tracing::warn!(
                rank,
                "{ABORT_POLL_ENV}=0: the NVLink MoE kernels do not poll the abort word (a lost \
                 peer is noticed at the flag timeout only)"
            );
        }
        let layout = SymLayout::of(shape, wire);
        let stream = Stream::new(device)?;
        let sym = DeviceBuffer::alloc(device, layout.total)?;
        sym.zero(&stream)?;
        let t = NvlinkMoe {
            generation: MoeKernels::from_env()?,
            fused: FusedOptions::from_env()?,
            recv_cnt: zeroed_u32(device, &stream, shape.world)?,
            pending_combine: None,
            state: zeroed_u32(device, &stream, STATE_WORDS)?,
            sym,
            layout,
            core,
            peers: Vec::new(),
            tables: None,
            flag_timeout_ns: kernel_calls::FLAG_TIMEOUT_NS,
            abort,
        };
        stream.synchronize()?;
        Ok(t)
    }

    /// Builds the address table from every rank's symmetric base address.
    fn connect(&mut self, bases: &[u64], peers: Vec<PeerMemory>) -> Result<()> {
        let stream = Stream::new(&self.core.device)?;
        self.tables = Some(Tables {
            peer_sym: kernel_calls::address_table(&stream, bases)?,
        });
        stream.synchronize()?;
        self.peers = peers;
        Ok(())
    }

    /// Creates the transports of a team whose ranks are `devices` (one distinct GPU per rank,
    /// all in this process), with native rows: enables peer access between every pair and
    /// exchanges the symmetric buffers' addresses. Rank `i` of the result runs on
    /// `devices[i]`; hand each to the thread driving that GPU.
    pub fn team(devices: &[Device], shape: &MoeShape) -> Result<Vec<NvlinkMoe>> {
        NvlinkMoe::team_with_wire(devices, shape, MoeWire::Native)
    }

    /// [`NvlinkMoe::team`] with token rows encoded as `wire`.
    pub fn team_with_wire(
        devices: &[Device],
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<Vec<NvlinkMoe>> {
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
            .map(|(r, d)| NvlinkMoe::unconnected(d, shape, wire, r))
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

    /// Creates rank `rank` of a multi-process team on `device`, with native rows. Before use,
    /// every rank sends [`export_handles`](Self::export_handles) to every other (a rendezvous
    /// of the caller's choice) and calls [`import_handles`](Self::import_handles) with all of
    /// them.
    pub fn new_ipc(device: &Device, shape: &MoeShape, rank: usize) -> Result<NvlinkMoe> {
        NvlinkMoe::unconnected(device, shape, MoeWire::Native, rank)
    }

    /// [`NvlinkMoe::new_ipc`] with token rows encoded as `wire` (every rank alike).
    pub fn new_ipc_with_wire(
        device: &Device,
        shape: &MoeShape,
        wire: MoeWire,
        rank: usize,
    ) -> Result<NvlinkMoe> {
        NvlinkMoe::unconnected(device, shape, wire, rank)
    }

    /// This rank's CUDA IPC handle and layout check, as bytes for the rendezvous.
    pub fn export_handles(&self) -> Result<Vec<u8>> {
        let export = self.sym.export_ipc()?;
        if export.offset != 0 {
            return Err(KernelError::InvalidArgument(
                "the NVLink MoE symmetric buffer is not a whole allocation".into(),
            ));
        }
        let handle = export.handle.to_bytes();
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
                let mapping =
                    DeviceBuffer::open_ipc(&self.core.device, &handle, self.layout.total)?;
                if mapping.len() < self.layout.total {
                    return Err(KernelError::InvalidArgument(format!(
                        "NVLink MoE import: rank {r} maps {} bytes, the layout needs {}",
                        mapping.len(),
                        self.layout.total
                    )));
                }
                bases.push(mapping.addr());
                peers.push(PeerMemory::Ipc(mapping));
            }
        }
        self.connect(&bases, peers)
    }

    fn parse_handle(&self, rank: usize, bytes: &[u8]) -> Result<IpcHandle> {
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
        IpcHandle::from_bytes(&bytes[m + 16..])
    }

    /// How long a receive waits on the device for a peer before giving up with
    /// [`MoeStatus::TIMEOUT`] (default 10 s; once raised, later waits give up at once until
    /// [`MoeTransport::clear_status`]).
    pub fn set_flag_timeout(&mut self, timeout: std::time::Duration) {
        self.flag_timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
    }

    /// Makes every wait of this rank's kernels for a peer give up at once (raises its
    /// [`abort_word`](Self::abort_word)): for when a peer is known to be gone, so that the
    /// device drains and the transport can be dropped without waiting for the flag timeout.
    /// The transport's results are garbage from then on; drop it.
    pub fn abandon(&self) {
        self.abort.raise();
    }

    /// The word every wait of this rank's kernels for a peer polls (in pinned host memory,
    /// fixed at creation, so steps replayed from CUDA graphs poll it too). Raising it (a host
    /// store, from any thread, even while another thread is blocked in a CUDA call that waits
    /// for those kernels) makes a waiting kernel give up within microseconds, recording
    /// [`MoeStatus::ABORTED`], the phase and the peer it waited for. The engine is broken from
    /// then on; drop it.
    pub fn abort_word(&self) -> AbortWord {
        self.abort.clone()
    }

    /// The kernels this engine runs (chosen by `MESHFLOW_MOE_KERNELS` when it was made).
    pub fn kernel_generation(&self) -> MoeKernels {
        self.generation
    }

    /// Switches the kernels (every rank of the team alike, between steps): for comparisons.
    pub fn set_kernel_generation(&mut self, generation: MoeKernels) -> Result<()> {
        self.expect_between_steps()?;
        self.generation = generation;
        Ok(())
    }

    /// The variants of the fused kernels this engine runs (chosen by
    /// `MESHFLOW_MOE_FUSED_DISPATCH` / `MESHFLOW_MOE_FUSED_COMBINE` /
    /// `MESHFLOW_MOE_COMBINE_BLOCK` when it was made).
    pub fn fused_options(&self) -> FusedOptions {
        self.fused
    }

    /// Switches the variants of the fused kernels (between steps): for comparisons and tests.
    /// Ranks of a team may differ (the variants follow one protocol).
    pub fn set_fused_options(&mut self, options: FusedOptions) -> Result<()> {
        self.expect_between_steps()?;
        self.fused = options;
        Ok(())
    }

    /// Errors unless no step is in progress (the kernels can only be switched between steps).
    fn expect_between_steps(&self) -> Result<()> {
        if self.core.is_idle() {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument(
                "the NVLink MoE kernels can only be switched between steps".into(),
            ))
        }
    }

    /// A view of region `off` of `bytes` bytes of this rank's symmetric allocation.
    fn region(sym: &DeviceBuffer, off: usize, bytes: usize) -> Result<DeviceBuffer> {
        sym.view(off, bytes.max(4))
    }
}

impl NvlinkMoe {
    /// The fused combine (see `combine_send`, which recorded `expert_y`).
    fn combine_fused(&mut self, stream: &Stream, out: &DeviceBuffer) -> Result<()> {
        let rank = self.core.rank;
        let NvlinkMoe {
            core,
            layout,
            sym,
            state,
            tables,
            flag_timeout_ns,
            pending_combine,
            fused: options,
            ..
        } = self;
        let options = *options;
        let tables = tables.as_ref().ok_or_else(|| not_connected(rank))?;
        let weight_flags = NvlinkMoe::region(sym, layout.weight_flags, core.shape.world * 4)?;
        core.step(
            "combine_recv",
            Phase::CombineSent,
            Phase::Idle,
            stream,
            |c| {
                let (expert_y, late) = pending_combine.take().ok_or_else(|| {
                    KernelError::InvalidArgument("MoE combine_recv without combine_send".into())
                })?;
                let wait = FlagWait {
                    flags: &weight_flags,
                    state,
                    timeout_ns: *flag_timeout_ns,
                };
                let f = FusedCombine {
                    sym,
                    expert_y: &expert_y,
                    fan: &c.fan,
                    sent_pos: &c.sent_pos,
                    out,
                    late,
                    status: &c.status,
                };
                fused::nvl_combine_fused(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.wire,
                    c.rank,
                    &f,
                    &wait,
                    &peer_regions(tables, layout),
                    options,
                )
            },
        )
    }
}

fn not_connected(rank: usize) -> KernelError {
    KernelError::InvalidArgument(format!(
        "NVLink MoE rank {rank} is not connected: call import_handles first"
    ))
}

/// The peer regions of `layout` through `tables`.
fn peer_regions<'a>(tables: &'a Tables, l: &SymLayout) -> PeerRegions<'a> {
    PeerRegions {
        peer_sym: &tables.peer_sym,
        rows: l.rows,
        counts: l.counts,
        dispatch_flags: l.dispatch_flags,
        partials: l.partials,
        combine_flags: l.combine_flags,
        weights: l.weights,
        weight_flags: l.weight_flags,
        dispatch_token_flags: l.dispatch_token_flags,
        combine_chunks: l.combine_chunks,
    }
}

impl MoeTransport for NvlinkMoe {
    core_accessors!();

    fn name(&self) -> &'static str {
        "nvlink"
    }

    fn dispatch_send(&mut self, stream: &Stream, req: &DispatchRequest<'_>) -> Result<()> {
        self.core.check_dispatch(req)?;
        let rank = self.core.rank;
        let NvlinkMoe {
            core,
            layout,
            sym,
            state,
            tables,
            generation,
            recv_cnt,
            flag_timeout_ns,
            fused: options,
            ..
        } = self;
        let tables = tables.as_ref().ok_or_else(|| not_connected(rank))?;
        let generation = *generation;
        let options = *options;
        core.step(
            "dispatch_send",
            Phase::Idle,
            Phase::DispatchSent,
            stream,
            |c| {
                c.weights_at_dispatch = req.weights.is_some();
                c.set_outputs(req)?;
                c.zero_padding = req.zero_padding;
                let (inp, st) = c.send_parts(req)?;
                if generation == MoeKernels::Fused {
                    let f = FusedDispatch {
                        sym,
                        counts_off: layout.counts,
                        recv_cnt,
                        expert_counts: c.targets()?.counts,
                        timeout_ns: *flag_timeout_ns,
                    };
                    return fused::nvl_dispatch_fused(
                        &c.kernels,
                        stream,
                        &c.shape,
                        c.wire,
                        c.rank,
                        &inp,
                        &st,
                        &peer_regions(tables, layout),
                        &f,
                        state,
                        options,
                    );
                }
                kernel_calls::nvl_dispatch_send(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.wire,
                    c.rank,
                    &inp,
                    &st,
                    &peer_regions(tables, layout),
                    state,
                )
            },
        )
    }

    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()> {
        let NvlinkMoe {
            core,
            layout,
            sym,
            state,
            flag_timeout_ns,
            generation,
            ..
        } = self;
        if *generation == MoeKernels::Fused {
            // The fused dispatch_send did the whole dispatch.
            return core.step(
                "dispatch_recv",
                Phase::DispatchSent,
                Phase::Dispatched,
                stream,
                |c| c.finish_padding(stream),
            );
        }
        let s = core.shape;
        let rows = NvlinkMoe::region(
            sym,
            layout.rows,
            s.world * s.tokens * WireLayout::of(&s, core.wire).stride,
        )?;
        let counts = NvlinkMoe::region(sym, layout.counts, s.world * 4)?;
        let flags = NvlinkMoe::region(sym, layout.dispatch_flags, s.world * 4)?;
        let done = state.view(STATE_DISPATCH_RECV_DONE * 4, 4)?;
        core.step(
            "dispatch_recv",
            Phase::DispatchSent,
            Phase::Dispatched,
            stream,
            |c| {
                let wait = FlagWait {
                    flags: &flags,
                    state,
                    timeout_ns: *flag_timeout_ns,
                };
                let src = SourceRows {
                    own: &rows,
                    other: &rows,
                    block_bytes: s.tokens * WireLayout::of(&s, c.wire).stride,
                    row_off: 0,
                    own_cnt: &counts,
                    other_cnt: &counts,
                    cnt_stride: 4,
                };
                let out = c.recv_outputs(&done)?;
                kernel_calls::dispatch_recv(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.wire,
                    c.rank,
                    Some(&wait),
                    &src,
                    &out,
                )?;
                c.finish_padding(stream)
            },
        )
    }

    fn combine_send(&mut self, stream: &Stream, req: &CombineRequest<'_>) -> Result<()> {
        self.core.check_combine(req)?;
        let rank = self.core.rank;
        let NvlinkMoe {
            core,
            layout,
            sym,
            state,
            tables,
            flag_timeout_ns,
            generation,
            pending_combine,
            ..
        } = self;
        let tables = tables.as_ref().ok_or_else(|| not_connected(rank))?;
        let s = core.shape;
        if *generation == MoeKernels::Fused {
            // Only the late weights move now; the fused combine runs in combine_recv.
            return core.step(
                "combine_send",
                Phase::Dispatched,
                Phase::CombineSent,
                stream,
                |c| {
                    if let Some(w) = req.weights {
                        let peers = peer_regions(tables, layout);
                        kernel_calls::nvl_weights_send(
                            &c.kernels, stream, &s, c.rank, w, &peers, state,
                        )?;
                    }
                    *pending_combine = Some((req.expert_y.clone(), req.weights.is_some()));
                    Ok(())
                },
            );
        }
        let stride = WireLayout::of(&s, core.wire).stride;
        let weight_flags = NvlinkMoe::region(sym, layout.weight_flags, s.world * 4)?;
        let rows = NvlinkMoe::region(sym, layout.rows, s.world * s.tokens * stride)?;
        let counts = NvlinkMoe::region(sym, layout.counts, s.world * 4)?;
        let weights = NvlinkMoe::region(sym, layout.weights, s.world * s.tokens * s.top_k * 4)?;
        let local = NvlLocal {
            weight_flags: &weight_flags,
            rows: &rows,
            counts: &counts,
            weights: &weights,
        };
        core.step(
            "combine_send",
            Phase::Dispatched,
            Phase::CombineSent,
            stream,
            |c| {
                let peers = peer_regions(tables, layout);
                if let Some(w) = req.weights {
                    kernel_calls::nvl_weights_send(
                        &c.kernels, stream, &s, c.rank, w, &peers, state,
                    )?;
                }
                kernel_calls::nvl_combine_send(
                    &c.kernels,
                    stream,
                    &s,
                    c.wire,
                    c.rank,
                    &local,
                    req.expert_y,
                    &c.fan,
                    req.weights.is_some(),
                    &peers,
                    state,
                    *flag_timeout_ns,
                    &c.status,
                )
            },
        )
    }

    fn combine_recv(&mut self, stream: &Stream, out: &DeviceBuffer) -> Result<()> {
        self.core.check_out(out)?;
        if self.generation == MoeKernels::Fused {
            return self.combine_fused(stream, out);
        }
        let NvlinkMoe {
            core,
            layout,
            sym,
            state,
            flag_timeout_ns,
            ..
        } = self;
        let s = core.shape;
        let flags = NvlinkMoe::region(sym, layout.combine_flags, s.world * 4)?;
        let partials =
            NvlinkMoe::region(sym, layout.partials, s.world * s.tokens * s.y_row_bytes())?;
        core.step(
            "combine_recv",
            Phase::CombineSent,
            Phase::Idle,
            stream,
            |c| {
                let wait = FlagWait {
                    flags: &flags,
                    state,
                    timeout_ns: *flag_timeout_ns,
                };
                kernel_calls::combine_recv(
                    &c.kernels,
                    stream,
                    &c.shape,
                    c.rank,
                    Some(&wait),
                    &partials,
                    &partials,
                    &c.sent_pos,
                    out,
                    &c.status,
                )
            },
        )
    }

    fn received_rows(&self, stream: &Stream) -> Result<Vec<usize>> {
        self.core
            .read_counts(stream, |s| self.sym.view(self.layout.counts + 4 * s, 4))
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
