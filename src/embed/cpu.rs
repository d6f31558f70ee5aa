//! The CPU backend for embedders: [`CpuJob`] (the ranks of one job in one process) and
//! [`CpuTensor`] (caller-owned host tensors).

use std::sync::Arc;

use meshflow_ir::{DType, DeviceId};

use super::{Bind, Bindings, Compiled, Error};
use crate::runtime::backend::{Backend, BackendError};
use crate::runtime::cpu::{CpuBackend, CpuBuffer, CpuConfig, Fabric};
use crate::runtime::data::TensorData;

/// A caller-owned host tensor bound to a CPU run.
#[derive(Debug)]
pub enum CpuTensor<'a> {
    /// Read only: an input, copied in at the start of the run.
    Shared(&'a TensorData),
    /// Lent mutably: used in place, without a copy. An output is written into it; an input
    /// is read from it (and left unchanged).
    Mut(&'a mut TensorData),
}

impl Bind for CpuBackend {
    type Tensor<'a> = CpuTensor<'a>;

    fn tensor_type(tensor: &CpuTensor<'_>) -> (DType, Vec<u64>) {
        let t: &TensorData = match tensor {
            CpuTensor::Shared(t) => t,
            CpuTensor::Mut(t) => t,
        };
        (t.dtype(), t.shape().to_vec())
    }

    fn attach(
        &mut self,
        tensor: &mut CpuTensor<'_>,
        output: bool,
    ) -> Result<CpuBuffer, BackendError> {
        match tensor {
            CpuTensor::Shared(_) if output => Err(BackendError::Invalid(
                "an output must be bound mutably (`Bindings::output`)".into(),
            )),
            CpuTensor::Shared(data) => {
                let buffer = self.allocate(data.dtype(), data.shape())?;
                self.upload(buffer, data)?;
                Ok(buffer)
            }
            CpuTensor::Mut(data) => self.import(data, !output),
        }
    }

    fn detach(
        &mut self,
        buffer: CpuBuffer,
        tensor: &mut CpuTensor<'_>,
        check_written: bool,
    ) -> Result<(), BackendError> {
        match tensor {
            CpuTensor::Shared(_) => self.deallocate(buffer),
            CpuTensor::Mut(data) => self.export(buffer, data, check_written),
        }
    }

    fn abort_job(&mut self, reason: &str) {
        self.fabric().fail(self.device(), reason.to_string());
    }
}

impl<'a> Bindings<'a, CpuBackend> {
    /// Binds an input, read only (copied in at the start of each run).
    pub fn input(&mut self, name: impl Into<String>, data: &'a TensorData) -> &mut Self {
        self.bind(name, CpuTensor::Shared(data))
    }

    /// Binds an output (written in place, no copy), or an input to be read without a copy.
    pub fn output(&mut self, name: impl Into<String>, data: &'a mut TensorData) -> &mut Self {
        self.bind(name, CpuTensor::Mut(data))
    }
}

/// The ranks of one job on the CPU backend, in one process: they share a [`Fabric`] (the
/// mailboxes their communications go through), so each rank's backend must come from the
/// same job. Run one [`Executor`](super::Executor) per rank on its own thread.
///
/// When a rank fails, the job is aborted: the other ranks stop at their next communication
/// with an error naming the failed rank, and every later run of the job fails the same way.
/// Start a new job to go on.
#[derive(Debug, Clone)]
pub struct CpuJob {
    world_size: usize,
    fabric: Arc<Fabric>,
    config: CpuConfig,
}

impl CpuJob {
    /// A job of `world_size` ranks with backend settings `config` (stream pool, receive
    /// timeout, race checking, kernels for `call_kernel`).
    pub fn new(world_size: usize, config: CpuConfig) -> CpuJob {
        CpuJob {
            world_size,
            fabric: Arc::new(Fabric::new()),
            config,
        }
    }

    /// A job with as many ranks as `compiled` runs on.
    pub fn for_program(compiled: &Compiled, config: CpuConfig) -> CpuJob {
        CpuJob::new(compiled.world_size(), config)
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The backend settings.
    pub fn config(&self) -> &CpuConfig {
        &self.config
    }

    /// The backend of `rank`.
    pub fn backend(&self, rank: DeviceId) -> Result<CpuBackend, Error> {
        if rank >= self.world_size {
            return Err(Error::Rank {
                rank,
                world_size: self.world_size,
            });
        }
        Ok(CpuBackend::new(rank, self.fabric.clone(), &self.config))
    }

    /// The first rank that failed and why, if one has.
    pub fn failure(&self) -> Option<(DeviceId, String)> {
        self.fabric.failure().map(|f| (f.rank, f.reason))
    }
}
