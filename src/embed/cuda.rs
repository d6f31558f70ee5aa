//! The CUDA backend for embedders (feature `cuda`): [`CudaJob`] (the ranks of one job),
//! caller-owned device tensors ([`CudaTensor`]) and the caller's stream and communicators
//! ([`CudaResources`]).
//!
//! The raw handles an embedder holds (a `CUstream`, a device address, an `ncclComm_t`) are
//! wrapped with the raw-handle constructors of the kernels crate (the caller vouches for
//! the handle) —
//! [`Stream::from_raw_borrowed`](meshflow_kernels::Stream::from_raw_borrowed),
//! [`DeviceBuffer::from_raw_borrowed`] and
//! [`Comm::from_raw_borrowed`](meshflow_kernels::nccl::Comm::from_raw_borrowed) — where the
//! embedder vouches for their lifetime; from there on everything is safe. Nothing borrowed is
//! freed, destroyed, aborted or cached by meshflow. The caller's context must be the device's
//! primary context (the one the CUDA runtime and PyTorch use).

use std::sync::Arc;

use meshflow_ir::{DType, DeviceId};
use meshflow_kernels::{Device, DeviceBuffer};

use super::{Bind, Bindings, Compiled, Error};
use crate::front::agree::{check_same_program, ProgramFingerprint};
use crate::runtime::backend::{Backend, BackendError};
use crate::runtime::cuda::{AbortSignal, CudaBackend, CudaBuffer, CudaConfig, CudaResources};
use crate::runtime::rendezvous::{LocalRendezvous, Rendezvous};

/// A caller-owned device tensor: its memory (used in place, never copied or freed), element
/// type and shape (row-major, contiguous).
#[derive(Clone, Debug)]
pub struct CudaTensor {
    /// The memory (e.g. from [`DeviceBuffer::from_raw_borrowed`]).
    pub buffer: DeviceBuffer,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
}

impl Bind for CudaBackend {
    type Tensor<'a> = CudaTensor;

    fn tensor_type(tensor: &CudaTensor) -> (DType, Vec<u64>) {
        (tensor.dtype, tensor.shape.clone())
    }

    fn attach(
        &mut self,
        tensor: &mut CudaTensor,
        _output: bool,
    ) -> Result<CudaBuffer, BackendError> {
        let numel: u64 = tensor.shape.iter().product();
        let bytes = numel
            .checked_mul(tensor.dtype.size_bytes() as u64)
            .ok_or_else(|| BackendError::Invalid(format!("{:?} is too large", tensor.shape)))?;
        if bytes != tensor.buffer.len() as u64 {
            return Err(BackendError::Invalid(format!(
                "{}{:?} needs {bytes} bytes, the buffer has {}",
                tensor.dtype,
                tensor.shape,
                tensor.buffer.len()
            )));
        }
        self.import(tensor.buffer.clone(), tensor.dtype)
    }

    fn detach(
        &mut self,
        buffer: CudaBuffer,
        _tensor: &mut CudaTensor,
        _check_written: bool,
    ) -> Result<(), BackendError> {
        self.deallocate(buffer)
    }

    fn abort_job(&mut self, reason: &str) {
        self.signal_failure(reason);
    }

    fn records_graphs(&self) -> bool {
        CudaBackend::records_graphs(self)
    }
}

impl Bindings<'_, CudaBackend> {
    /// Binds a caller-owned device tensor (an input read, or an output written, in place).
    pub fn device(&mut self, name: impl Into<String>, tensor: CudaTensor) -> &mut Self {
        self.bind(name, tensor)
    }
}

/// The ranks of one job on GPUs, as seen from one process: the backend settings (kernels for
/// `call_kernel` included), an abort signal the ranks of this process share, and the
/// rendezvous that creates the communicators the caller does not hand in.
#[derive(Debug, Clone)]
pub struct CudaJob {
    world_size: usize,
    config: CudaConfig,
    abort: AbortSignal,
    rendezvous: Arc<dyn Rendezvous>,
    /// The program's fingerprint, checked against rank 0's when a rank's backend is made
    /// (jobs made for a program whose ranks may live in other processes).
    program: Option<ProgramFingerprint>,
}

