//! CUDA streams.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::event::Event;
use crate::gemm::BlasHandle;

/// An ordered queue of device work on one [`Device`]. Cheap to clone; clones are the same stream.
///
/// Each stream lazily owns its cuBLAS handle (cuBLAS workspaces must not be shared by streams
/// running concurrently).
#[derive(Clone)]
pub struct Stream {
    pub(crate) inner: Arc<StreamInner>,
}

pub(crate) struct StreamInner {
    // Field order is drop order: the cuBLAS handle goes before the stream it is bound to.
    pub(crate) blas: Mutex<Option<BlasHandle>>,
    pub(crate) cu: Arc<CudaStream>,
    pub(crate) device: Device,
    id: u64,
}

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

impl Stream {
    fn wrap(device: &Device, cu: Arc<CudaStream>) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                blas: Mutex::new(None),
                cu,
                device: device.clone(),
                id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
            }),
        }
    }

    /// Creates a new non-blocking stream on `device` (it does not synchronize with the legacy
    /// default stream).
    pub fn new(device: &Device) -> Result<Stream> {
        let cu = drv("cuStreamCreate", device.inner.ctx.new_stream())?;
        Ok(Stream::wrap(device, cu))
    }

    /// Creates a non-blocking stream with a priority (lower numbers are higher priority; the
    /// driver clamps to its range).
    pub fn with_priority(device: &Device, priority: i32) -> Result<Stream> {
        let cu = drv(
            "cuStreamCreateWithPriority",
            device.inner.ctx.new_stream_with_priority(priority),
        )?;
        Ok(Stream::wrap(device, cu))
    }

    /// Wraps a stream the caller created (e.g. PyTorch's current stream) on `device`: work
    /// enqueued here runs in order with the caller's. It is never destroyed here. Checks that
    /// the stream belongs to `device`'s primary context (the one the CUDA runtime uses).
    ///
    /// # Safety
    /// `raw` must be a live `CUstream` that outlives the returned `Stream` and all its clones.
    pub unsafe fn from_raw_borrowed(device: &Device, raw: *mut std::ffi::c_void) -> Result<Stream> {
        let cu_stream = raw as cudarc::driver::sys::CUstream;
        let ctx = device.inner.ctx.clone();
        if !cu_stream.is_null() {
            device.bind()?;
            let mut owner = std::ptr::null_mut();
            // SAFETY: a query on the caller's live stream; `owner` is a valid out-pointer.
            drv("cuStreamGetCtx", unsafe {
                cudarc::driver::sys::cuStreamGetCtx(cu_stream, &mut owner).result()
            })?;
            if owner != ctx.cu_ctx() {
                return Err(KernelError::InvalidArgument(format!(
                    "the caller's stream belongs to another CUDA context than the primary \
                     context of device {}",
                    device.ordinal()
                )));
            }
        }
        // SAFETY: the stream is live and belongs to this context (checked above; the null
        // stream is the context's legacy default stream); the caller keeps it alive.
        let cu = unsafe { ctx.wrap_borrowed_stream(cu_stream) };
        Ok(Stream::wrap(device, cu))
    }

    /// The legacy default (null) stream of `device`.
    pub fn default_stream(device: &Device) -> Stream {
        Stream::wrap(device, device.inner.ctx.default_stream())
    }

    /// The device this stream runs on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// A process-unique id of this stream (for logs and caches).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Blocks the calling thread until all work queued so far on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        drv("cuStreamSynchronize", self.inner.cu.synchronize())
    }

    /// Makes future work on this stream wait until `event` has completed. The event may belong to
    /// another device (cross-device waits are allowed).
    pub fn wait(&self, event: &Event) -> Result<()> {
        event.wait_on(self)
    }

    /// Records a fresh pooled event on this stream and returns it.
    pub fn record_event(&self) -> Result<Event> {
        let e = Event::new(self.device())?;
        e.record(self)?;
        Ok(e)
    }

    /// Makes this stream wait for everything queued so far on `other`.
    pub fn join(&self, other: &Stream) -> Result<()> {
        let e = other.record_event()?;
        self.wait(&e)
    }

    /// Whether this is the legacy default stream (the null stream or `CU_STREAM_LEGACY`),
    /// which cannot be captured into a graph.
    pub fn is_legacy_default(&self) -> bool {
        // `CU_STREAM_LEGACY` is the handle 0x1 (cuda.h); the bindings do not name it.
        const CU_STREAM_LEGACY: usize = 0x1;
        let raw = self.inner.cu.cu_stream() as usize;
        raw == 0 || raw == CU_STREAM_LEGACY
    }

    /// Errors unless this stream belongs to `device`.
    pub(crate) fn expect_device(&self, device: &Device, what: &str) -> Result<()> {
        if self.device().same_as(device) {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument(format!(
                "stream of device {} used for {what} on device {}",
                self.device().ordinal(),
                device.ordinal()
            )))
        }
    }

    /// Binds this stream's context to the calling thread and returns the raw stream.
    pub(crate) fn bind_raw(&self) -> Result<cudarc::driver::sys::CUstream> {
        self.device().bind()?;
        Ok(self.inner.cu.cu_stream())
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("device", &self.inner.device.ordinal())
            .finish()
    }
}
