//! [`PinnedBuffer`]: page-locked host memory mapped into the device's address space
//! (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`), for stream-ordered copies between host and
//! device and for flags the device waits on (`cuStreamWaitValue32`).

use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::{result, sys};

use crate::buffer::DeviceBuffer;
use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// The flag value that releases every wait for a value below it (see
/// [`PinnedBuffer::release_all`]).
pub(crate) const FLAG_RELEASE: u32 = 1 << 30;

/// Page-locked, device-mapped host memory. Reads and writes from the host go through the
/// methods below; the device reaches it through copies and stream memory operations. The
/// caller orders host accesses with the device's (events, flags).
pub(crate) struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    device: Device,
}

// SAFETY: the allocation is plain host memory owned by this value; concurrent access is ordered
// by the users (one writer at a time, published through flags/events).
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; `&self` methods never hand out references into the memory.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes (at least 4) of pinned host memory usable by `device`, zeroed.
    pub(crate) fn new(device: &Device, len: usize) -> Result<PinnedBuffer> {
        let len = len.max(4);
        device.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a plain allocation call; the pointer is checked below and owned by the value.
        let ptr = drv("cuMemHostAlloc", unsafe { result::malloc_host(len, flags) })?;
        if ptr.is_null() {
            return Err(KernelError::InvalidArgument(
                "cuMemHostAlloc returned a null pointer".into(),
            ));
        }
        // SAFETY: `ptr` points to `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len,
            device: device.clone(),
        })
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies `data` to offset 0 (host side; nothing on the device may be reading it).
    pub(crate) fn write(&self, data: &[u8]) -> Result<()> {
        if data.len() > self.len {
            return Err(KernelError::InvalidArgument(format!(
                "{} bytes into a pinned buffer of {}",
                data.len(),
                self.len
            )));
        }
        // SAFETY: the range is inside the allocation; the caller's protocol gives this thread
        // exclusive access to it now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, data.len()) };
        Ok(())
    }

    /// The first `len` bytes (host side; nothing on the device may be writing them).
    pub(crate) fn read(&self, len: usize) -> Result<Vec<u8>> {
        if len > self.len {
            return Err(KernelError::InvalidArgument(format!(
                "{len} bytes from a pinned buffer of {}",
                self.len
            )));
        }
        let mut out = vec![0u8; len];
        // SAFETY: the range is inside the allocation and no one writes it now (protocol).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), len) };
        Ok(out)
    }

    fn check(&self, at: usize, len: usize, what: &str) -> Result<()> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(KernelError::InvalidArgument(format!(
                "{what}: bytes {at}..{} of a pinned buffer of {}",
                at.saturating_add(len),
                self.len
            )));
        }
        Ok(())
    }

    /// Enqueues on `stream` a copy of `src` into bytes `at..` of this buffer.
    pub(crate) fn copy_from_device(
        &self,
        stream: &Stream,
        at: usize,
        src: &DeviceBuffer,
    ) -> Result<()> {
        self.check(at, src.len(), "device to pinned copy")?;
        stream.expect_device(&self.device, "a pinned copy")?;
        if src.is_empty() {
            return Ok(());
        }
        let s = stream.bind_raw()?;
        // SAFETY: both ranges are inside live allocations; the pinned memory outlives the copy
        // (its users keep it until an event after the copy completes).
        drv("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.ptr.add(at).cast(), src.addr(), src.len(), s).result()
        })
    }

    /// Enqueues on `stream` a copy of bytes `at..at + dst.len()` of this buffer into `dst`.
    pub(crate) fn copy_to_device(
        &self,
        stream: &Stream,
        at: usize,
        dst: &DeviceBuffer,
    ) -> Result<()> {
        self.check(at, dst.len(), "pinned to device copy")?;
        stream.expect_device(&self.device, "a pinned copy")?;
        if dst.is_empty() {
            return Ok(());
        }
        let s = stream.bind_raw()?;
        // SAFETY: as in `copy_from_device`.
        drv("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.addr(), self.ptr.add(at).cast(), dst.len(), s).result()
        })
    }

    /// The first 4 bytes as a flag the host raises.
    fn flag(&self) -> &AtomicU32 {
        // SAFETY: the allocation is at least 4 bytes, page-aligned (so aligned for u32), lives
        // as long as `self`, and is only accessed atomically as a flag by its users.
        unsafe { &*(self.ptr as *const AtomicU32) }
    }

    /// Raises the flag (the first 4 bytes) to `value`, after every earlier host write.
    /// Values must stay below [`FLAG_RELEASE`] (the device compares cyclically).
    pub(crate) fn raise(&self, value: u32) {
        self.flag().fetch_max(value, Ordering::Release);
    }

    /// Raises the flag past every value below [`FLAG_RELEASE`] a stream may wait for. (The
    /// device's `GEQ` wait compares cyclically, `(int32_t)(flag - value) >= 0`, so `u32::MAX`
    /// would release nothing.)
    pub(crate) fn release_all(&self) {
        self.flag().fetch_max(FLAG_RELEASE, Ordering::Release);
    }

    /// The flag's current value (the first 4 bytes; acquire).
    pub(crate) fn value(&self) -> u32 {
        self.flag().load(Ordering::Acquire)
    }

    /// The device address at which kernels of this buffer's device reach it.
    pub(crate) fn device_addr(&self) -> Result<u64> {
        self.device.bind()?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was allocated with DEVICEMAP in a context of this device; flags 0.
        drv("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, self.ptr.cast(), 0).result()
        })?;
        Ok(dev)
    }

    /// Makes `stream` wait until the flag (the first 4 bytes) is at least `value`.
    pub(crate) fn wait_on(&self, stream: &Stream, value: u32) -> Result<()> {
        stream.expect_device(&self.device, "a flag wait")?;
        let s = stream.bind_raw()?;
        let dev = self.device_addr()?;
        // SAFETY: `dev` maps the live flag word; GEQ waits until the host raises it.
        drv("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                s,
                dev,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
            .result()
        })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, here.
        if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
            tracing::debug!("cuMemFreeHost: {e}");
        }
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}
