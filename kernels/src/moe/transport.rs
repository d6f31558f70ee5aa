//! The [`MoeTransport`] trait, its requests, and the state both transports share: shape, wire
//! format, outputs, status word, padding bookkeeping and the per-step phase check.

use std::sync::OnceLock;

use super::kernel_calls::{self, RecvOutputs, SendInputs, SendState};
use super::{MoeShape, MoeStatus, MoeWire};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::kernels::Kernels;
use crate::stream::Stream;

/// The inputs of a dispatch (device buffers of this rank's device).
#[derive(Clone, Copy, Debug)]
pub struct DispatchRequest<'a> {
    /// Tokens `x[T, H]` of the shape's dtype. With FP8 dispatch its address must be 16-byte
    /// aligned.
    pub x: &'a DeviceBuffer,
    /// Expert ids `topk_idx[T, K]` (i32).
    pub topk_idx: &'a DeviceBuffer,
    /// Combine weights `[T, K]` (f32), sent with the rows; then the combine takes none. Every
    /// rank of a step gives them at the same phase.
    pub weights: Option<&'a DeviceBuffer>,
    /// Zero the padding rows of `expert_x` and `routing` (rows past each count); without it
    /// their content is unspecified. In the engine's own outputs this costs a pass over the
    /// rows that held data in the last step (the engine knows the rest are still zero); in
    /// caller-given [`outputs`](Self::outputs) it zeroes every padding row.
    pub zero_padding: bool,
    /// Where the dispatch writes `expert_x`, `expert_counts` and `routing`: `None` (the
    /// default), the engine's own buffers ([`MoeTransport::expert_x`] and its siblings);
    /// `Some`, the caller's (no copy out of the engine's). See [`DispatchOutputs`].
    pub outputs: Option<DispatchOutputs<'a>>,
}

/// Caller-given device buffers a dispatch writes its outputs into, in place of the engine's
/// own (which then keep what they held). Each must be on the engine's device, exactly the
/// shape's size, and must not overlap the inputs or each other. The combine never reads them
/// (the engine keeps where every row came from), so the caller may reuse them as soon as its
/// expert computation has read them. Padding rows (past each count) are left as they were
/// unless [`DispatchRequest::zero_padding`] is set: the dispatch writes exactly the valid rows
/// and the counts.
#[derive(Clone, Copy, Debug)]
pub struct DispatchOutputs<'a> {
    /// `expert_x[L, C, H]` of the shape's dtype; 16-byte aligned with FP8 dispatch (rows are
    /// dequantized into it in 16-byte vectors).
    pub expert_x: &'a DeviceBuffer,
    /// `expert_counts[L]` (i32).
    pub expert_counts: &'a DeviceBuffer,
    /// `routing[L, C, 2]` (i32, 8-byte aligned: one pair per row is stored at once).
    pub routing: &'a DeviceBuffer,
}

/// The inputs of a combine.
#[derive(Clone, Copy, Debug)]
pub struct CombineRequest<'a> {
    /// Expert outputs `expert_y[L, C, F]` of the shape's dtype, rows aligned with the last
    /// dispatch's `expert_x` (padding rows are never read).
    pub expert_y: &'a DeviceBuffer,
    /// This rank's weights `[T, K]` (f32) when the dispatch carried none: they are first copied
    /// to every peer (one more exchange). `None` when the dispatch carried them.
    pub weights: Option<&'a DeviceBuffer>,
}

/// One rank's MoE dispatch/combine engine for one layer shape: created once, reused every step.
///
/// All buffers but the engine's own dispatch outputs are allocated at creation; those are
/// allocated at their first use (see [`MoeTransport::expert_x`]: that call blocks until they
/// are zeroed, on a stream of its own). Otherwise the methods only enqueue work on `stream` (a
/// stream of [`MoeTransport::device`]) and never wait for the device. See the [module docs](super) for the
/// semantics and the calling contract (order of the four phases, every rank in every step).
pub trait MoeTransport: Send {
    /// The engine's name, for reports (`nccl`, `nvlink`; the runtime's transport of the same
    /// name runs it).
    fn name(&self) -> &'static str;

