//! `Program` (a level-1 program), `HostProgram` (what lowering produces, with the compiler's
//! reports) and `CheckReport`; `load` and `parse`.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::ir::host::Role;
use meshflow::{compile, Compiled, Options, Transport};

use crate::data::{from_numpy, to_numpy};
use crate::errors::error;
use crate::options::{from_kwargs, schedule_name};

/// A tensor of a program: name, element type, shape and the devices that hold it. For a
/// `HostProgram` the shape is the local (per-rank) one, what a binding must have.
#[pyclass(module = "meshflow", name = "TensorSpec", frozen, get_all)]
#[derive(Clone)]
pub struct TensorSpec {
    /// The name.
    pub name: String,
    /// The element type (`f32`, `bf16`, `f16`, `i32`, `i64`).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// `"input"` or `"output"`.
    pub role: String,
    /// The ranks that hold it (its mesh's devices).
    pub devices: Vec<usize>,
}

#[pymethods]
impl TensorSpec {
    fn __repr__(&self) -> String {
        format!(
            "TensorSpec({} {}: {}{:?} on {:?})",
            self.role, self.name, self.dtype, self.shape, self.devices
        )
    }
}

/// A level-1 (sharded) program: tensors on device meshes with their schedules, and ops. Made by
/// `meshflow.load`, `meshflow.parse` or `Builder.build`; `str(program)` is its text, which
/// parses back.
#[pyclass(module = "meshflow", name = "Program", frozen)]
pub struct Program {
    pub program: meshflow::ir::Program,
    /// The job size given to `load`/`parse` (the default of `lower`, `check` and `run`).
    pub ranks: Option<usize>,
}

impl Program {
    /// Lowers with the keyword options.
    pub fn compile(&self, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<(Compiled, Options)> {
        self.compile_on(kwargs, None)
    }

    /// Lowers with the keyword options for a run on GPUs of model `device` (plans priced with
    /// its built-in profile unless `profile` or `device` is given).
    fn compile_on(
        &self,
        kwargs: Option<&Bound<'_, PyDict>>,
        device: Option<&str>,
    ) -> PyResult<(Compiled, Options)> {
        let options = from_kwargs(kwargs, self.ranks, device)?;
        let compiled = compile(&self.program, &options).map_err(error)?;
        Ok((compiled, options))
    }
}

#[pymethods]
impl Program {
    /// The program's name.
    #[getter]
    fn name(&self) -> &str {
        &self.program.name
    }

    /// The program text (level 1), which `meshflow.parse` reads back.
    #[getter]
    fn text(&self) -> String {
        self.program.to_string()
    }

    /// The number of ranks the program's meshes span.
    #[getter]
    fn world_size(&self) -> usize {
        self.program.world_size()
    }

    /// The job size given to `load` or `parse`, if any.
    #[getter]
    fn ranks(&self) -> Option<usize> {
        self.ranks
    }

    /// The inputs, in declaration order, with their full (unsharded) shapes.
    #[getter]
    fn inputs(&self) -> Vec<TensorSpec> {
        let p = &self.program;
        p.inputs()
            .into_iter()
            .map(|t| self.spec(t, "input"))
            .collect()
    }

    /// The outputs, in program order, with their full (unsharded) shapes.
    #[getter]
    fn outputs(&self) -> Vec<TensorSpec> {
        let outs = self.program.outputs.clone();
        outs.into_iter().map(|t| self.spec(t, "output")).collect()
    }

    /// Lowers the program to a host program (every pass, then the cross-rank check unless
    /// `check=False`). Options: `ranks`, `streams`, `schedule` (`"auto"`, `"per-iteration"`,
    /// `"prefetch"`), `decompose` (`{tensor: "collective" | "broadcast" | "reduce" | "ring" |
    /// "ring_forward" | "ring_bidirectional"}`), `transport` (`"nccl"`, `"copy-engine"`,
    /// `"host-proxy"`, `"nvlink"`),
    /// `profile` (`"h200x2"`, `"h100x2"` or a JSON file; default: the built-in profile of
    /// `device`, the GPU model the program will run on as the driver names it, e.g.
    /// `torch.cuda.get_device_name()`; `h200x2` without either), `disable_passes`,
    /// `verify_each_pass`, `dump_after`, `check`, `graph` (GPU executors record every step as a
    /// CUDA graph and replay it).
    #[pyo3(signature = (**options))]
    fn lower(&self, options: Option<&Bound<'_, PyDict>>) -> PyResult<HostProgram> {
        let (compiled, _) = self.compile(options)?;
        Ok(HostProgram::new(compiled))
    }

