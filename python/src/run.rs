//! `Program.run`: seeded random inputs, a sharded run on every rank, the unsharded reference
//! and a per-output comparison, as a `RunResult`.
//!
//! The CPU run goes through the public embed API (`CpuJob`, `Executor`, `Bindings`), one thread
//! per rank, as an embedder would; the inputs, reference and comparison are the runtime's.

use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::reference::evaluate;
use meshflow::{Bindings, Compiled, CpuConfig, CpuJob, Executor, TensorData};

use crate::data::to_numpy;
use crate::errors::{error, ExecutionError};
use crate::program::HostProgram;

/// What `Program.run` gives: whether every output matched the reference (`ok`), the relative
/// error of each output, and the inputs, outputs and reference outputs as numpy arrays (full,
/// unsharded).
#[pyclass(module = "meshflow", name = "RunResult", frozen, get_all)]
pub struct RunResult {
    /// True when every output is within its tolerance (integers: bit-identical).
    pub ok: bool,
    /// `ok y: rel err 1.2e-07 (tol 1e-05)` (or `mismatch ...`), one line.
    pub summary: String,
    /// Relative error `||run - reference|| / ||reference||` per output.
    pub errors: BTreeMap<String, f64>,
    /// The tolerance applied per output (1e-5 f32, 1e-2 bf16/f16, 0 integers).
    pub tolerances: BTreeMap<String, f64>,
    /// The run's outputs, gathered: `{name: ndarray}`.
    pub outputs: Py<PyDict>,
    /// The reference's outputs: `{name: ndarray}`.
    pub reference: Py<PyDict>,
    /// The random inputs: `{name: ndarray}`.
    pub inputs: Py<PyDict>,
    /// The host program that ran.
    pub host: Py<HostProgram>,
    /// `"cpu"` or `"cuda"`.
    pub backend: String,
    /// The number of ranks.
    pub ranks: usize,
}

#[pymethods]
impl RunResult {
    fn __bool__(&self) -> bool {
        self.ok
    }

    fn __repr__(&self) -> String {
        format!(
            "<meshflow.RunResult {} ranks on {}: {}>",
            self.ranks, self.backend, self.summary
        )
    }
}

fn failed(e: impl std::fmt::Display) -> PyErr {
    ExecutionError::new_err(e.to_string())
}

/// Runs `compiled` (lowered from `program`) on `backend` with inputs drawn from `seed`.
pub fn run(
    py: Python<'_>,
    program: &meshflow::ir::Program,
    compiled: Compiled,
    backend: &str,
    seed: u64,
) -> PyResult<RunResult> {
    let inputs = random_inputs(program, seed).map_err(failed)?;
    let got = match backend {
        "cpu" => py.detach(|| run_cpu(&compiled, &inputs))?,
        "cuda" => py.detach(|| run_cuda(&compiled, &inputs))?,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown backend `{other}` (expected cpu or cuda)"
            )))
        }
    };
    let want = py.detach(|| evaluate(program, &inputs)).map_err(failed)?;
    let cmp = compare_outputs(program, &got, &want).map_err(failed)?;
    let dict = |m: &BTreeMap<String, TensorData>| -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in m {
            d.set_item(k, to_numpy(py, v)?)?;
        }
        Ok(d.unbind())
    };
    Ok(RunResult {
        ok: cmp.passed(),
        summary: cmp.to_string(),
        errors: cmp
            .outputs
            .iter()
            .map(|o| (o.name.clone(), o.error))
            .collect(),
        tolerances: (cmp.outputs.iter())
            .map(|o| (o.name.clone(), o.tolerance))
            .collect(),
        outputs: dict(&got)?,
        reference: dict(&want)?,
        inputs: dict(&inputs)?,
        ranks: compiled.world_size(),
        host: Py::new(py, HostProgram::new(compiled))?,
        backend: backend.into(),
    })
}

/// Every rank on the CPU backend, one thread and one `Executor` each; returns the gathered
/// outputs.
fn run_cpu(
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
) -> PyResult<BTreeMap<String, TensorData>> {
    let job = CpuJob::for_program(compiled, CpuConfig::default());
    let parts = inputs
        .iter()
        .map(|(name, full)| Ok((name.as_str(), compiled.scatter(name, full)?)))
        .collect::<Result<Vec<_>, meshflow::Error>>()
        .map_err(error)?;
    let results: Vec<Result<BTreeMap<String, TensorData>, meshflow::Error>> =
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..job.world_size())
                .map(|rank| {
                    let (job, parts) = (&job, &parts);
                    s.spawn(move || {
                        let mut exec = Executor::new(compiled, rank, job.backend(rank)?)?;
                        let mut bindings = Bindings::new();
                        for (name, per_rank) in parts {
                            if let Some(local) = per_rank.get(&rank) {
                                bindings.input(*name, local);
                            }
                        }
                        exec.run(&mut bindings)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
    let mut per_output: BTreeMap<String, BTreeMap<usize, TensorData>> = BTreeMap::new();
    let mut first_error = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(outs) => {
                for (name, t) in outs {
                    per_output.entry(name).or_default().insert(rank, t);
                }
            }
            // The rank that failed first explains the run; the others report its abort.
            Err(e) => {
                let abort = matches!(&e, meshflow::Error::Runtime(r) if r.is_abort());
                if first_error.as_ref().is_none_or(|(a, _)| *a && !abort) {
                    first_error = Some((abort, e));
                }
            }
        }
    }
    if let Some((_, e)) = first_error {
        return Err(error(e));
    }
    compiled
        .outputs()
        .into_iter()
        .map(|o| {
            let locals = per_output.remove(&o.name).unwrap_or_default();
            Ok((o.name.clone(), compiled.gather(&o.name, &locals)?))
        })
        .collect::<Result<_, meshflow::Error>>()
        .map_err(error)
}

/// The GPU model a run on `"cuda"` executes on, or the one `MESHFLOW_GPU_MODEL` names
/// (`meshflow::pipeline::target_gpu_model`; `None` where no GPU answers: the run then says why
/// it cannot start).
#[cfg(feature = "cuda")]
pub fn gpu_model() -> Option<String> {
    meshflow::pipeline::target_gpu_model().ok()
}

/// Without CUDA there is no GPU model (a run on `"cuda"` is refused).
#[cfg(not(feature = "cuda"))]
pub fn gpu_model() -> Option<String> {
    None
}

/// Every rank on its own GPU of this process (feature `cuda`).
#[cfg(feature = "cuda")]
fn run_cuda(
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
) -> PyResult<BTreeMap<String, TensorData>> {
    use meshflow::runtime::cuda::{run_program_cuda, CudaOptions};
    let program = compiled
        .program()
        .ok_or_else(|| failed("the lowered level-1 program is missing"))?;
    let ranks = compiled.world_size();
    let options = CudaOptions {
        ranks: Some(ranks),
        config: meshflow::CudaConfig::default(),
    };
    let run = run_program_cuda(program, compiled.host(), inputs, ranks, &options, None)
        .map_err(|e| crate::errors::DeviceError::new_err(e.to_string()))?;
    run.outputs
        .ok_or_else(|| failed("the GPU run returned no outputs"))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _: &Compiled,
    _: &BTreeMap<String, TensorData>,
) -> PyResult<BTreeMap<String, TensorData>> {
    Err(PyValueError::new_err(
        "this meshflow build has no CUDA backend (build the wheel with --features cuda)",
    ))
}