    /// The layer shape.
    fn shape(&self) -> &MoeShape;

    /// How token rows are encoded on the wire.
    fn wire(&self) -> MoeWire;

    /// This rank's index in the team.
    fn rank(&self) -> usize;

    /// The device this rank runs on.
    fn device(&self) -> &Device;

    /// Starts a dispatch. The inputs may be reused once the stream has passed this call.
    fn dispatch_send(&mut self, stream: &Stream, req: &DispatchRequest<'_>) -> Result<()>;

    /// Finishes the dispatch: after it (in stream order) the request's
    /// [`outputs`](DispatchRequest::outputs), or else [`expert_x`](Self::expert_x),
    /// [`expert_counts`](Self::expert_counts) and [`routing`](Self::routing), hold this rank's
    /// rows. Waits on the device (not the host) for the peers' rows.
    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()>;

    /// The engine's own `expert_x[L, C, H]`: written by the last dispatch that was given no
    /// [`outputs`](DispatchRequest::outputs) (owned by the transport; rewritten by the next
    /// such dispatch). The engine's own outputs are allocated (zeroed) by the first such
    /// dispatch or the first call of this or a sibling accessor, so an engine whose
    /// dispatches always write into caller-given outputs never holds them.
    fn expert_x(&self) -> Result<&DeviceBuffer>;

    /// The engine's own `expert_counts[L]` (i32), as [`expert_x`](Self::expert_x).
    fn expert_counts(&self) -> Result<&DeviceBuffer>;

    /// The engine's own `routing[L, C, 2]` (i32: team-global token, k), as
    /// [`expert_x`](Self::expert_x).
    fn routing(&self) -> Result<&DeviceBuffer>;

    /// Device bytes the engine's own dispatch outputs hold: 0 until they are first used (see
    /// [`expert_x`](Self::expert_x)).
    fn own_output_bytes(&self) -> usize;

    /// Starts a combine of the last dispatch's rows. `expert_y` must stay unchanged until
    /// [`combine_recv`](Self::combine_recv) has been enqueued (an engine may read it there).
    fn combine_send(&mut self, stream: &Stream, req: &CombineRequest<'_>) -> Result<()>;

    /// Finishes the combine: `out[T, F]` (the shape's dtype) receives every token's sum of
    /// partials.
    fn combine_recv(&mut self, stream: &Stream, out: &DeviceBuffer) -> Result<()>;

    /// Reads the device status word (blocks until `stream` is idle: keep it off the hot path).
    fn status(&self, stream: &Stream) -> Result<MoeStatus>;

    /// Clears the device status word (enqueued on `stream`).
    fn clear_status(&self, stream: &Stream) -> Result<()>;

    /// Rows this rank received from each source in the last dispatch, `[W]` (blocks until
    /// `stream` is idle: for traffic figures off the hot path, see [`super::MoeTraffic`]).
    fn received_rows(&self, stream: &Stream) -> Result<Vec<usize>>;

    /// [`dispatch_send`](Self::dispatch_send) then [`dispatch_recv`](Self::dispatch_recv).
    fn dispatch_with(&mut self, stream: &Stream, req: &DispatchRequest<'_>) -> Result<()> {
        self.dispatch_send(stream, req)?;
        self.dispatch_recv(stream)
    }

    /// [`combine_send`](Self::combine_send) then [`combine_recv`](Self::combine_recv).
    fn combine_with(
        &mut self,
        stream: &Stream,
        req: &CombineRequest<'_>,
        out: &DeviceBuffer,
    ) -> Result<()> {
        self.combine_send(stream, req)?;
        self.combine_recv(stream, out)
    }

    /// A whole dispatch without weights into the engine's own outputs, padding zeroed (the
    /// weights come with [`combine`](Self::combine)).
    fn dispatch(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer,
        topk_idx: &DeviceBuffer,
    ) -> Result<()> {
        self.dispatch_with(
            stream,
            &DispatchRequest {
                x,
                topk_idx,
                weights: None,
                zero_padding: true,
                outputs: None,
            },
        )
    }

    /// A whole combine of `expert_y` with this rank's `weights[T, K]` (f32) into `out[T, F]`
    /// (`None` when the last dispatch carried them, see [`CombineRequest::weights`]).
    /// `expert_counts` and `routing` must be (copies of) the last dispatch's; they are checked
    /// for size only (the transport keeps where each row came from).
    fn combine(
        &mut self,
        stream: &Stream,
        expert_y: &DeviceBuffer,
        expert_counts: &DeviceBuffer,
        routing: &DeviceBuffer,
        weights: Option<&DeviceBuffer>,
        out: &DeviceBuffer,
    ) -> Result<()> {
        let s = *self.shape();
        let rows = s.local_experts() * s.capacity;
        for (buf, bytes, what) in [
            (
                expert_counts,
                s.local_experts() * 4,
                "combine input expert_counts",
            ),
            (routing, rows * 8, "combine input routing"),
        ] {
            if buf.len() != bytes {
                return Err(KernelError::InvalidArgument(format!(
                    "MoE {what} has {} bytes, the shape needs {bytes}",
                    buf.len()
                )));
            }
        }
        self.combine_with(stream, &CombineRequest { expert_y, weights }, out)
    }
}

/// The [`MoeTransport`] methods both engines answer from their [`Core`] (a field `core`): the
/// shape, wire, rank and device, the engine's own dispatch outputs, the status word. Expands
/// inside an `impl MoeTransport for ...` block.
macro_rules! core_accessors {
    () => {
        fn shape(&self) -> &$crate::moe::MoeShape {
            &self.core.shape
        }

        fn wire(&self) -> $crate::moe::MoeWire {
            self.core.wire
        }

        fn rank(&self) -> usize {
            self.core.rank
        }

        fn device(&self) -> &$crate::device::Device {
            &self.core.device
        }

        fn expert_x(&self) -> $crate::error::Result<&$crate::buffer::DeviceBuffer> {
            Ok(&self.core.own()?.expert_x)
        }

        fn expert_counts(&self) -> $crate::error::Result<&$crate::buffer::DeviceBuffer> {
            Ok(&self.core.own()?.counts)
        }

        fn routing(&self) -> $crate::error::Result<&$crate::buffer::DeviceBuffer> {
            Ok(&self.core.own()?.routing)
        }

        fn own_output_bytes(&self) -> usize {
            self.core.own_bytes()
        }

        fn status(
            &self,
            stream: &$crate::stream::Stream,
        ) -> $crate::error::Result<$crate::moe::MoeStatus> {
            self.core.read_status(stream)
        }

        fn clear_status(&self, stream: &$crate::stream::Stream) -> $crate::error::Result<()> {
            self.core.status.zero(stream)
        }
    };
}
pub(crate) use core_accessors;

/// Where a rank is in the four-phase step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    DispatchSent,
    Dispatched,
    CombineSent,
    /// An enqueue failed half-way: the team protocol cannot be resumed.
    Broken,
}

/// State shared by both transports.
pub(crate) struct Core {
    pub shape: MoeShape,
    pub wire: MoeWire,
    pub rank: usize,
    pub device: Device,
    pub kernels: Kernels,
    phase: Phase,
    /// Whether the current step's dispatch carried the weights.
    pub weights_at_dispatch: bool,
    /// Whether the current step's dispatch zeroes the padding.
    pub zero_padding: bool,
    /// Status word (u32): the first 4 bytes of a 16-byte block whose bytes 8..16 hold the
    /// device address of an abort word the kernels' peer waits poll (0: none; see
    /// [`Core::watch_abort`] and `block_wait_flags` in `moe.cu`).
    pub status: DeviceBuffer,
    /// Bytes 8..16 of the status block.
    abort_slot: DeviceBuffer,
    /// The engine's own outputs, allocated by the first dispatch given no caller outputs (or
    /// the first call of an accessor): an engine whose dispatches always write into the
    /// caller's buffers never holds them.
    own: OnceLock<OwnOutputs>,
    /// `[L]` row counters of the fan-out (zeroed by its kernel after use).
    pub ecnt: DeviceBuffer,
    /// `[W, T, K]` i32: the expert row of each received row and k.
    pub fan: DeviceBuffer,
    /// `[T, W]` i32: where each token went in each destination (-1: not sent).
    pub sent_pos: DeviceBuffer,
    /// `[W]` i32 per-destination row counters of the sender (zeroed by its kernel).
    pub cnt: DeviceBuffer,
    /// The caller's outputs of the current step's dispatch (held from `dispatch_send` to the
    /// end of `dispatch_recv`); `None`: the engine's own.
    caller_outputs: Option<CallerOutputs>,
}

/// The engine's own dispatch outputs and their padding bookkeeping.
pub(crate) struct OwnOutputs {
    /// `expert_x[L, C, H]`, zeroed when allocated.
    pub expert_x: DeviceBuffer,
    /// `expert_counts[L]`.
    pub counts: DeviceBuffer,
    /// `routing[L, C, 2]`, zeroed when allocated.
    pub routing: DeviceBuffer,
    /// `[L]` i32: the counts of the last padding-zeroing dispatch.
    prev_counts: DeviceBuffer,
    /// Whether every row at or past `prev_counts` is zero (then zeroing the padding only
    /// touches the rows `[counts, prev_counts)`).
    padding_clean: bool,
}

impl OwnOutputs {
    /// Zeroed outputs of `shape` on `device` (blocks until they are zeroed).
    fn new(device: &Device, shape: &MoeShape) -> Result<OwnOutputs> {
        let stream = Stream::new(device)?;
        let zeroed = |bytes: usize| -> Result<DeviceBuffer> {
            let b = DeviceBuffer::alloc(device, bytes.max(4))?;
            b.zero(&stream)?;
            Ok(b)
        };
        let (l, c) = (shape.local_experts(), shape.capacity);
        let own = OwnOutputs {
            expert_x: zeroed(l * c * shape.x_row_bytes())?,
            counts: zeroed(l * 4)?,
            routing: zeroed(l * c * 8)?,
            prev_counts: zeroed(l * 4)?,
            padding_clean: true,
        };
        stream.synchronize()?;
        Ok(own)
    }