    /// Lowers the program as rank `rank` of a job of `world_size` ranks whose processes each
    /// lower it themselves (torchrun; what `meshflow.torch.Executor` does for a `Program`):
    /// the ranks first agree on the machine profile through `store` (a torch `Store`, `"env"`
    /// or `"local"`; `namespace` names the job), as `meshflow run` under `meshflow launch`
    /// does, so that every rank lowers the same plans. Ranks whose GPU models differ take rank
    /// 0's profile (a warning on each rank that switches; `HostProgram.profile` says so); a
    /// `profile=` given to some ranks wins; ranks given different profiles all raise
    /// `ExecutionError` naming them. The GPU model is `device=` when given, else
    /// `MESHFLOW_GPU_MODEL`, else GPU 0's name (wheels built with CUDA). Every rank of the job
    /// must call it, in the same order as its executors. Waits up to `timeout` seconds for the
    /// other ranks. Options as `lower`.
    #[pyo3(signature = (rank, world_size, store, namespace, timeout = 120.0, **options))]
    #[allow(clippy::too_many_arguments)]
    fn lower_for_rank(
        &self,
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        store: &Bound<'_, PyAny>,
        namespace: &str,
        timeout: f64,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<HostProgram> {
        if rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not a rank of a job of {world_size}"
            )));
        }
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|e| PyValueError::new_err(format!("timeout: {e}")))?;
        let device = meshflow::pipeline::target_gpu_model().ok();
        let mut options = from_kwargs(options, self.ranks, device.as_deref())?;
        if world_size > 1 {
            let rendezvous = crate::store::rendezvous(store, namespace, timeout)?;
            // Without the GIL: a torch store is called from Python, maybe by the other ranks'
            // threads.
            options = py
                .detach(|| options.agree_profile(rendezvous.as_ref(), rank, world_size, timeout))
                .map_err(error)?;
        }
        let compiled = compile(&self.program, &options).map_err(error)?;
        Ok(HostProgram::new(compiled))
    }

    /// Lowers the program and runs the static cross-rank check on `ranks` ranks (default: the
    /// program's own size); returns the check's report or raises `CheckError`.
    #[pyo3(signature = (ranks = None, **options))]
    fn check(
        &self,
        py: Python<'_>,
        ranks: Option<usize>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<CheckReport> {
        let py_options = with_item(py, options, "ranks", ranks)?;
        let (compiled, _) = self.compile(py_options.as_ref())?;
        let report = match compiled.check_report() {
            Some(r) => r.clone(),
            None => meshflow::check::check_program(compiled.host(), compiled.world_size())
                .map_err(|e| error(meshflow::Error::Check(e)))?,
        };
        Ok(CheckReport { report })
    }

    /// Lowers the program, runs it on `ranks` ranks of `backend` with seeded random inputs and
    /// compares every output with the unsharded reference. Returns a `RunResult` (`.ok`,
    /// `.errors`, `.outputs` as numpy arrays). Backends: `"cpu"` (ranks as threads), and
    /// `"cuda"` in wheels built with CUDA (one GPU per rank, in this process; the plans are
    /// priced with the built-in profile of those GPUs unless `profile` is given).
    #[pyo3(signature = (backend = "cpu", ranks = None, seed = 0, **options))]
    fn run(
        &self,
        py: Python<'_>,
        backend: &str,
        ranks: Option<usize>,
        seed: u64,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<crate::run::RunResult> {
        let py_options = with_item(py, options, "ranks", ranks)?;
        let device = match backend {
            "cuda" => crate::run::gpu_model(),
            _ => None,
        };
        let (compiled, _) = self.compile_on(py_options.as_ref(), device.as_deref())?;
        crate::run::run(py, &self.program, compiled, backend, seed)
    }

    fn __str__(&self) -> String {
        self.text()
    }

    fn __repr__(&self) -> String {
        format!(
            "<meshflow.Program {} ({} tensors, {} ops, {} ranks)>",
            self.program.name,
            self.program.tensors.len(),
            self.program.ops.len(),
            self.program.world_size()
        )
    }
}

impl Program {
    fn spec(&self, t: meshflow::ir::TensorId, role: &str) -> TensorSpec {
        let d = &self.program.tensors[t];
        TensorSpec {
            name: d.name.clone(),
            dtype: d.ty.dtype.to_string(),
            shape: d.ty.value_shape(),
            role: role.into(),
            devices: self
                .program
                .meshes
                .get(d.mesh)
                .map(|m| m.mesh.devices().to_vec())
                .unwrap_or_default(),
        }
    }
}

/// `options` with `key` set to `value` (when given).
fn with_item<'py>(
    py: Python<'py>,
    options: Option<&Bound<'py, PyDict>>,
    key: &str,
    value: Option<usize>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(value) = value else {
        return Ok(options.cloned());
    };
    let d = match options {
        Some(o) => o.copy()?,
        None => PyDict::new(py),
    };
    d.set_item(key, value)?;
    Ok(Some(d))
}

