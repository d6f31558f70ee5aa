//! meshflow-kernels: meshflow's only crate with `unsafe` code and FFI. It knows nothing of the IR.
//!
//! With the `cuda` feature it wraps, behind a safe API:
//! - the CUDA driver through [cudarc](https://docs.rs/cudarc) (dynamically loaded): [`Device`]
//!   (primary context, peer access), [`Stream`], pooled [`Event`]s (ordering and timing),
//!   [`DeviceBuffer`] (allocations and zero-copy byte views; host, device and peer copies;
//!   sharing with other processes over CUDA IPC, [`IpcHandle`]), [`DeviceFlag`] (stream-ordered
//!   signals in device memory, also in a peer's);
//! - cuBLAS GEMMs with row-major semantics and f32 accumulation: [`Gemm`];
//! - CUDA C kernels in `kernels/cuda/*.cu`, compiled by NVRTC for the device's architecture and
//!   cached: [`Kernels`] (elementwise add/sub/mul, gelu/silu, casts, strided copy / permute,
//!   sum over an axis, fill);
//! - NCCL through checked-in bindgen bindings loaded with libloading: [`nccl`];
//! - MoE expert-parallel dispatch / combine over NCCL or NVLink peer memory: [`moe`] (its shape,
//!   status, traffic accounting and CPU reference exist without the `cuda` feature too), with
//!   FP8 (E4M3) dispatch ([`fp8`], pure Rust);
//! - the inter-node host proxy ([`proxy`]): one-sided writes with immediates over TCP, or over
//!   ibverbs RC queue pairs with the `rdma` feature. It needs no CUDA and exists in every build;
//! - with the `python` feature, the Python objects that carry raw CUDA handles: DLPack capsules
//!   of device tensors (borrowed in place, or exported) and torch streams (`python`), for the
//!   repository's Python package.
//!
//! Every library is loaded at run time, so the `cuda` build compiles anywhere; a missing driver,
//! GPU or library is a [`KernelError`] value, never a panic. Without the `cuda` feature only the
//! plain types ([`DType`], [`ReduceOp`], [`BinaryOp`], [`UnaryOp`], [`KernelError`]) exist.
//!
//! Device work is asynchronous and ordered per stream. Buffers are plain device memory: the caller
//! orders work across streams with events and keeps buffers alive until work using them is done.
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> Result<(), meshflow_kernels::KernelError> {
//! use meshflow_kernels::{nccl, BinaryOp, DType, Device, DeviceBuffer, Gemm, ReduceOp, Stream};
//!
//! let dev = Device::new(0)?;
//! let stream = Stream::new(&dev)?;
//! let a = DeviceBuffer::from_slice(&stream, &[1.0f32; 1024])?;
//! let b = DeviceBuffer::from_slice(&stream, &[2.0f32; 1024])?;
//! let c = DeviceBuffer::alloc_elems(&dev, DType::F32, 1024)?;
//! dev.kernels().binary(&stream, BinaryOp::Add, DType::F32, &a, &b, &c)?;
//! // C[32,32] = A[32,32] @ B[32,32]^T, on the same stream.
//! Gemm::linear(32, 32, 32, DType::F32).run(&stream, &a, &b, &c)?;
//! assert_eq!(c.to_vec::<f32>(&stream)?.len(), 1024);
//!
//! // NCCL over two GPUs of this process.
//! let lib = nccl::NcclLib::load()?;
//! let devs = [Device::new(0)?, Device::new(1)?];
//! let comms = nccl::Comm::init_all(&lib, &devs)?;
//! let streams = [Stream::new(&devs[0])?, Stream::new(&devs[1])?];
//! let bufs = [DeviceBuffer::alloc(&devs[0], 4096)?, DeviceBuffer::alloc(&devs[1], 4096)?];
//! nccl::group(&lib, || {
//!     for i in 0..2 {
//!         comms[i].all_reduce(&bufs[i], &bufs[i], DType::F32, ReduceOp::Sum, &streams[i])?;
//!     }
//!     Ok(())
//! })?;
//! nccl::teardown(comms)?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```

#![deny(missing_docs)]
// The crate docs link the CUDA types, which exist only with the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

pub mod dlpack;
mod dtype;
mod error;
pub mod fp8;

pub use dtype::{BinaryOp, DType, Element, ReduceOp, UnaryOp};
pub use error::{KernelError, Result};

#[cfg(feature = "cuda")]
mod abort;
#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod event;
#[cfg(feature = "cuda")]
mod flag;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod ipc;
#[cfg(feature = "cuda")]
mod kernels;
pub mod moe;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod probe;
pub mod proxy;
#[cfg(feature = "python")]
pub mod python;
#[cfg(feature = "cuda")]
mod stream;

#[cfg(feature = "cuda")]
pub use abort::AbortWord;
#[cfg(feature = "cuda")]
pub use buffer::DeviceBuffer;
#[cfg(feature = "cuda")]
pub use device::Device;
#[cfg(feature = "cuda")]
pub use event::Event;
#[cfg(feature = "cuda")]
pub use flag::DeviceFlag;
#[cfg(feature = "cuda")]
pub use gemm::{Gemm, GemmLayout};
#[cfg(feature = "cuda")]
pub use graph::Graph;
#[cfg(feature = "cuda")]
pub use ipc::{IpcExport, IpcHandle, IPC_HANDLE_BYTES};
#[cfg(feature = "cuda")]
pub use kernels::{
    fill_pattern, poison_bits, AxisView, KernelArg, Kernels, RowReduce, Source, StridedLayout,
    UserKernel, MAX_RANK,
};
#[cfg(feature = "cuda")]
pub use stream::Stream;
