//! The CPU backend for Python callers: `CpuJob` (the ranks of one job in this process) and
//! `CpuExecutor` (one rank, on numpy arrays). Run each rank's executor on its own Python
//! thread: `run` releases the GIL while the rank runs.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::ir::host::Role;
use meshflow::{Bindings, Compiled, CpuBackend, CpuConfig, Executor, TensorData};

use crate::data::{from_numpy, to_numpy};
use crate::errors::{error, BindingError, ExecutionError};
use crate::program::HostProgram;

/// The ranks of one job on the CPU backend, in this process: they exchange data in memory, so
/// every rank's executor must come from the same job. When a rank fails the job is aborted and
/// the others stop at their next communication; make a new job to go on.
#[pyclass(module = "meshflow", name = "CpuJob", frozen)]
pub struct CpuJob {
    job: meshflow::CpuJob,
}

#[pymethods]
impl CpuJob {
    /// A job of `world_size` ranks; a rank waits `timeout` seconds for a peer before failing.
    #[new]
    #[pyo3(signature = (world_size, timeout = 30.0))]
    fn new(world_size: usize, timeout: f64) -> PyResult<CpuJob> {
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("timeout: {e}")))?;
        let config = CpuConfig {
            timeout,
            ..CpuConfig::default()
        };
        Ok(CpuJob {
            job: meshflow::CpuJob::new(world_size, config),
        })
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.job.world_size()
    }

    /// The first rank that failed and why, if one has: `(rank, reason)`.
    #[getter]
    fn failure(&self) -> Option<(usize, String)> {
        self.job.failure()
    }

    fn __repr__(&self) -> String {
        format!("<meshflow.CpuJob of {} ranks>", self.job.world_size())
    }
}

/// One rank of a host program on the CPU backend, with the caller's numpy arrays.
#[pyclass(module = "meshflow", name = "CpuExecutor", frozen)]
pub struct CpuExecutor {
    compiled: &'static Compiled,
    rank: usize,
    /// Set up once and reused by every step (its communication sequence goes on).
    exec: Mutex<Executor<'static, CpuBackend>>,
}

#[pymethods]
impl CpuExecutor {
    /// The executor of `rank` of `host` in `job` (whose size must be the program's).
    #[new]
    fn new(host: &HostProgram, rank: usize, job: &CpuJob) -> PyResult<CpuExecutor> {
        let compiled = host.forever();
        if job.job.world_size() != compiled.world_size() {
            return Err(ExecutionError::new_err(format!(
                "the job has {} ranks, the host program runs on {}",
                job.job.world_size(),
                compiled.world_size()
            )));
        }
        if rank >= compiled.world_size() {
            return Err(error(meshflow::Error::Rank {
                rank,
                world_size: compiled.world_size(),
            }));
        }
        let backend = job.job.backend(rank).map_err(error)?;
        let exec = Executor::new(compiled, rank, backend).map_err(error)?;
        Ok(CpuExecutor {
            compiled,
            rank,
            exec: Mutex::new(exec),
        })
    }

    /// The rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Runs one step of this rank: `bindings` maps the names of inputs (read) and outputs
    /// (`numpy.ndarray`s, written in place) to this rank's local arrays; every input this rank
    /// holds must be bound. Returns the outputs this rank holds that were not bound, as numpy
    /// arrays. Every rank of the job must run the same number of steps.
    fn run<'py>(
        &self,
        py: Python<'py>,
        bindings: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut ins: BTreeMap<String, TensorData> = BTreeMap::new();
        let mut outs: BTreeMap<String, (Bound<'py, PyAny>, TensorData)> = BTreeMap::new();
        for (name, value) in bindings.iter() {
            let name: String = name.extract()?;
            let info = self
                .compiled
                .tensor(&name)
                .ok_or_else(|| self.unknown(&name))?;
            let data = from_numpy(&value, info.dtype, &name)?;
            if info.role == Role::Input {
                ins.insert(name, data);
            } else {
                outs.insert(name, (value, data));
            }
        }
        let mut out_data: BTreeMap<String, TensorData> = outs
            .iter()
            .map(|(k, (_, d))| (k.clone(), d.clone()))
            .collect();
        let unbound = py
            .detach(|| {
                let mut exec = self.exec.lock().unwrap_or_else(|p| p.into_inner());
                let mut bindings = Bindings::new();
                for (name, data) in &ins {
                    bindings.input(name.clone(), data);
                }
                for (name, data) in out_data.iter_mut() {
                    bindings.output(name.clone(), data);
                }
                exec.run(&mut bindings)
            })
            .map_err(error)?;
        let np = py.import("numpy")?;
        for (name, (array, _)) in &outs {
            let written = to_numpy(py, &out_data[name])?;
            np.call_method1("copyto", (array, written))
                .map_err(|e| BindingError::new_err(format!("writing `{name}` back: {e}")))?;
        }
        let result = PyDict::new(py);
        for (name, t) in &unbound {
            result.set_item(name, to_numpy(py, t)?)?;
        }
        Ok(result)
    }

    fn __repr__(&self) -> String {
        format!(
            "<meshflow.CpuExecutor rank {} of {}>",
            self.rank,
            self.compiled.host().name
        )
    }
}

impl CpuExecutor {
    /// The error for a binding the program does not have (as the executor words it).
    fn unknown(&self, name: &str) -> PyErr {
        let known: Vec<String> = (self.compiled.inputs().into_iter())
            .chain(self.compiled.outputs())
            .map(|t| t.name)
            .collect();
        error(meshflow::Error::Binding {
            rank: self.rank,
            name: name.to_string(),
            message: format!(
                "the program has no input or output of that name (it has: {})",
                known.join(", ")
            ),
        })
    }
}
