//! `CudaExecutor`: one rank of a host program on a GPU, ordered on torch's current stream, with
//! torch CUDA tensors bound in place through DLPack (feature `cuda`).
//!
//! The executor issues its work on a non-blocking stream of its own (its main stream), never on
//! the caller's: torch's current stream is often the legacy default stream, which cannot be
//! captured into a CUDA graph (`cuStreamBeginCapture` fails with
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`). Each run forks the main stream from the caller's
//! (an event recorded there, waited for on the main stream) and joins it back at the end (the
//! reverse), so the run is ordered after the caller's earlier work and before its later work.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::kernels::python::{torch_stream, DlpackTensor};
use meshflow::kernels::{Device, Stream};
use meshflow::{Bindings, CudaBackend, CudaConfig, CudaJob, CudaResources, CudaTensor, Executor};

use crate::data::to_numpy;
use crate::errors::{device_error, error, BindingError};
use crate::program::HostProgram;
use crate::store::rendezvous;

/// The program's element type of a DLPack tensor, if it has one.
pub fn ir_dtype(t: &DlpackTensor) -> Option<meshflow::ir::DType> {
    use meshflow::ir::DType as D;
    use meshflow::kernels::DType as K;
    Some(match t.dtype.dtype()? {
        K::F32 => D::F32,
        K::BF16 => D::BF16,
        K::F16 => D::F16,
        K::I32 => D::I32,
        K::I64 => D::I64,
        _ => return None,
    })
}

/// The `cuda_stream` handle of a torch stream (to tell streams apart).
pub fn stream_handle(stream: &Bound<'_, PyAny>) -> PyResult<u64> {
    stream.getattr("cuda_stream")?.extract()
}

/// One rank of a host program on one GPU. Its work runs on a stream of its own (see the module
/// docs), forked from and joined back into the torch stream current at each run. Not shared
/// between threads.
#[pyclass(module = "meshflow", name = "CudaExecutor", unsendable)]
pub struct CudaExecutor {
    exec: Executor<'static, CudaBackend>,
    device: Device,
    main: Stream,
    rank: usize,
}

#[pymethods]
impl CudaExecutor {
    /// The executor of `rank` of `host` on GPU `device`; the ranks meet through `store` (see
    /// `meshflow.torch.Executor`).
    #[new]
    #[pyo3(signature = (host, rank, device, store, namespace, timeout = 120.0))]
    fn new(
        host: &HostProgram,
        rank: usize,
        device: usize,
        store: &Bound<'_, PyAny>,
        namespace: &str,
        timeout: f64,
    ) -> PyResult<CudaExecutor> {
        let compiled = host.forever();
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("timeout: {e}")))?;
        let device = Device::new(device).map_err(device_error)?;
        let main = Stream::new(&device).map_err(device_error)?;
        let config = CudaConfig {
            timeout,
            ..CudaConfig::default()
        };
        let job = CudaJob::for_program_with_rendezvous(
            compiled,
            config,
            rendezvous(store, namespace, timeout)?,
        );
        let resources = CudaResources {
            device: device.clone(),
            stream: Some(main.clone()),
            comms: Vec::new(),
        };
        let backend = job.backend(rank, resources).map_err(error)?;
        let exec = Executor::new(compiled, rank, backend).map_err(error)?;
        Ok(CudaExecutor {
            exec,
            device,
            main,
            rank,
        })
    }

    /// The rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The GPU ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device.ordinal()
    }

    /// Whether every run records its step as a CUDA graph and replays it (`graph=True`).
    #[getter]
    fn records_graphs(&self) -> bool {
        self.exec.compiled().records_graphs() || self.exec.backend().records_graphs()
    }

    /// Device time of the last run in microseconds, from meshflow's events around it.
    #[getter]
    fn last_run_us(&self) -> Option<f64> {
        self.exec.backend().last_run_us()
    }

    /// Runs one step: `bindings` maps input and output names to DLPack capsules of CUDA
    /// tensors on this GPU (inputs read, outputs written in place); `stream` is the torch
    /// stream current at the call (possibly the legacy default stream): the run is ordered
    /// after its earlier work, and its later work after the run. Returns the outputs this rank
    /// holds that were not bound (as numpy arrays). Returns when this rank's work is complete.
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        bindings: &Bound<'py, PyDict>,
        stream: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let caller = torch_stream(stream, &self.device).map_err(device_error)?;
        let mut b = Bindings::new();
        for (name, capsule) in bindings.iter() {
            let name: String = name.extract()?;
            let t = DlpackTensor::from_capsule(&capsule, &self.device)
                .map_err(|e| BindingError::new_err(format!("`{name}`: {e}")))?;
            let dtype = ir_dtype(&t).ok_or_else(|| {
                BindingError::new_err(format!(
                    "`{name}`: element type {:?} is not one of f32, bf16, f16, i32, i64",
                    t.dtype
                ))
            })?;
            b.device(
                name,
                CudaTensor {
                    buffer: t.buffer,
                    dtype,
                    shape: t.shape,
                },
            );
        }
        // Fork: the run's work waits for the caller's earlier work (on the bound tensors too).
        self.main.join(&caller).map_err(device_error)?;
        let run = self.exec.run(&mut b).map_err(error);
        // Join: the caller's later work waits for the run's, even for a run that failed after
        // enqueueing some of it.
        let joined = caller.join(&self.main).map_err(device_error);
        let outs = run?;
        joined?;
        let result = PyDict::new(py);
        for (name, t) in &outs {
            result.set_item(name, to_numpy(py, t)?)?;
        }
        Ok(result)
    }

    fn __repr__(&self) -> String {
        format!(
            "<meshflow.CudaExecutor rank {} on GPU {}>",
            self.rank,
            self.device.ordinal()
        )
    }
}
