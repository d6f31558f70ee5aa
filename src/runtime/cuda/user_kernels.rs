//! Named kernels for `call_kernel` on the CUDA backend: a PTX (or CUBIN) image, the function
//! name, and a closure that picks the launch dimensions from the operand shapes and scalar
//! arguments.
//!
//! Kernel parameters, in order: a pointer to each input (packed row-major; strided views are
//! copied first), a pointer to each output, then each scalar argument as a 64-bit integer.

use std::fmt;
use std::sync::Arc;

/// Grid, block and dynamic shared memory of a launch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GridDims {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
}

impl GridDims {
    /// A 1-D launch of `threads` threads in blocks of `block` (at least one block).
    pub fn linear(threads: u64, block: u32) -> GridDims {
        let block = block.max(1);
        let blocks = threads
            .div_ceil(u64::from(block))
            .clamp(1, u64::from(u32::MAX));
        GridDims {
            grid: [blocks as u32, 1, 1],
            block: [block, 1, 1],
            shared_mem_bytes: 0,
        }
    }
}

/// Picks launch dimensions from `(input shapes, output shapes, scalar arguments)`.
pub type DimsFn = dyn Fn(&[&[u64]], &[&[u64]], &[i64]) -> GridDims + Send + Sync;

/// One registered kernel.
#[derive(Clone)]
pub(super) struct KernelDef {
    pub name: String,
    pub image: Arc<[u8]>,
    pub function: String,
    pub dims: Arc<DimsFn>,
}

/// Kernels for `call_kernel`, by name.
#[derive(Clone, Default)]
pub struct CudaKernels {
    pub(super) defs: Vec<KernelDef>,
}

impl fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.defs.iter().map(|d| d.name.as_str()).collect();
        f.debug_struct("CudaKernels")
            .field("names", &names)
            .finish()
    }
}

impl CudaKernels {
    /// No kernels.
    pub fn new() -> CudaKernels {
        CudaKernels::default()
    }

    /// Registers (or replaces) the kernel called `name`: function `function` of `image` (PTX
    /// text or a CUBIN), launched with the dimensions `dims` returns. The image is loaded on
    /// each device at its first launch. The embedder vouches that the kernel stays inside the
    /// buffers it is given.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        image: impl Into<Vec<u8>>,
        function: impl Into<String>,
        dims: impl Fn(&[&[u64]], &[&[u64]], &[i64]) -> GridDims + Send + Sync + 'static,
    ) {
        let def = KernelDef {
            name: name.into(),
            image: image.into().into(),
            function: function.into(),
            dims: Arc::new(dims),
        };
        match self.defs.iter().position(|d| d.name == def.name) {
            Some(i) => self.defs[i] = def,
            None => self.defs.push(def),
        }
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.defs.iter().map(|d| d.name.as_str())
    }
}
