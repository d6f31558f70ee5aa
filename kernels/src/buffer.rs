//! Device memory: owned allocations and byte-range views of them.

use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};

use crate::device::{drv, Device};
use crate::dtype::{DType, Element};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// One device allocation, freed when the last [`DeviceBuffer`] view of it is dropped.
struct Allocation {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    device: Device,
    /// `Some`: allocated with `cuMemAllocAsync` and freed on this stream; `None`: `cuMemAlloc`.
    free_stream: Option<Stream>,
    /// Memory of the caller ([`DeviceBuffer::from_raw_borrowed`]): never freed here.
    borrowed: bool,
    /// What keeps borrowed memory allocated (e.g. the Python object owning it), released with
    /// the last view.
    _owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// The CUDA IPC export of the driver allocation holding `ptr` (with `ptr`'s offset in
    /// it), once made ([`DeviceBuffer::export_ipc`]).
    ipc: OnceLock<crate::ipc::IpcExport>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.bytes == 0 || self.borrowed {
            return;
        }
        let r = match &self.free_stream {
            Some(s) => s.bind_raw().and_then(|raw| {
                // SAFETY: `ptr` came from cuMemAllocAsync and no view of it is left.
                drv("cuMemFreeAsync", unsafe {
                    result::free_async(self.ptr, raw)
                })
            }),
            None => self.device.bind().and_then(|()| {
                // SAFETY: `ptr` came from cuMemAlloc and no view of it is left.
                drv("cuMemFree", unsafe { result::free_sync(self.ptr) })
            }),
        };
        if let Err(e) = r {
            tracing::warn!(
                device = self.device.ordinal(),
                bytes = self.bytes,
                "free failed: {e}"
            );
        }
    }
}

/// A byte range of device memory on one [`Device`]: a whole allocation or a view into one.
///
/// Cloning or [`view`](DeviceBuffer::view)ing shares the memory (no copy, no allocation); the
/// allocation is freed when the last handle is dropped. Device work is asynchronous: the caller
/// must order any pending use of the memory (on other streams) before the last handle goes away,
/// e.g. by synchronizing or by waiting on an [`crate::Event`]. Allocations from
/// [`alloc_async`](DeviceBuffer::alloc_async) are freed in order on their stream.
#[derive(Clone)]
pub struct DeviceBuffer {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `bytes` bytes with `cuMemAlloc` (not from a pool: usable for peer access and IPC).
    /// Contents are uninitialized.
    pub fn alloc(device: &Device, bytes: usize) -> Result<DeviceBuffer> {
        let ptr = if bytes == 0 {
            0
        } else {
            device.bind()?;
            // SAFETY: plain allocation in the current context.
            drv("cuMemAlloc", unsafe { result::malloc_sync(bytes) })?
        };
        Ok(DeviceBuffer::whole(ptr, bytes, device.clone(), None))
    }

    /// Allocates `bytes` bytes from the device's stream-ordered pool (`cuMemAllocAsync`); usable
    /// in order on `stream`, freed in order on `stream`. Contents are uninitialized.
    pub fn alloc_async(stream: &Stream, bytes: usize) -> Result<DeviceBuffer> {
        let ptr = if bytes == 0 {
            0
        } else {
            let raw = stream.bind_raw()?;
            // SAFETY: stream-ordered allocation on a live stream of the current context.
            drv("cuMemAllocAsync", unsafe {
                result::malloc_async(raw, bytes)
            })?
        };
        Ok(DeviceBuffer::whole(
            ptr,
            bytes,
            stream.device().clone(),
            Some(stream.clone()),
        ))
    }