    /// Device bytes they hold.
    fn bytes(&self) -> usize {
        [
            &self.expert_x,
            &self.counts,
            &self.routing,
            &self.prev_counts,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// Caller-given dispatch outputs, held between the two halves of a dispatch.
struct CallerOutputs {
    expert_x: DeviceBuffer,
    counts: DeviceBuffer,
    routing: DeviceBuffer,
}

/// Where the current step's dispatch writes (the caller's buffers or the engine's own).
pub(crate) struct Targets<'a> {
    pub expert_x: &'a DeviceBuffer,
    pub counts: &'a DeviceBuffer,
    pub routing: &'a DeviceBuffer,
}

impl Core {
    pub fn new(device: &Device, shape: &MoeShape, wire: MoeWire, rank: usize) -> Result<Core> {
        shape.validate()?;
        wire.validate(shape)?;
        if rank >= shape.world {
            return Err(KernelError::InvalidArgument(format!(
                "MoE rank {rank} is outside a team of {}",
                shape.world
            )));
        }
        let stream = Stream::new(device)?;
        let zeroed = |bytes: usize| -> Result<DeviceBuffer> {
            let b = DeviceBuffer::alloc(device, bytes.max(4))?;
            b.zero(&stream)?;
            Ok(b)
        };
        let (w, t, k, l) = (
            shape.world,
            shape.tokens,
            shape.top_k,
            shape.local_experts(),
        );
        let status_block = zeroed(16)?;
        let core = Core {
            shape: *shape,
            wire,
            rank,
            device: device.clone(),
            kernels: device.kernels(),
            phase: Phase::Idle,
            weights_at_dispatch: false,
            zero_padding: false,
            status: status_block.view(0, 4)?,
            abort_slot: status_block.view(8, 8)?,
            own: OnceLock::new(),
            ecnt: zeroed(l * 4)?,
            fan: zeroed(w * t * k * 4)?,
            sent_pos: zeroed(t * w * 4)?,
            cnt: zeroed(w * 4)?,
            caller_outputs: None,
        };
        stream.synchronize()?;
        Ok(core)
    }

    /// Makes every peer wait of this engine's kernels also poll `word` (blocks until the
    /// address is stored; the address is fixed, so steps recorded in graphs poll it too).
    pub fn watch_abort(&self, word: &crate::abort::AbortWord) -> Result<()> {
        let stream = Stream::new(&self.device)?;
        self.abort_slot
            .upload(&stream, &[word.device_addr()? as i64])?;
        stream.synchronize()
    }

    /// Whether no step is in progress.
    pub fn is_idle(&self) -> bool {
        self.phase == Phase::Idle
    }

    /// Runs `op` (which enqueues the phase `from -> to`) after checking the order; a failure
    /// leaves the transport broken.
    pub fn step<T>(
        &mut self,
        what: &str,
        from: Phase,
        to: Phase,
        stream: &Stream,
        op: impl FnOnce(&mut Core) -> Result<T>,
    ) -> Result<T> {
        if self.phase != from {
            return Err(KernelError::InvalidArgument(format!(
                "MoE {what} on rank {} called out of order (after {:?}; expected after {:?}): \
                 each step is dispatch_send, dispatch_recv, combine_send, combine_recv",
                self.rank, self.phase, from
            )));
        }
        stream.expect_device(&self.device, &format!("MoE {what}"))?;
        match op(self) {
            Ok(v) => {
                self.phase = to;
                Ok(v)
            }
            Err(e) => {
                self.phase = Phase::Broken;
                Err(e)
            }
        }
    }

    /// Errors unless `buf` is on this device and holds exactly `bytes` bytes.
    pub fn expect_buffer(&self, buf: &DeviceBuffer, bytes: usize, what: &str) -> Result<()> {
        self.device.expect_same(buf.device(), what)?;
        if buf.len() != bytes {
            return Err(KernelError::InvalidArgument(format!(
                "MoE {what} has {} bytes, the shape needs {bytes}",
                buf.len()
            )));
        }
        Ok(())
    }

    /// Checks a dispatch request's buffers (before any phase change).
    pub fn check_dispatch(&self, req: &DispatchRequest<'_>) -> Result<()> {
        let s = &self.shape;
        self.expect_buffer(req.x, s.tokens * s.x_row_bytes(), "dispatch input x")?;
        if self.wire != MoeWire::Native && !req.x.addr().is_multiple_of(16) {
            return Err(KernelError::InvalidArgument(format!(
                "MoE dispatch input x at {:#x} is not 16-byte aligned ({} dispatch reads it \
                 in 16-byte vectors)",
                req.x.addr(),
                self.wire.name()
            )));
        }
        self.expect_buffer(
            req.topk_idx,
            s.tokens * s.top_k * 4,
            "dispatch input topk_idx",
        )?;
        if let Some(w) = req.weights {
            self.expect_buffer(w, s.tokens * s.top_k * 4, "dispatch input weights")?;
        }
        if let Some(o) = &req.outputs {
            self.check_outputs(req, o)?;
        }
        Ok(())
    }

    /// Checks caller-given dispatch outputs: device, sizes, alignment, no overlaps.
    fn check_outputs(&self, req: &DispatchRequest<'_>, o: &DispatchOutputs<'_>) -> Result<()> {
        let s = &self.shape;
        let rows = s.local_experts() * s.capacity;
        self.expect_buffer(
            o.expert_x,
            rows * s.x_row_bytes(),
            "dispatch output expert_x",
        )?;
        self.expect_buffer(
            o.expert_counts,
            s.local_experts() * 4,
            "dispatch output expert_counts",
        )?;
        self.expect_buffer(o.routing, rows * 8, "dispatch output routing")?;
        let align = |b: &DeviceBuffer, a: usize, what: &str, why: &str| {
            if b.is_aligned(a) {
                Ok(())
            } else {
                Err(KernelError::InvalidArgument(format!(
                    "MoE dispatch output {what} at {:#x} is not {a}-byte aligned ({why})",
                    b.addr()
                )))
            }
        };
        if self.wire != MoeWire::Native {
            align(
                o.expert_x,
                16,
                "expert_x",
                "FP8 rows are dequantized into it in 16-byte vectors",
            )?;
        }
        align(o.expert_x, s.dtype.size_bytes(), "expert_x", "its elements")?;
        align(o.expert_counts, 4, "expert_counts", "its elements")?;
        align(o.routing, 8, "routing", "a row's pair is stored at once")?;
        let named = [
            (o.expert_x, "expert_x"),
            (o.expert_counts, "expert_counts"),
            (o.routing, "routing"),
            (req.x, "input x"),
            (req.topk_idx, "input topk_idx"),
        ];
        for (i, (a, an)) in named.iter().enumerate().take(3) {
            for (b, bn) in &named[i + 1..] {
                if overlap(a, b) {
                    return Err(KernelError::InvalidArgument(format!(
                        "MoE dispatch output {an} overlaps {bn}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The engine's own outputs, allocated (zeroed) at the first call.
    pub fn own(&self) -> Result<&OwnOutputs> {
        if let Some(o) = self.own.get() {
            return Ok(o);
        }
        let fresh = OwnOutputs::new(&self.device, &self.shape)?;
        Ok(self.own.get_or_init(|| fresh))
    }

    /// Device bytes of the engine's own outputs (0 until they are first used).
    pub fn own_bytes(&self) -> usize {
        self.own.get().map_or(0, OwnOutputs::bytes)
    }

    /// Takes the current step's outputs from the request (before the dispatch's first
    /// kernel); without caller outputs, makes sure the engine's own exist.
    pub fn set_outputs(&mut self, req: &DispatchRequest<'_>) -> Result<()> {
        self.caller_outputs = req.outputs.map(|o| CallerOutputs {
            expert_x: o.expert_x.clone(),
            counts: o.expert_counts.clone(),
            routing: o.routing.clone(),
        });
        if self.caller_outputs.is_none() {
            self.own()?;
        }
        Ok(())
    }

    /// Where the current step's dispatch writes.
    pub fn targets(&self) -> Result<Targets<'_>> {
        Ok(match &self.caller_outputs {
            Some(o) => Targets {
                expert_x: &o.expert_x,
                counts: &o.counts,
                routing: &o.routing,
            },
            None => {
                let o = self.own()?;
                Targets {
                    expert_x: &o.expert_x,
                    counts: &o.counts,
                    routing: &o.routing,
                }
            }
        })
    }

    /// What the send kernel of a dispatch reads and writes: the request's inputs, the sender
    /// workspace, and where the sender fans its own tokens out (the step's
    /// [`targets`](Self::targets)).
    pub fn send_parts<'a>(
        &'a self,
        req: &DispatchRequest<'a>,
    ) -> Result<(SendInputs<'a>, SendState<'a>)> {
        let to = self.targets()?;
        let inputs = SendInputs {
            x: req.x,
            topk_idx: req.topk_idx,
            weights: req.weights,
        };
        let state = SendState {
            cnt: &self.cnt,
            sent_pos: &self.sent_pos,
            status: &self.status,
            expert_x: to.expert_x,
            routing: to.routing,
            fan: &self.fan,
            ecnt: &self.ecnt,
        };
        Ok((inputs, state))
    }

    /// Where the receive kernel of a dispatch writes: the step's [`targets`](Self::targets),
    /// the fan-out workspace and the status word; `done` is its zeroed grid counter.
    pub fn recv_outputs<'a>(&'a self, done: &'a DeviceBuffer) -> Result<RecvOutputs<'a>> {
        let to = self.targets()?;
        Ok(RecvOutputs {
            expert_x: to.expert_x,
            routing: to.routing,
            fan: &self.fan,
            ecnt: &self.ecnt,
            counts: to.counts,
            status: &self.status,
            done,
        })
    }

    /// Checks a combine request against the step's dispatch.
    pub fn check_combine(&self, req: &CombineRequest<'_>) -> Result<()> {
        let s = &self.shape;
        let rows = s.local_experts() * s.capacity;
        self.expect_buffer(
            req.expert_y,
            rows * s.y_row_bytes(),
            "combine input expert_y",
        )?;
        match (req.weights, self.weights_at_dispatch) {
            (Some(w), false) => {
                self.expect_buffer(w, s.tokens * s.top_k * 4, "combine input weights")
            }
            (None, true) => Ok(()),
            (Some(_), true) => Err(KernelError::InvalidArgument(
                "MoE combine given weights, but this step's dispatch carried them already".into(),
            )),
            (None, false) => Err(KernelError::InvalidArgument(
                "MoE combine needs weights: this step's dispatch carried none".into(),
            )),
        }
    }

    pub fn check_out(&self, out: &DeviceBuffer) -> Result<()> {
        let s = &self.shape;
        self.expect_buffer(out, s.tokens * s.y_row_bytes(), "combine output out")
    }

    pub fn read_status(&self, stream: &Stream) -> Result<MoeStatus> {
        let v = self.status.to_vec::<i32>(stream)?;
        Ok(MoeStatus(v.first().map_or(0, |x| *x as u32)))
    }

    /// Reads `[W]` i32 counts found at `count_at(s)` (a 4-byte view) as row numbers.
    pub fn read_counts(
        &self,
        stream: &Stream,
        count_at: impl Fn(usize) -> Result<DeviceBuffer>,
    ) -> Result<Vec<usize>> {
        (0..self.shape.world)
            .map(|s| {
                let v = count_at(s)?.to_vec::<i32>(stream)?;
                Ok(v.first().map_or(0, |x| usize::try_from(*x).unwrap_or(0)))
            })
            .collect()
    }

    /// After the fan-out of a dispatch: zero the padding if the dispatch asked
    /// ([`zero_padding`](Self::zero_padding); keeping the bookkeeping of which rows of the
    /// engine's own outputs may hold stale data), and let go of the caller's outputs. Caller
    /// outputs get every padding row zeroed (nothing is known about them); the engine's own
    /// outputs only the rows that held data since they were last clean.
    pub fn finish_padding(&mut self, stream: &Stream) -> Result<()> {
        let zero = self.zero_padding;
        if let Some(o) = self.caller_outputs.take() {
            if !zero {
                return Ok(());
            }
            let out = RecvOutputs {
                expert_x: &o.expert_x,
                routing: &o.routing,
                fan: &self.fan,
                ecnt: &self.ecnt,
                counts: &o.counts,
                status: &self.status,
                done: &self.status,
            };
            return kernel_calls::zero_padding(&self.kernels, stream, &self.shape, &out, None);
        }
        let Core {
            own,
            kernels,
            shape,
            fan,
            ecnt,
            status,
            ..
        } = self;
        let own = own.get_mut().ok_or_else(|| {
            KernelError::InvalidArgument(
                "MoE dispatch into the engine's own outputs before they were allocated".into(),
            )
        })?;
        if !zero {
            own.padding_clean = false;
            return Ok(());
        }
        let out = kernel_calls::RecvOutputs {
            expert_x: &own.expert_x,
            routing: &own.routing,
            fan,
            ecnt,
            counts: &own.counts,
            status,
            done: status,
        };
        let prev = own.padding_clean.then_some(&own.prev_counts);
        kernel_calls::zero_padding(kernels, stream, shape, &out, prev)?;
        own.prev_counts.copy_from(stream, &own.counts)?;
        own.padding_clean = true;
        Ok(())
    }
}

/// Whether two buffers share a byte (both on one device).
fn overlap(a: &DeviceBuffer, b: &DeviceBuffer) -> bool {
    let (a0, b0) = (a.addr(), b.addr());
    let (a1, b1) = (a0 + a.len() as u64, b0 + b.len() as u64);
    !a.is_empty() && !b.is_empty() && a0 < b1 && b0 < a1
}

/// A `[n]` u32 zeroed device buffer.
pub(crate) fn zeroed_u32(device: &Device, stream: &Stream, n: usize) -> Result<DeviceBuffer> {
    let b = DeviceBuffer::alloc_elems(device, DType::I32, n.max(1))?;
    b.zero(stream)?;
    Ok(b)
}
