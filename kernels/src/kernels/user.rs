//! Kernels supplied by an embedder as a PTX or CUBIN image ([`UserKernel`]), for the host IR's
//! `call_kernel`.
//!
//! meshflow cannot check what a foreign kernel does: the embedder who registers an image vouches
//! that the kernel touches only the buffers it is given, within their extents, and that the
//! parameter list passed at launch matches the kernel's signature.

use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use crate::buffer::DeviceBuffer;
use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// One argument of a [`UserKernel`] launch, in the kernel's parameter order.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A device pointer to the first byte of the buffer (a `T*` parameter).
    Buffer(&'a DeviceBuffer),
    /// A 64-bit integer (`long long` / `int64_t`).
    I64(i64),
    /// A 32-bit integer (`int`).
    I32(i32),
    /// A 32-bit float.
    F32(f32),
}

/// A loaded module, unloaded when the last kernel of it goes away.
struct UserModule {
    raw: sys::CUmodule,
    device: Device,
}

// SAFETY: CUmodule handles may be used from any thread; the module is only unloaded on drop.
unsafe impl Send for UserModule {}
// SAFETY: as above; nothing mutates the handle.
unsafe impl Sync for UserModule {}

impl Drop for UserModule {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the module was loaded by `UserKernel::load` in this device's context and no
            // kernel of it can be launched any more (the last handle is being dropped).
            if let Err(e) = unsafe { result::module::unload(self.raw) } {
                tracing::warn!("cuModuleUnload of a user module failed: {e}");
            }
        }
    }
}

/// A kernel function of an embedder-supplied PTX or CUBIN image, loaded on one device. Cheap to
/// clone.
#[derive(Clone)]
pub struct UserKernel {
    module: Arc<UserModule>,
    function: sys::CUfunction,
    name: String,
}

// SAFETY: CUfunction handles may be used from any thread; the module outlives them (held in `module`).
unsafe impl Send for UserKernel {}
// SAFETY: as above.
unsafe impl Sync for UserKernel {}

impl UserKernel {
    /// Loads `image` (PTX text, NUL-terminated or not, or a CUBIN/fatbin starting with the ELF
    /// magic) on `device` and resolves `function` (an `extern "C"` kernel name).
    pub fn load(device: &Device, image: &[u8], function: &str) -> Result<UserKernel> {
        let mut bytes = image.to_vec();
        let is_elf = bytes.starts_with(b"\x7fELF");
        if !is_elf && bytes.last() != Some(&0) {
            bytes.push(0);
        }
        let name = CString::new(function)
            .map_err(|_| KernelError::InvalidArgument(format!("kernel name {function:?}")))?;
        device.bind()?;
        // SAFETY: `bytes` is a NUL-terminated PTX text or an ELF image that lives across the call;
        // the device's context is current.
        let raw = drv("cuModuleLoadData", unsafe {
            result::module::load_data(bytes.as_ptr().cast())
        })?;
        let module = Arc::new(UserModule {
            raw,
            device: device.clone(),
        });
        // SAFETY: the module is loaded in this device's context, which is current.
        let f = unsafe { result::module::get_function(module.raw, name) }.map_err(|e| {
            KernelError::InvalidArgument(format!("kernel {function} not found in the image: {e}"))
        })?;
        Ok(UserKernel {
            module,
            function: f,
            name: function.to_owned(),
        })
    }

    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device it is loaded on.
    pub fn device(&self) -> &Device {
        &self.module.device
    }

    /// Calls the kernel on `stream` with `grid` blocks of `block` threads, `shared_mem_bytes`
    /// of dynamic shared memory and `args` (which must match the kernel's parameters; see the
    /// module docs for the trust this requires). Buffers must live on the kernel's device.
    pub fn call(
        &self,
        stream: &Stream,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        args: &[KernelArg<'_>],
    ) -> Result<()> {
        let device = &self.module.device;
        stream.expect_device(device, &format!("kernel {}", self.name))?;
        if grid.contains(&0) || block.contains(&0) {
            return Err(KernelError::InvalidArgument(format!(
                "kernel {}: grid {grid:?} / block {block:?} has a zero dimension",
                self.name
            )));
        }
        // One 8-byte slot per parameter; narrower values sit in the low bytes (little endian),
        // which is where the driver reads a 4-byte parameter from.
        let mut slots: Vec<u64> = Vec::with_capacity(args.len());
        for a in args {
            slots.push(match a {
                KernelArg::Buffer(b) => {
                    device.expect_same(b.device(), &format!("kernel {} buffer", self.name))?;
                    b.addr()
                }
                KernelArg::I64(v) => *v as u64,
                KernelArg::I32(v) => u64::from(*v as u32),
                KernelArg::F32(v) => u64::from(v.to_bits()),
            });
        }
        let raw_stream = stream.bind_raw()?;
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut u64).cast::<c_void>())
            .collect();
        // SAFETY: `function` belongs to a loaded module of this context (kept alive by `module`);
        // `params` point into `slots`, which outlive the call (the driver copies them at launch).
        // That the parameters match the kernel and that it stays inside its buffers is the
        // embedder's contract (module docs).
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(
                self.function,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                shared_mem_bytes,
                raw_stream,
                &mut params,
            )
        })
    }
}

impl fmt::Debug for UserKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserKernel")
            .field("name", &self.name)
            .field("device", &self.module.device.ordinal())
            .finish()
    }
}