    /// Allocates a buffer holding a copy of `data` (blocks until the copy is done).
    pub fn from_slice<T: Element>(stream: &Stream, data: &[T]) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::alloc(stream.device(), std::mem::size_of_val(data))?;
        buf.upload(stream, data)?;
        Ok(buf)
    }

    /// Allocates `count` elements of `dtype` (uninitialized).
    pub fn alloc_elems(device: &Device, dtype: DType, count: usize) -> Result<DeviceBuffer> {
        let bytes = count.checked_mul(dtype.size_bytes()).ok_or_else(|| {
            KernelError::InvalidArgument(format!("{count} elements of {dtype} overflow usize"))
        })?;
        DeviceBuffer::alloc(device, bytes)
    }

    fn whole(ptr: u64, bytes: usize, device: Device, free_stream: Option<Stream>) -> DeviceBuffer {
        DeviceBuffer {
            alloc: Arc::new(Allocation {
                ptr,
                bytes,
                device,
                free_stream,
                borrowed: false,
                _owner: None,
                ipc: OnceLock::new(),
            }),
            offset: 0,
            len: bytes,
        }
    }

    /// Wraps `bytes` bytes of device memory the caller allocated (e.g. the storage of a PyTorch
    /// tensor) at device address `ptr` on `device`. Kernels and copies then read and write that
    /// memory in place; it is never freed here. Checks that the range lies inside one
    /// allocation of `device`'s primary context.
    ///
    /// # Safety
    /// The memory must stay allocated, and must not be used by others in ways that race with
    /// it, while the returned buffer (or any view or clone of it) is alive and while device
    /// work enqueued on it has not completed.
    pub unsafe fn from_raw_borrowed(
        device: &Device,
        ptr: u64,
        bytes: usize,
    ) -> Result<DeviceBuffer> {
        // SAFETY: forwarded from the caller.
        unsafe { DeviceBuffer::from_raw_owned_by(device, ptr, bytes, None) }
    }

    /// [`DeviceBuffer::from_raw_borrowed`] with `owner` kept alive until the last view of the
    /// buffer is dropped (e.g. the Python object that owns the memory).
    ///
    /// # Safety
    /// As [`DeviceBuffer::from_raw_borrowed`], where holding `owner` may be what keeps the
    /// memory allocated.
    pub(crate) unsafe fn from_raw_owned_by(
        device: &Device,
        ptr: u64,
        bytes: usize,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<DeviceBuffer> {
        if bytes > 0 {
            device.bind()?;
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: a query; the out-pointers are valid locals.
            drv("cuMemGetAddressRange", unsafe {
                sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result()
            })?;
            let end = ptr.checked_add(bytes as u64);
            if end.is_none_or(|end| end > base + size as u64) {
                return Err(KernelError::InvalidArgument(format!(
                    "{bytes} bytes at the caller's device address do not fit in its allocation \
                     of {size} bytes ({} bytes from its start)",
                    ptr - base
                )));
            }
        }
        Ok(DeviceBuffer {
            alloc: Arc::new(Allocation {
                ptr,
                bytes,
                device: device.clone(),
                free_stream: None,
                borrowed: true,
                _owner: owner,
                ipc: OnceLock::new(),
            }),
            offset: 0,
            len: bytes,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of this view inside its allocation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The device holding the memory.
    pub fn device(&self) -> &Device {
        &self.alloc.device
    }

    /// Number of `dtype` elements, or an error when the length is not a multiple of its size.
    pub fn elems(&self, dtype: DType) -> Result<usize> {
        if !self.len.is_multiple_of(dtype.size_bytes()) {
            return Err(KernelError::InvalidArgument(format!(
                "buffer of {} bytes is not a whole number of {dtype} elements",
                self.len
            )));
        }
        Ok(self.len / dtype.size_bytes())
    }

    /// A view of `len` bytes starting `offset` bytes into this view, sharing the memory.
    pub fn view(&self, offset: usize, len: usize) -> Result<DeviceBuffer> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(DeviceBuffer {
                alloc: self.alloc.clone(),
                offset: self.offset + offset,
                len,
            }),
            _ => Err(KernelError::InvalidArgument(format!(
                "view [{offset}, {offset}+{len}) is outside a buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// Chunk `index` of `count` equal chunks (the length must divide evenly).
    pub fn chunk(&self, index: usize, count: usize) -> Result<DeviceBuffer> {
        if count == 0 || index >= count || !self.len.is_multiple_of(count) {
            return Err(KernelError::InvalidArgument(format!(
                "chunk {index} of {count} of a buffer of {} bytes",
                self.len
            )));
        }
        let size = self.len / count;
        self.view(index * size, size)
    }

    /// Whether two views share any byte of the same allocation.
    pub fn overlaps(&self, other: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.alloc, &other.alloc)
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
            && self.len > 0
            && other.len > 0
    }

    /// Device address of the first byte (crate-internal: raw addresses never leave the crate).
    pub(crate) fn addr(&self) -> u64 {
        self.alloc.ptr + self.offset as u64
    }

    /// Whether the first byte's device address is a multiple of `align` bytes (e.g. 16 for
    /// kernels that read 16-byte vectors).
    pub fn is_aligned(&self, align: usize) -> bool {
        align == 0 || self.addr().is_multiple_of(align as u64)
    }

    /// The device address of the allocation's first byte and the cache of its IPC export.
    pub(crate) fn allocation_start(&self) -> (u64, &OnceLock<crate::ipc::IpcExport>) {
        (self.alloc.ptr, &self.alloc.ipc)
    }

    /// A buffer over `bytes` bytes at `ptr` of `device`'s address space that this crate mapped
    /// (never freed here): `owner` unmaps it when the last view is dropped.
    pub(crate) fn mapped(
        device: &Device,
        ptr: u64,
        bytes: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> DeviceBuffer {
        DeviceBuffer {
            alloc: Arc::new(Allocation {
                ptr,
                bytes,
                device: device.clone(),
                free_stream: None,
                borrowed: true,
                _owner: Some(owner),
                ipc: OnceLock::new(),
            }),
            offset: 0,
            len: bytes,
        }
    }

    pub(crate) fn raw_ctx(&self) -> sys::CUcontext {
        self.alloc.device.inner.ctx.cu_ctx()
    }

    fn expect_len(&self, bytes: usize, what: &str) -> Result<()> {
        if bytes == self.len {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument(format!(
                "{what}: {bytes} bytes given for a buffer of {} bytes",
                self.len
            )))
        }
    }

    /// Copies `data` into this buffer (sizes must match) and waits until the copy is done, so
    /// `data` may be dropped right after.
    pub fn upload<T: Element>(&self, stream: &Stream, data: &[T]) -> Result<()> {
        self.expect_len(std::mem::size_of_val(data), "upload")?;
        stream.expect_device(self.device(), "an upload")?;
        if self.len == 0 {
            return Ok(());
        }
        let raw = stream.bind_raw()?;
        // SAFETY: the destination range is inside the allocation (checked above); the source is a
        // live slice of plain data that outlives the copy because we synchronize below.
        drv("cuMemcpyHtoDAsync", unsafe {
            result::memcpy_htod_async(self.addr(), data, raw)
        })?;
        stream.synchronize()
    }

    /// Copies this buffer into `out` (sizes must match), waiting for all earlier work on `stream`
    /// and for the copy itself.
    pub fn download<T: Element>(&self, stream: &Stream, out: &mut [T]) -> Result<()> {
        self.expect_len(std::mem::size_of_val(out), "download")?;
        stream.expect_device(self.device(), "a download")?;
        if self.len == 0 {
            return Ok(());
        }
        let raw = stream.bind_raw()?;
        // SAFETY: the source range is inside the allocation; `out` is a live, exclusively borrowed
        // slice of plain data (every bit pattern valid) that outlives the copy (synchronized).
        drv("cuMemcpyDtoHAsync", unsafe {
            result::memcpy_dtoh_async(out, self.addr(), raw)
        })?;
        stream.synchronize()
    }

    /// Downloads the whole buffer as a vector of `T`.
    pub fn to_vec<T: Element + Default>(&self, stream: &Stream) -> Result<Vec<T>> {
        let n = self.elems(T::DTYPE)?;
        let mut v = vec![T::default(); n];
        self.download(stream, &mut v)?;
        Ok(v)
    }

    /// Asynchronously copies `src` into this buffer (same length) on `stream`. When `src` lives on
    /// another device this is a peer copy (`cuMemcpyPeerAsync`, copy engines, no SMs).
    pub fn copy_from(&self, stream: &Stream, src: &DeviceBuffer) -> Result<()> {
        self.expect_len(src.len, "device copy")?;
        if self.len == 0 {
            return Ok(());
        }
        if src.device().same_as(self.device()) {
            stream.expect_device(self.device(), "a device copy")?;
            let raw = stream.bind_raw()?;
            // SAFETY: both ranges lie inside live allocations of the current context.
            drv("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(self.addr(), src.addr(), self.len, raw)
            })
        } else {
            self.copy_from_peer(stream, src)
        }
    }

    /// Asynchronously copies `src` (on any device) into this buffer with `cuMemcpyPeerAsync`; the
    /// stream may belong to either device.
    pub fn copy_from_peer(&self, stream: &Stream, src: &DeviceBuffer) -> Result<()> {
        self.expect_len(src.len, "peer copy")?;
        if !stream.device().same_as(self.device()) && !stream.device().same_as(src.device()) {
            return Err(KernelError::InvalidArgument(format!(
                "peer copy from device {} to device {} on a stream of device {}",
                src.device().ordinal(),
                self.device().ordinal(),
                stream.device().ordinal()
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        let raw = stream.bind_raw()?;
        // SAFETY: both ranges lie inside live allocations; the contexts are those allocations'.
        drv("cuMemcpyPeerAsync", unsafe {
            result::memcpy_peer_async(
                self.raw_ctx(),
                self.addr(),
                src.raw_ctx(),
                src.addr(),
                self.len,
                raw,
            )
        })
    }

    /// Asynchronously sets every byte to `value`.
    pub fn memset(&self, stream: &Stream, value: u8) -> Result<()> {
        stream.expect_device(self.device(), "a memset")?;
        if self.len == 0 {
            return Ok(());
        }
        let raw = stream.bind_raw()?;
        // SAFETY: the range lies inside a live allocation of the current context.
        drv("cuMemsetD8Async", unsafe {
            result::memset_d8_async(self.addr(), value, self.len, raw)
        })
    }

    /// Asynchronously zeroes the buffer.
    pub fn zero(&self, stream: &Stream) -> Result<()> {
        self.memset(stream, 0)
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.alloc.device.ordinal())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("allocation_bytes", &self.alloc.bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_memory_is_used_in_place_and_never_freed() {
        let device = match Device::count() {
            Ok(n) if n > 0 => Device::new(0).expect("open device 0"),
            other => {
                eprintln!("skipped: no CUDA device ({other:?})");
                return;
            }
        };
        let stream = Stream::new(&device).expect("stream");
        let owner = DeviceBuffer::from_slice(&stream, &[1.0f32; 64]).expect("alloc");
        // SAFETY: `owner` keeps the memory allocated longer than `borrowed` lives.
        let borrowed = unsafe { DeviceBuffer::from_raw_borrowed(&device, owner.addr() + 64, 128) }
            .expect("inside the allocation");
        borrowed.upload(&stream, &[2.0f32; 32]).expect("upload");
        drop(borrowed);
        let all = owner.to_vec::<f32>(&stream).expect("read back");
        assert_eq!(&all[..16], &[1.0; 16]);
        assert_eq!(&all[16..48], &[2.0; 32]);
        assert_eq!(&all[48..], &[1.0; 16]);
        // SAFETY: only checked, never used: the range is refused.
        let e = unsafe { DeviceBuffer::from_raw_borrowed(&device, owner.addr() + 64, 1 << 30) };
        assert!(e.is_err(), "a range past the allocation must be refused");
    }
}