/// The static cross-rank check's summary: communications per rank, teams, point-to-point
/// messages and coalesced groups (no mismatch, no deadlock).
#[pyclass(module = "meshflow", name = "CheckReport", frozen)]
pub struct CheckReport {
    pub report: meshflow::check::CheckReport,
}

#[pymethods]
impl CheckReport {
    /// The number of ranks checked.
    #[getter]
    fn world_size(&self) -> usize {
        self.report.world_size
    }

    /// Communications issued per rank.
    #[getter]
    fn events_per_rank(&self) -> Vec<usize> {
        self.report.events_per_rank.clone()
    }

    /// The teams that communicate (ranks in team order).
    #[getter]
    fn teams(&self) -> Vec<Vec<usize>> {
        self.report.teams.clone()
    }

    /// `send_recv` messages matched.
    #[getter]
    fn point_to_point(&self) -> usize {
        self.report.point_to_point
    }

    /// Coalescing groups issued, summed over ranks.
    #[getter]
    fn groups(&self) -> usize {
        self.report.groups
    }

    fn __str__(&self) -> String {
        self.report.to_string()
    }

    fn __repr__(&self) -> String {
        format!("<meshflow.CheckReport {}>", self.report)
    }
}

/// A host program: the rank-agnostic program every rank runs, with the compiler's reports. Made
/// by `Program.lower` or `HostProgram.from_text`; `str(host)` is its text (`.mfh`).
#[pyclass(module = "meshflow", name = "HostProgram", frozen)]
pub struct HostProgram {
    pub compiled: Arc<Compiled>,
    /// A copy that lives as long as the process, made when an executor first needs one (an
    /// `Executor` borrows its program, and a Python object cannot hold a borrow).
    forever: OnceLock<&'static Compiled>,
}

impl HostProgram {
    pub fn new(compiled: Compiled) -> HostProgram {
        HostProgram {
            compiled: Arc::new(compiled),
            forever: OnceLock::new(),
        }
    }

    /// The program, for as long as the process lives (see `forever`).
    pub fn forever(&self) -> &'static Compiled {
        self.forever
            .get_or_init(|| Box::leak(Box::new((*self.compiled).clone())))
    }

    fn specs(&self, infos: Vec<meshflow::TensorInfo>) -> Vec<TensorSpec> {
        infos
            .into_iter()
            .map(|t| TensorSpec {
                name: t.name,
                dtype: t.dtype.to_string(),
                shape: t.shape,
                role: match t.role {
                    Role::Input => "input",
                    _ => "output",
                }
                .into(),
                devices: t.devices,
            })
            .collect()
    }

    fn tensor_dtype(&self, name: &str) -> PyResult<meshflow::ir::DType> {
        self.compiled.tensor(name).map(|t| t.dtype).ok_or_else(|| {
            PyKeyError::new_err(format!("no input or output `{name}` in the program"))
        })
    }
}

#[pymethods]
impl HostProgram {
    /// Loads a host program from its text (as `str(host)` prints it): parses, verifies and,
    /// unless `check=False`, runs the cross-rank check on `ranks` ranks (default: the
    /// program's own size). The level-1 program is not known, so `scatter` and `gather` are
    /// not available.
    #[staticmethod]
    #[pyo3(signature = (text, ranks = None, check = true))]
    fn from_text(text: &str, ranks: Option<usize>, check: bool) -> PyResult<HostProgram> {
        let options = match ranks {
            Some(r) => Options::for_ranks(r),
            None => Options::new(),
        }
        .check(check);
        Ok(HostProgram::new(
            Compiled::from_host_text(text, &options).map_err(error)?,
        ))
    }

    /// The program's name.
    #[getter]
    fn name(&self) -> String {
        self.compiled.host().name.clone()
    }

    /// The host program's text, which `HostProgram.from_text` reads back.
    #[getter]
    fn text(&self) -> String {
        self.compiled.host_text()
    }

    /// The number of ranks of the job (one executor each).
    #[getter]
    fn world_size(&self) -> usize {
        self.compiled.world_size()
    }

    /// The inputs with their local (per-rank) shapes.
    #[getter]
    fn inputs(&self) -> Vec<TensorSpec> {
        self.specs(self.compiled.inputs())
    }

    /// The outputs with their local (per-rank) shapes.
    #[getter]
    fn outputs(&self) -> Vec<TensorSpec> {
        self.specs(self.compiled.outputs())
    }

    /// The kernels the program launches (`custom` ops), which a backend must register.
    #[getter]
    fn kernels(&self) -> Vec<String> {
        self.compiled.kernels()
    }

