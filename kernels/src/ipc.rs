//! CUDA IPC between processes of one host (legacy `cuIpcGetMemHandle` / `cuIpcOpenMemHandle`):
//! the handle of the device allocation behind a buffer ([`DeviceBuffer::export_ipc`]) and its
//! mapping into another process ([`DeviceBuffer::open_ipc`]). The multi-process copy-engine
//! and NVLink MoE transports share memory this way.
//!
//! A handle names a whole driver allocation (`cuMemAlloc`, e.g. every [`DeviceBuffer::alloc`]
//! and the memory of PyTorch's default caching allocator); memory from stream-ordered pools
//! (`cuMemAllocAsync`) or virtual-memory mappings cannot be exported this way
//! ([`DeviceBuffer::ipc_capable`] says so).

use std::fmt;

use cudarc::driver::sys;

use crate::buffer::DeviceBuffer;
use crate::device::{drv, Device};
use crate::error::{KernelError, Result};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// The handle of a device allocation that another process of this host can map
/// ([`DeviceBuffer::open_ipc`]). Plain bytes: send it to the peer any way you like.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle([u8; IPC_HANDLE_BYTES]);

impl IpcHandle {
    /// The handle's bytes.
    pub fn to_bytes(&self) -> [u8; IPC_HANDLE_BYTES] {
        self.0
    }

    /// A handle from bytes received from a peer (exactly [`IPC_HANDLE_BYTES`] of them). Any
    /// bytes make a handle; the driver refuses invalid ones when they are opened.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle> {
        let b: [u8; IPC_HANDLE_BYTES] = bytes.try_into().map_err(|_| {
            KernelError::InvalidArgument(format!(
                "a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, not {}",
                bytes.len()
            ))
        })?;
        Ok(IpcHandle(b))
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcHandle({head}..)")
    }
}

/// What [`DeviceBuffer::export_ipc`] returns: the handle, where the view starts in the
/// allocation, and the allocation's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The handle of the whole driver allocation.
    pub handle: IpcHandle,
    /// Bytes from the allocation's start to the view's first byte.
    pub offset: usize,
    /// Bytes of the whole allocation.
    pub allocation_bytes: usize,
}

/// The start and size of the driver allocation holding device address `ptr` (the context of
/// `device` is made current).
fn address_range(device: &Device, ptr: u64) -> Result<(u64, usize)> {
    device.bind()?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: a query with valid out pointers; the driver validates `ptr`.
    drv("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result()
    })?;
    Ok((base, size))
}

/// A peer process's allocation mapped into this process; unmapped when dropped (with the last
/// view of the [`DeviceBuffer`] that owns it).
struct IpcMapping {
    addr: u64,
    device: Device,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let r = self.device.bind().and_then(|()| {
            // SAFETY: `addr` came from cuIpcOpenMemHandle and is closed once, when the last
            // view of the mapping is gone (the owner of the views ordered its device work
            // before dropping them).
            drv("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.addr).result()
            })
        });
        if let Err(e) = r {
            tracing::warn!(
                device = self.device.ordinal(),
                "closing a CUDA IPC mapping failed: {e}"
            );
        }
    }
}

impl DeviceBuffer {
    /// Whether another process can map this memory over CUDA IPC
    /// ([`DeviceBuffer::export_ipc`]): false for empty buffers and for memory of
    /// stream-ordered pools or virtual-memory mappings.
    pub fn ipc_capable(&self) -> Result<bool> {
        let (start, _) = self.allocation_start();
        if self.is_empty() || start == 0 {
            return Ok(false);
        }
        self.device().bind()?;
        // The attribute is a boolean the driver writes as an int; 8 zeroed bytes hold either
        // width.
        let mut capable: u64 = 0;
        // SAFETY: a query on a live device address; `capable` is a valid, large enough out
        // pointer for the attribute.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut capable as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                start,
            )
        };
        drv("cuPointerGetAttribute", r.result())?;
        Ok(capable != 0)
    }

    /// The IPC handle of the driver allocation holding this view, the view's byte offset in
    /// it and the allocation's size: a peer process maps it with [`DeviceBuffer::open_ipc`]
    /// and takes `view(offset, len)`. Exported once per allocation (later calls reuse the
    /// handle).
    pub fn export_ipc(&self) -> Result<IpcExport> {
        let (start, cache) = self.allocation_start();
        if start == 0 {
            return Err(KernelError::InvalidArgument(
                "an empty buffer cannot be shared over CUDA IPC".into(),
            ));
        }
        let found = |e: &IpcExport| IpcExport {
            offset: e.offset + self.offset(),
            ..*e
        };
        if let Some(e) = cache.get() {
            return Ok(found(e));
        }
        let (base, size) = address_range(self.device(), start)?;
        let mut raw = sys::CUipcMemHandle_st {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `base` is the start of a live driver allocation of the current context (from
        // cuMemGetAddressRange); `raw` is a valid out pointer.
        drv("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut raw, base).result()
        })?;
        let at = usize::try_from(start - base).map_err(|_| {
            KernelError::InvalidArgument("an allocation offset does not fit usize".into())
        })?;
        let e = IpcExport {
            handle: IpcHandle(raw.reserved.map(|c| c as u8)),
            offset: at,
            allocation_bytes: size,
        };
        Ok(found(cache.get_or_init(|| e)))
    }

    /// Maps the allocation behind `handle` (exported by another process of this host) into
    /// this process for `device`, with peer access enabled by the driver as needed. The
    /// result covers the whole allocation (its size as the driver reports it, else `bytes`,
    /// the size the exporter announced) and is unmapped when its last view is dropped: the
    /// caller keeps it alive while device work uses it. Fails cleanly on a handle the driver
    /// does not know, on one of this process, and between GPUs without peer access.
    pub fn open_ipc(device: &Device, handle: &IpcHandle, bytes: usize) -> Result<DeviceBuffer> {
        device.bind()?;
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: the driver validates the handle (garbage fails cleanly); `addr` is a valid
        // out pointer; `device`'s context is current.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut addr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        drv("cuIpcOpenMemHandle", r.result())?;
        let mapping = IpcMapping {
            addr,
            device: device.clone(),
        };
        let size = match address_range(device, addr) {
            Ok((base, size)) if base == addr => size,
            Ok(_) | Err(_) => bytes,
        };
        Ok(DeviceBuffer::mapped(device, addr, size, Box::new(mapping)))
    }
}
