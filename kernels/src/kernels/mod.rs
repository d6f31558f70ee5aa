//! NVRTC-compiled CUDA kernels: the per-device module cache and the launchers.
//!
//! Sources live in `kernels/cuda/*.cu` and are embedded with `include_str!`. They are compiled in
//! units ([`units`]: a whole source, or one typed kernel of it for one float type), each on the
//! first use of one of its kernels, for the device's architecture (CUBIN `sm_XY`, PTX fallback),
//! and cached per device in memory and, optionally, on disk. One submodule per kernel family
//! holds the safe launchers.

mod cache;
mod compile;
mod elementwise;
mod layout;
mod rows;
mod sources;
mod units;
mod user;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::Mutex;

use cudarc::driver::{result, sys};

pub use elementwise::{fill_pattern, poison_bits};
pub use layout::{StridedLayout, MAX_RANK};
pub use rows::{AxisView, RowReduce};
pub(crate) use sources::moe_typed_name;
pub use sources::Source;
use units::Unit;
pub use user::{KernelArg, UserKernel};

use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;

/// A raw function handle (thread-safe driver handle).
#[derive(Clone, Copy)]
struct RawFunction(sys::CUfunction);
// SAFETY: CUfunction handles may be used from any thread.
unsafe impl Send for RawFunction {}

/// One loaded module and its resolved functions.
struct Module {
    raw: sys::CUmodule,
    functions: HashMap<String, RawFunction>,
}
// SAFETY: CUmodule handles may be used from any thread; access is under the cache mutex.
unsafe impl Send for Module {}

/// Loaded modules of one device, by compile unit. Lives in the device; unloaded when it goes
/// away.
#[derive(Default)]
pub(crate) struct ModuleCache {
    modules: Mutex<HashMap<Unit, Module>>,
}

impl ModuleCache {
    /// Unloads every module; the owning context must be current.
    pub(crate) fn unload_all(&self) {
        if let Ok(mut m) = self.modules.lock() {
            for (_, module) in m.drain() {
                // SAFETY: the module was loaded by this cache and its functions are not in use
                // (the device, and with it every launcher, is being dropped).
                if let Err(e) = unsafe { result::module::unload(module.raw) } {
                    tracing::warn!("cuModuleUnload failed: {e}");
                }
            }
        }
    }
}

/// A kernel argument, kept alive while the launch reads it.
pub(crate) enum Arg {
    /// A device address.
    Ptr(u64),
    I64(i64),
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    Strided(layout::StridedArgs),
}

impl Arg {
    fn as_param(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => (v as *mut u64).cast(),
            Arg::I64(v) => (v as *mut i64).cast(),
            Arg::U8(v) => (v as *mut u8).cast(),
            Arg::U16(v) => (v as *mut u16).cast(),
            Arg::U32(v) => (v as *mut u32).cast(),
            Arg::Strided(v) => (v as *mut layout::StridedArgs).cast(),
        }
    }
}

/// The kernels of one device: compiles sources on first use and launches them. Cheap to clone;
/// the compiled modules are cached in the [`Device`] and shared by every `Kernels` of it.
#[derive(Clone)]
pub struct Kernels {
    device: Device,
}

impl Kernels {
    /// The kernels of `device` (nothing is compiled until first use).
    pub fn new(device: &Device) -> Kernels {
        Kernels {
            device: device.clone(),
        }
    }

    /// The device the kernels run on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Compiles and loads every compile unit and resolves every kernel the launchers use: a
    /// warm-up, and a check that the embedded sources compile on this machine.
    pub fn load_all(&self) -> Result<()> {
        for source in Source::ALL {
            for unit in Unit::all_of(source) {
                for name in unit.functions() {
                    self.function(source, &name)?;
                }
            }
        }
        Ok(())
    }

    /// Kernel `name` of `source`, compiling and loading its unit on first use.
    fn function(&self, source: Source, name: &str) -> Result<RawFunction> {
        let unit = Unit::of_kernel(source, name);
        let cache = &self.device.inner.modules;
        let mut modules = cache
            .modules
            .lock()
            .map_err(|_| KernelError::InvalidArgument("kernel module cache poisoned".into()))?;
        let module = match modules.entry(unit) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(self.load_module(&unit)?),
        };
        if let Some(f) = module.functions.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name)
            .map_err(|_| KernelError::InvalidArgument(format!("kernel name {name:?}")))?;
        // SAFETY: the module is loaded in this device's context, which is current.
        let f = unsafe { result::module::get_function(module.raw, cname) }.map_err(|e| {
            KernelError::InvalidArgument(format!("kernel {name} not found in {unit}: {e}"))
        })?;
        module.functions.insert(name.to_owned(), RawFunction(f));
        Ok(RawFunction(f))
    }

    fn load_module(&self, unit: &Unit) -> Result<Module> {
        self.device.bind()?;
        let cc = self.device.compute_capability();
        let (image, from_disk) = compile::compile(unit, cc, false)?;
        // SAFETY: `image` is a CUBIN or NUL-terminated PTX produced by NVRTC for this device.
        match unsafe { result::module::load_data(image.bytes().as_ptr().cast()) } {
            Ok(raw) => Ok(Module {
                raw,
                functions: HashMap::new(),
            }),
            Err(e) if from_disk => {
                tracing::warn!(%unit, "cached kernel image rejected ({e}); recompiling");
                let (image, _) = compile::compile(unit, cc, true)?;
                // SAFETY: as above, freshly compiled.
                let raw = drv("cuModuleLoadData", unsafe {
                    result::module::load_data(image.bytes().as_ptr().cast())
                })?;
                Ok(Module {
                    raw,
                    functions: HashMap::new(),
                })
            }
            Err(e) => drv("cuModuleLoadData", Err(e)),
        }
    }

    /// Blocks for `work` items handled `per_thread` at a time, capped for grid-stride loops.
    fn grid(&self, work: usize, per_thread: usize) -> u32 {
        let threads = work.div_ceil(per_thread.max(1));
        let blocks = threads.div_ceil(BLOCK as usize);
        let cap = self.device.sm_count() as usize * 16;
        u32::try_from(blocks.clamp(1, cap.max(1))).unwrap_or(1)
    }

    /// Calls kernel `name` of `source` on `stream` with `grid` blocks of `block` threads.
    ///
    /// Callers guarantee that `args` match the kernel's parameters and that every address and
    /// extent they pass lies inside live buffers (each launcher checks this before calling).
    pub(crate) fn call(
        &self,
        stream: &Stream,
        source: Source,
        name: &str,
        grid: u32,
        block: u32,
        args: &mut [Arg],
    ) -> Result<()> {
        stream.expect_device(&self.device, &format!("kernel {name}"))?;
        let f = self.function(source, name)?;
        let raw_stream = stream.bind_raw()?;
        let mut params: Vec<*mut c_void> = args.iter_mut().map(Arg::as_param).collect();
        // SAFETY: `f` is a loaded kernel of this context; `params` point into `args`, which
        // outlive the call (the driver copies them at launch); argument types and extents are
        // checked by the calling launcher (see above).
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(f.0, (grid, 1, 1), (block, 1, 1), 0, raw_stream, &mut params)
        })
    }
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl Device {
    /// The kernel launchers of this device (see [`Kernels`]).
    pub fn kernels(&self) -> Kernels {
        Kernels::new(self)
    }
}