    /// Every decomposition decision with its candidates and their predicted times (what
    /// `meshflow lower --explain` prints).
    #[getter]
    fn explain(&self) -> String {
        self.compiled
            .explain()
            .iter()
            .map(|r| r.to_string())
            .collect()
    }

    /// The plan taken for each resharding, by tensor: `{"decomposition", "pieces",
    /// "schedule", "transport", "accumulate"}` (`accumulate`: the reduce-scatter ring adds
    /// onto the running sum in its GEMM, `linear_accumulate`).
    #[getter]
    fn plans<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (name, plan) in self.compiled.plans() {
            let d = PyDict::new(py);
            d.set_item("decomposition", plan.decomposition.name())?;
            d.set_item("pieces", plan.pieces)?;
            d.set_item("schedule", schedule_name(plan.schedule))?;
            d.set_item("transport", plan.transport.name())?;
            d.set_item("accumulate", plan.accumulate)?;
            out.set_item(name, d)?;
        }
        Ok(out)
    }

    /// The machine profile the plans were priced with and why (`"h100x2: built-in profile of
    /// NVIDIA H100 80GB HBM3"`); `None` for a host program loaded from text.
    #[getter]
    fn profile(&self) -> Option<&str> {
        self.compiled.profile_reason()
    }

    /// The transport the plans assume (`"nccl"`, `"copy-engine"`), if any was priced.
    #[getter]
    fn transport(&self) -> Option<&'static str> {
        self.compiled.transport().map(Transport::name)
    }

    /// The cross-rank check's report, when it ran.
    #[getter]
    fn check_report(&self) -> Option<CheckReport> {
        self.compiled
            .check_report()
            .map(|r| CheckReport { report: r.clone() })
    }

    /// IR dumps asked for with `dump_after`: `[(pass, text)]`.
    #[getter]
    fn dumps(&self) -> Vec<(String, String)> {
        let d = self.compiled.dumps();
        d.iter()
            .map(|d| (d.after.to_string(), d.text.clone()))
            .collect()
    }

    /// Cuts a full (unsharded) array of the tensor `name` into the local array of every rank
    /// that holds it: `{rank: ndarray}`.
    fn scatter<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        full: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let data = from_numpy(full, self.tensor_dtype(name)?, name)?;
        let parts = self.compiled.scatter(name, &data).map_err(error)?;
        let out = PyDict::new(py);
        for (rank, t) in parts {
            out.set_item(rank, to_numpy(py, &t)?)?;
        }
        Ok(out)
    }

    /// Assembles the full array of the tensor `name` from the local arrays of the ranks that
    /// hold it (`{rank: ndarray}`; replicas must agree).
    fn gather<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        parts: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dtype = self.tensor_dtype(name)?;
        let mut locals = BTreeMap::new();
        for (rank, part) in parts.iter() {
            locals.insert(rank.extract::<usize>()?, from_numpy(&part, dtype, name)?);
        }
        let full = self.compiled.gather(name, &locals).map_err(error)?;
        to_numpy(py, &full)
    }

    fn __str__(&self) -> String {
        self.text()
    }

    fn __repr__(&self) -> String {
        format!(
            "<meshflow.HostProgram {} ({} ranks)>",
            self.compiled.host().name,
            self.compiled.world_size()
        )
    }
}

/// Parses level-1 program text. `ranks` sets the program's `param ranks` (when it declares
/// one); `params` overrides other `param`s.
#[pyfunction]
#[pyo3(signature = (text, ranks = None, params = None))]
pub fn parse(
    text: &str,
    ranks: Option<usize>,
    params: Option<BTreeMap<String, i64>>,
) -> PyResult<Program> {
    let mut options = match ranks {
        Some(r) => Options::for_ranks(r),
        None => Options::new(),
    };
    for (k, v) in params.unwrap_or_default() {
        options = options.param(k, v);
    }
    let program = meshflow::parse(text, &options).map_err(error)?;
    Ok(Program { program, ranks })
}

/// Reads and parses a level-1 program file (`.mf`); see `parse`.
#[pyfunction]
#[pyo3(signature = (path, ranks = None, params = None))]
pub fn load(
    path: std::path::PathBuf,
    ranks: Option<usize>,
    params: Option<BTreeMap<String, i64>>,
) -> PyResult<Program> {
    let text = std::fs::read_to_string(&path).map_err(|e| {
        let message = format!("{}: {e}", path.display());
        match e.kind() {
            std::io::ErrorKind::NotFound => pyo3::exceptions::PyFileNotFoundError::new_err(message),
            _ => pyo3::exceptions::PyOSError::new_err(message),
        }
    })?;
    parse(&text, ranks, params)
}