impl CudaJob {
    /// A job of `world_size` ranks whose ranks all live in this process (one thread per GPU):
    /// communicators the caller does not hand in are created through an in-process rendezvous.
    pub fn new(world_size: usize, config: CudaConfig) -> CudaJob {
        let rendezvous: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("meshflow-embed"));
        CudaJob::with_rendezvous(world_size, config, rendezvous)
    }

    /// A job whose ranks may live in other processes, meeting through `rendezvous` (e.g. a
    /// TCP store) to create the communicators the caller does not hand in.
    pub fn with_rendezvous(
        world_size: usize,
        config: CudaConfig,
        rendezvous: Arc<dyn Rendezvous>,
    ) -> CudaJob {
        CudaJob {
            world_size,
            config,
            abort: AbortSignal::new(),
            rendezvous,
            program: None,
        }
    }

    /// A job with as many ranks as `compiled` runs on, all in this process, with the run
    /// settings of its options ([`Options::graph`](super::Options::graph),
    /// [`Options::wire`](super::Options::wire)) applied to `config`, and NCCL forced where the
    /// plans assume it ([`Compiled::transport`]) unless `config` forces a transport already.
    pub fn for_program(compiled: &Compiled, config: CudaConfig) -> CudaJob {
        let rendezvous: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("meshflow-embed"));
        CudaJob::for_program_with_rendezvous(compiled, config, rendezvous)
    }

    /// [`CudaJob::for_program`] for ranks that may live in other processes (e.g. one per GPU
    /// under torchrun), meeting through `rendezvous`. When it spans processes, making a rank's
    /// backend ([`CudaJob::backend`]) checks that the rank lowered the same host program as
    /// rank 0 ([`check_same_program`](crate::front::agree::check_same_program)): a rank whose
    /// program differs (another machine profile: see
    /// [`Options::agree_profile`](super::Options::agree_profile); other options) fails with
    /// [`Error::Agreement`] naming both ranks, and the other ranks stop at their next wait at
    /// the rendezvous, instead of hanging at a communication that never matches.
    pub fn for_program_with_rendezvous(
        compiled: &Compiled,
        mut config: CudaConfig,
        rendezvous: Arc<dyn Rendezvous>,
    ) -> CudaJob {
        if compiled.transport() == Some(meshflow_passes::Transport::Nccl) {
            config
                .transport
                .get_or_insert(meshflow_passes::Transport::Nccl);
        }
        config.graph |= compiled.records_graphs();
        if let Some(wire) = compiled.proxy_wire() {
            config.wire = wire;
        }
        let mut job = CudaJob::with_rendezvous(compiled.world_size(), config, rendezvous);
        job.program = Some(ProgramFingerprint::of(compiled));
        job
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The backend of `rank` on the caller's resources: its GPU, stream and communicators.
    /// In a job made for a program over a rendezvous that spans processes
    /// ([`CudaJob::for_program_with_rendezvous`]), first checks that this rank lowered rank 0's
    /// host program ([`Error::Agreement`] when not; ranks other than 0 wait up to the
    /// configured timeout for rank 0's), once per rank and job: make each rank's backend once.
    pub fn backend(&self, rank: DeviceId, resources: CudaResources) -> Result<CudaBackend, Error> {
        self.check(rank)?;
        if let Some(program) = &self.program {
            if self.rendezvous.spans_processes() {
                check_same_program(
                    self.rendezvous.as_ref(),
                    rank,
                    self.world_size,
                    program,
                    self.config.timeout,
                )?;
            }
        }
        CudaBackend::with_resources(
            rank,
            resources,
            self.config.clone(),
            Some(self.rendezvous.clone()),
            Some(self.abort.clone()),
        )
        .map_err(|source| Error::Cuda { rank, source })
    }

    /// The backend of `rank` on GPU `ordinal` with meshflow's own stream and communicators.
    pub fn backend_on(&self, rank: DeviceId, ordinal: usize) -> Result<CudaBackend, Error> {
        let device = Device::new(ordinal).map_err(|e| Error::Cuda {
            rank,
            source: BackendError::Invalid(format!("GPU {ordinal}: {e}")),
        })?;
        self.backend(
            rank,
            CudaResources {
                device,
                stream: None,
                comms: Vec::new(),
            },
        )
    }

    /// The first rank of this process that failed and why, if one has.
    pub fn failure(&self) -> Option<(DeviceId, String)> {
        self.abort.first()
    }

    fn check(&self, rank: DeviceId) -> Result<(), Error> {
        if rank >= self.world_size {
            return Err(Error::Rank {
                rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }
}
