//! The [`MoeTransport`] trait and the state both transports share: shape, sender workspace,
//! outputs, status word and the per-step phase check.

use super::{MoeShape, MoeStatus};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::kernels::Kernels;
use crate::stream::Stream;

/// One rank's MoE dispatch/combine engine for one layer shape: created once, reused every step.
///
/// All buffers are allocated at creation; the methods only enqueue work on `stream` (a stream of
/// [`MoeTransport::device`]) and never wait for the device. See the [module docs](super) for the
/// semantics and the calling contract (order of the four phases, every rank in every step).
pub trait MoeTransport: Send {
    /// The engine's name, for reports (`nccl`, `nvlink`; the runtime's transport of the same
    /// name runs it).
    fn name(&self) -> &'static str;

    /// The layer shape.
    fn shape(&self) -> &MoeShape;

    /// This rank's index in the team.
    fn rank(&self) -> usize;

    /// The device this rank runs on.
    fn device(&self) -> &Device;

    /// Starts a dispatch: `x[T, H]` (the shape's dtype) and `topk_idx[T, K]` (i32). The inputs
    /// may be reused once the stream has passed this call.
    fn dispatch_send(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer,
        topk_idx: &DeviceBuffer,
    ) -> Result<()>;

    /// Finishes the dispatch: after it (in stream order) [`expert_x`](Self::expert_x),
    /// [`expert_counts`](Self::expert_counts) and [`routing`](Self::routing) hold this rank's
    /// rows. Waits on the device (not the host) for the peers' rows.
    fn dispatch_recv(&mut self, stream: &Stream) -> Result<()>;

    /// `expert_x[L, C, H]` written by the last dispatch (owned by the transport; peers write it
    /// during the next dispatch).
    fn expert_x(&self) -> &DeviceBuffer;

    /// `expert_counts[L]` (i32) written by the last dispatch.
    fn expert_counts(&self) -> &DeviceBuffer;

    /// `routing[L, C, 2]` (i32) written by the last dispatch.
    fn routing(&self) -> &DeviceBuffer;

    /// Starts a combine of `expert_y[L, C, F]` (the shape's dtype) with the counts and routing of
    /// the last dispatch (usually [`expert_counts`](Self::expert_counts) and
    /// [`routing`](Self::routing)). `expert_y` may be reused once the stream has passed this call.
    fn combine_send(
        &mut self,
        stream: &Stream,
        expert_y: &DeviceBuffer,
        expert_counts: &DeviceBuffer,
        routing: &DeviceBuffer,
    ) -> Result<()>;

    /// Finishes the combine: `out[T, F] = Σ_k weights[t, k] · y(t, k)` with this rank's
    /// `weights[T, K]` (f32).
    fn combine_recv(
        &mut self,
        stream: &Stream,
        weights: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<()>;

    /// Reads the device status word (blocks until `stream` is idle: keep it off the hot path).
    fn status(&self, stream: &Stream) -> Result<MoeStatus>;

    /// Clears the device status word (enqueued on `stream`).
    fn clear_status(&self, stream: &Stream) -> Result<()>;

    /// [`dispatch_send`](Self::dispatch_send) then [`dispatch_recv`](Self::dispatch_recv).
    fn dispatch(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer,
        topk_idx: &DeviceBuffer,
    ) -> Result<()> {
        self.dispatch_send(stream, x, topk_idx)?;
        self.dispatch_recv(stream)
    }

    /// [`combine_send`](Self::combine_send) then [`combine_recv`](Self::combine_recv).
    fn combine(
        &mut self,
        stream: &Stream,
        expert_y: &DeviceBuffer,
        expert_counts: &DeviceBuffer,
        routing: &DeviceBuffer,
        weights: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<()> {
        self.combine_send(stream, expert_y, expert_counts, routing)?;
        self.combine_recv(stream, weights, out)
    }
}

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
    pub rank: usize,
    pub device: Device,
    pub kernels: Kernels,
    phase: Phase,
    /// Step number, raised (wrapping) by every dispatch_send; flags and marks carry it. Starts
    /// at 0, the value the zeroed flags hold, so step 1 is the first to wait for.
    pub epoch: u32,
    /// Status word (u32).
    pub status: DeviceBuffer,
    /// Output `expert_counts[L]`.
    pub counts: DeviceBuffer,
}

impl Core {
    pub fn new(device: &Device, shape: &MoeShape, rank: usize) -> Result<Core> {
        shape.validate()?;
        if rank >= shape.world {
            return Err(KernelError::InvalidArgument(format!(
                "MoE rank {rank} is outside a team of {}",
                shape.world
            )));
        }
        let i32s = |n: usize| DeviceBuffer::alloc_elems(device, DType::I32, n);
        let stream = Stream::new(device)?;
        let status = i32s(1)?;
        status.zero(&stream)?;
        stream.synchronize()?;
        Ok(Core {
            shape: *shape,
            rank,
            device: device.clone(),
            kernels: device.kernels(),
            phase: Phase::Idle,
            epoch: 0,
            status,
            counts: i32s(shape.local_experts())?,
        })
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

    pub fn check_dispatch_inputs(&self, x: &DeviceBuffer, topk_idx: &DeviceBuffer) -> Result<()> {
        let s = &self.shape;
        self.expect_buffer(x, s.tokens * s.x_row_bytes(), "dispatch input x")?;
        self.expect_buffer(topk_idx, s.tokens * s.top_k * 4, "dispatch input topk_idx")
    }

    pub fn check_combine_inputs(
        &self,
        expert_y: &DeviceBuffer,
        counts: &DeviceBuffer,
        routing: &DeviceBuffer,
    ) -> Result<()> {
        let s = &self.shape;
        let rows = s.local_experts() * s.capacity;
        self.expect_buffer(expert_y, rows * s.y_row_bytes(), "combine input expert_y")?;
        self.expect_buffer(counts, s.local_experts() * 4, "combine input expert_counts")?;
        self.expect_buffer(routing, rows * 8, "combine input routing")
    }

    pub fn check_combine_outputs(&self, weights: &DeviceBuffer, out: &DeviceBuffer) -> Result<()> {
        let s = &self.shape;
        self.expect_buffer(weights, s.tokens * s.top_k * 4, "combine input weights")?;
        self.expect_buffer(out, s.tokens * s.y_row_bytes(), "combine output out")
    }

    pub fn read_status(&self, stream: &Stream) -> Result<MoeStatus> {
        let v = self.status.to_vec::<i32>(stream)?;
        Ok(MoeStatus(v.first().map_or(0, |x| *x as u32)))
    }
}
