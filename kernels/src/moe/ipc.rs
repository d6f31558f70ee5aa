//! CUDA IPC of device allocations between processes (`cuIpcGetMemHandle` /
//! `cuIpcOpenMemHandle`), for the multi-process NVLink transport.

use cudarc::driver::sys;

use crate::buffer::DeviceBuffer;
use crate::device::{drv, Device};
use crate::error::{KernelError, Result};

/// Bytes of a CUDA IPC memory handle.
pub(crate) const HANDLE_LEN: usize = 64;

/// The IPC handle of `buf`, which must be a whole `cuMemAlloc` allocation
/// ([`DeviceBuffer::alloc`]).
pub(crate) fn export(buf: &DeviceBuffer) -> Result<[u8; HANDLE_LEN]> {
    if buf.offset() != 0 {
        return Err(KernelError::InvalidArgument(
            "only a whole allocation can be exported over CUDA IPC".into(),
        ));
    }
    buf.device().bind()?;
    let mut handle = sys::CUipcMemHandle_st {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: `buf` is a live cuMemAlloc allocation of the current context; `handle` is a valid
    // out pointer.
    let r = unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.addr()) };
    drv("cuIpcGetMemHandle", r.result())?;
    Ok(handle.reserved.map(|c| c as u8))
}

/// A peer process's allocation mapped into this process on `device`; unmapped on drop.
pub(crate) struct IpcMapping {
    addr: u64,
    device: Device,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` (from another process) for `device`, with peer
    /// access enabled lazily by the driver.
    pub(crate) fn open(device: &Device, handle: &[u8; HANDLE_LEN]) -> Result<IpcMapping> {
        device.bind()?;
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is a handle received from a peer (the driver validates it and fails
        // cleanly on garbage); `addr` is a valid out pointer; this device's context is current.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut addr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        drv("cuIpcOpenMemHandle", r.result())?;
        Ok(IpcMapping {
            addr,
            device: device.clone(),
        })
    }

    /// The mapped address in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let r = self.device.bind().and_then(|()| {
            // SAFETY: `addr` came from cuIpcOpenMemHandle and is closed once; no kernel of this
            // process uses it any more (its owner keeps it alive only while the transport lives).
            drv(
                "cuIpcCloseMemHandle",
                unsafe { sys::cuIpcCloseMemHandle(self.addr) }.result(),
            )
        });
        if let Err(e) = r {
            tracing::warn!(
                device = self.device.ordinal(),
                "closing an IPC mapping failed: {e}"
            );
        }
    }
}
