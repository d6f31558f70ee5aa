//! CUDA devices (primary contexts) and peer access.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{sys, CudaContext, DriverError};

use crate::error::{KernelError, Result};
use crate::event::EventPool;
use crate::kernels::ModuleCache;
use crate::probe;

/// Turns a driver result into this crate's error, naming the call.
pub(crate) fn drv<T>(call: &'static str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|source| KernelError::Driver { call, source })
}

/// One GPU, through its primary context (shared with NCCL, the CUDA runtime and PyTorch).
/// Cheap to clone; every clone is the same device.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    // Field order is drop order: modules and pooled events go before the context.
    pub(crate) modules: ModuleCache,
    pub(crate) events: EventPool,
    pub(crate) ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    total_memory: usize,
    peers_enabled: Mutex<HashSet<usize>>,
}

impl Device {
    /// Number of CUDA devices, or [`KernelError::NoDevice`] when there is no driver.
    pub fn count() -> Result<usize> {
        probe::driver()?;
        let n = probe::no_panic("cuda", CudaContext::device_count)?;
        Ok(usize::try_from(drv("cuDeviceGetCount", n)?).unwrap_or(0))
    }

    /// Opens device `ordinal` (retains its primary context and makes it current on this thread).
    /// Every call for the same ordinal returns the same device while one is alive, so compiled
    /// kernels and pooled events are shared process-wide.
    ///
    /// Returns [`KernelError::NoDevice`] when the driver is missing, there is no GPU, or the
    /// ordinal is out of range; never panics.
    pub fn new(ordinal: usize) -> Result<Device> {
        static OPEN: Mutex<Vec<Weak<DeviceInner>>> = Mutex::new(Vec::new());
        let mut open = OPEN
            .lock()
            .map_err(|_| KernelError::NoDevice("device registry poisoned".into()))?;
        if let Some(inner) = open.get(ordinal).and_then(Weak::upgrade) {
            let device = Device { inner };
            device.bind()?;
            return Ok(device);
        }
        let device = Device::open(ordinal)?;
        if open.len() <= ordinal {
            open.resize(ordinal + 1, Weak::new());
        }
        open[ordinal] = Arc::downgrade(&device.inner);
        Ok(device)
    }

    fn open(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(KernelError::NoDevice(format!(
                "device {ordinal} requested but {count} CUDA device(s) are visible"
            )));
        }
        let ctx = drv(
            "cuDevicePrimaryCtxRetain",
            probe::no_panic("cuda", || CudaContext::new(ordinal))?,
        )?;
        // SAFETY: this crate never uses cudarc's CudaSlice, whose cross-stream tracking is the
        // only thing event tracking serves; callers order work across streams with [`Event`]s.
        unsafe { ctx.disable_event_tracking() };
        let name = drv("cuDeviceGetName", ctx.name())?;
        let (major, minor) = drv("cuDeviceGetAttribute", ctx.compute_capability())?;
        let sm_count = drv(
            "cuDeviceGetAttribute",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )?;
        let total_memory = drv("cuDeviceTotalMem", ctx.total_mem())?;
        let to_u32 = |v: i32| u32::try_from(v).unwrap_or(0);
        tracing::debug!(ordinal, %name, major, minor, "opened CUDA device");
        Ok(Device {
            inner: Arc::new(DeviceInner {
                modules: ModuleCache::default(),
                events: EventPool::default(),
                ctx,
                ordinal,
                name,
                compute_capability: (to_u32(major), to_u32(minor)),
                sm_count: to_u32(sm_count).max(1),
                total_memory,
                peers_enabled: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// The marketing name of device `ordinal` (e.g. `NVIDIA H200`) without opening it: no
    /// context is created, so asking costs no device memory. [`KernelError::NoDevice`] as for
    /// [`Device::new`].
    pub fn name_of(ordinal: usize) -> Result<String> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(KernelError::NoDevice(format!(
                "device {ordinal} requested but {count} CUDA device(s) are visible"
            )));
        }
        let index = i32::try_from(ordinal)
            .map_err(|_| KernelError::NoDevice(format!("device ordinal {ordinal} is too large")))?;
        let dev = drv(
            "cuDeviceGet",
            probe::no_panic("cuda", || cudarc::driver::result::device::get(index))?,
        )?;
        drv(
            "cuDeviceGetName",
            probe::no_panic("cuda", || cudarc::driver::result::device::get_name(dev))?,
        )
    }

    /// Opens every visible device, in ordinal order.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::new).collect()
    }

    /// CUDA ordinal of this device.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Marketing name (e.g. `NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.compute_capability
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.inner.total_memory
    }

    /// `(free, total)` device memory in bytes right now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        drv("cuMemGetInfo", self.inner.ctx.mem_get_info())
    }

    /// Makes this device's primary context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        drv("cuCtxSetCurrent", self.inner.ctx.bind_to_thread())
    }

    /// Blocks until all work on this device has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        drv("cuCtxSynchronize", self.inner.ctx.synchronize())
    }

    /// Whether this device can map `peer`'s memory (`cuDeviceCanAccessPeer`).
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer.ordinal() == self.ordinal() {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: both device handles come from live contexts; `can` is a valid out pointer.
        let r = unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.inner.ctx.cu_device(),
                peer.inner.ctx.cu_device(),
            )
        };
        drv("cuDeviceCanAccessPeer", r.result())?;
        Ok(can != 0)
    }

    /// Lets kernels on this device access `peer`'s memory (`cuCtxEnablePeerAccess`). Idempotent.
    /// Peer copies ([`crate::DeviceBuffer::copy_from`]) work without it; kernel stores into peer
    /// memory need it.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        let mut enabled = self
            .inner
            .peers_enabled
            .lock()
            .map_err(|_| KernelError::InvalidArgument("peer-access table poisoned".into()))?;
        if enabled.contains(&peer.ordinal()) {
            return Ok(());
        }
        if !self.can_access_peer(peer)? {
            return Err(KernelError::Unsupported(format!(
                "device {} cannot access the memory of device {}",
                self.ordinal(),
                peer.ordinal()
            )));
        }
        self.bind()?;
        // SAFETY: the peer context is alive (held by `peer`); this context is current.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx(), 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                enabled.insert(peer.ordinal());
                Ok(())
            }
            other => drv("cuCtxEnablePeerAccess", other.result()),
        }
    }

    /// Whether `self` and `other` are the same device.
    pub fn same_as(&self, other: &Device) -> bool {
        self.ordinal() == other.ordinal()
    }

    /// Errors unless `other` is this device; `what` names the object for the message.
    pub(crate) fn expect_same(&self, other: &Device, what: &str) -> Result<()> {
        if self.same_as(other) {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument(format!(
                "{what} is on device {} but the operation runs on device {}",
                other.ordinal(),
                self.ordinal()
            )))
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("compute_capability", &self.inner.compute_capability)
            .finish()
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(
                ordinal = self.ordinal,
                "cannot bind context while dropping device: {e}"
            );
            return;
        }
        self.modules.unload_all();
        self.events.destroy_all();
    }
}
