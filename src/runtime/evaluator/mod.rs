//! [`Evaluator`]: walks one rank's host program over a [`Backend`].
//!
//! The program is compiled once per rank into a plan of dense tables (tensor slots, team
//! slots, communication labels, kernel ids), so executing an instruction involves no string
//! or hash-map lookups. Scalar expressions are evaluated per rank and per iteration.

mod exec;
mod moe_weights;
mod plan;

use std::collections::BTreeMap;
use std::time::Instant;

use meshflow_ir::host::EvalError;
use meshflow_ir::{Arena, CommId, DeviceId, HostProgram, HostTensorId};
use meshflow_passes::Transport;

use super::backend::{
    Backend, BackendError, CommLabel, MoeWeightsAt, PlanInfo, PreorderIndex, RaceReport,
    StreamIndex, TensorView,
};
use super::data::TensorData;
use super::trace::TraceEvent;
use plan::{table, Plan};

/// What went wrong inside one instruction.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum StepError {
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A scalar expression could not be evaluated.
    #[error(transparent)]
    Expr(#[from] EvalError),
    /// The instruction cannot run as written (bad index, missing buffer, ...).
    #[error("{0}")]
    Invalid(String),
}

/// Why a rank's run failed. Every variant names the rank; instruction errors also print the
/// instruction and the loop iteration.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    /// An instruction failed.
    #[error("rank {rank}: `{inst}`{iteration}: {source}")]
    At {
        /// The rank.
        rank: DeviceId,
        /// The instruction, printed.
        inst: String,
        /// The loop iteration (` at i0=1` or empty).
        iteration: String,
        /// What failed.
        source: Box<StepError>,
    },
    /// Two unordered accesses to the same elements.
    #[error("rank {rank}: race: {message}")]
    Race {
        /// The rank.
        rank: DeviceId,
        /// Both instructions, their iterations and the missing ordering.
        message: String,
        /// The raw report.
        report: Box<RaceReport>,
    },
    /// The program cannot run on this rank.
    #[error("rank {rank}: `{inst}`: {message}")]
    Plan {
        /// The rank.
        rank: DeviceId,
        /// The instruction, printed.
        inst: String,
        /// What is wrong.
        message: String,
    },
    /// An input was not supplied or has the wrong type.
    #[error("rank {rank}: input `{name}`: {message}")]
    Input {
        /// The rank.
        rank: DeviceId,
        /// The input.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A backend failure outside any instruction (binding inputs, reading outputs).
    #[error("rank {rank}: {source}")]
    Backend {
        /// The rank.
        rank: DeviceId,
        /// The error.
        source: BackendError,
    },
    /// The rank panicked (reported by the launcher).
    #[error("rank {rank} panicked{position}: {message}")]
    Panic {
        /// The rank.
        rank: DeviceId,
        /// Where (` at `inst` at i0=1`), if known.
        position: String,
        /// The panic message.
        message: String,
    },
}

impl RuntimeError {
    /// The rank this error is about.
    pub fn rank(&self) -> DeviceId {
        match self {
            RuntimeError::At { rank, .. }
            | RuntimeError::Race { rank, .. }
            | RuntimeError::Plan { rank, .. }
            | RuntimeError::Input { rank, .. }
            | RuntimeError::Backend { rank, .. }
            | RuntimeError::Panic { rank, .. } => *rank,
        }
    }

    /// True when this rank only stopped because another rank failed.
    pub fn is_abort(&self) -> bool {
        matches!(
            self,
            RuntimeError::Backend {
                source: BackendError::Aborted { .. },
                ..
            }
        ) || matches!(self, RuntimeError::At { source, .. }
            if matches!(**source, StepError::Backend(BackendError::Aborted { .. })))
    }

    /// For a timeout, the rank that stopped responding (the end of the wait-for chain).
    pub fn unresponsive_peer(&self) -> Option<DeviceId> {
        match self {
            RuntimeError::Backend {
                source: BackendError::Timeout { peer, .. },
                ..
            } => Some(*peer),
            RuntimeError::At { source, .. } => match &**source {
                StepError::Backend(BackendError::Timeout { peer, .. }) => Some(*peer),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Options of one evaluator.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    /// When set, every executed instruction is recorded as a trace event with timestamps
    /// relative to this instant.
    pub trace_epoch: Option<Instant>,
}

/// One communication of a prepared program on one rank and the transport the backend selected
/// for it (see [`Evaluator::comm_transports`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectedTransport {
    /// The communication's label in the host program.
    pub comm: CommId,
    /// The instruction name (`all_gather`, `collective_permute`, ...).
    pub name: &'static str,
    /// The transport, when the backend has transports.
    pub transport: Option<Transport>,
    /// For an MoE dispatch or combine: which of the two hands the top-k weights to the
    /// transport.
    pub moe_weights: Option<MoeWeightsAt>,
}

/// The weights view an MoE dispatch carried (its combine must name the same one).
#[derive(Clone, Debug, PartialEq, Eq)]
struct SentWeights {
    tensor: HostTensorId,
    offset: u64,
    shape: Vec<u64>,
    strides: Vec<u64>,
}

impl SentWeights {
    fn of<Buf>(v: &TensorView<Buf>) -> SentWeights {
        SentWeights {
            tensor: v.tensor,
            offset: v.offset,
            shape: v.shape.clone(),
            strides: v.strides.clone(),
        }
    }
}

/// Mutable execution state of one rank.
struct State<B: Backend> {
    views: Arena<HostTensorId, Option<TensorView<B::Buffer>>>,
    owned: Arena<HostTensorId, Option<B::Buffer>>,
    /// Per loop variable (indexed by `LoopVar`), its value inside the loop.
    loops: Vec<Option<i64>>,
    iteration: Vec<i64>,
    scratch: Vec<i64>,
    /// Per stream variable (indexed by `StreamVar`), the saved stream.
    saved: Vec<Option<StreamIndex>>,
    current: StreamIndex,
    pending: Arena<CommLabel, Option<B::Comm>>,
    /// Per MoE dispatch label, the weights view its latest instance carried.
    moe_sent: Arena<CommLabel, Option<SentWeights>>,
    in_group: bool,
    at: Option<PreorderIndex>,
    args: Vec<i64>,
    trace: Vec<TraceEvent>,
}

/// Executes one rank's host program on a backend.
pub struct Evaluator<'p, B: Backend> {
    program: &'p HostProgram,
    plan: Plan<'p>,
    backend: B,
    state: State<B>,
    options: EvalOptions,
    /// Per instruction, its text (for traces; empty when not tracing).
    texts: Arena<PreorderIndex, String>,
    steps: usize,
    graph: bool,
    /// Whether a step ran without recording since the backend was prepared (a graph is only
    /// recorded after one, so that communicators, engines and temporaries exist already).
    warm: bool,
    host_us_per_step: Option<f64>,
}

impl<'p, B: Backend> Evaluator<'p, B> {
    /// Compiles `program` for the backend's rank and prepares the backend.
    pub fn new(
        program: &'p HostProgram,
        mut backend: B,
        options: EvalOptions,
    ) -> Result<Evaluator<'p, B>, RuntimeError> {
        let rank = backend.device();
        let plan = Plan::build(program, &backend, rank)?;
        backend
            .prepare(&PlanInfo {
                teams: &plan.teams,
                comms: &plan.comms,
            })
            .map_err(|source| RuntimeError::Backend { rank, source })?;
        let texts = if options.trace_epoch.is_some() {
            plan.insts
                .values()
                .map(|i| meshflow_ir::text::inst_to_string(program, i))
                .collect()
        } else {
            Arena::new()
        };
        let n = program.tensors.len();
        let state = State {
            views: table(n, None),
            owned: table(n, None),
            loops: vec![None; plan.loop_vars],
            iteration: Vec::new(),
            scratch: Vec::new(),
            saved: vec![None; plan.stream_vars],
            current: StreamIndex::MAIN,
            pending: table(plan.comms.len(), None),
            moe_sent: table(plan.comms.len(), None),
            in_group: false,
            at: None,
            args: Vec::new(),
            trace: Vec::new(),
        };
        Ok(Evaluator {
            program,
            plan,
            backend,
            state,
            options,
            texts,
            steps: 1,
            graph: false,
            warm: false,
            host_us_per_step: None,
        })
    }

    /// Every communication this rank posts, with the transport the backend selected for it
    /// when the program was prepared (in label order).
    pub fn comm_transports(&self) -> Vec<SelectedTransport> {
        self.plan
            .comms
            .iter()
            .filter(|(_, c)| c.op.is_some())
            .map(|(label, c)| SelectedTransport {
                comm: c.comm,
                name: c.name,
                transport: self.backend.transport_of(label),
                moe_weights: c.moe_weights,
            })
            .collect()
    }

    /// The rank.
    pub fn rank(&self) -> DeviceId {
        self.backend.device()
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Takes the trace events recorded so far.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        std::mem::take(&mut self.state.trace)
    }

    /// Makes every [`run`](Self::run) execute the program body `steps` times back to back
    /// (at least once) between binding the inputs and reading the outputs: one upload, `steps`
    /// executions on the same buffers, one wait for the device. Used to time steady-state
    /// steps on busy devices; the outputs are those of the last step.
    pub fn set_steps(&mut self, steps: usize) {
        self.steps = steps.max(1);
    }

    /// Makes every run record one step as a device graph and replay it `steps` times (see
    /// [`Backend::begin_graph`]); a backend that cannot record fails the run with the reason.
    /// The first run after the backend was prepared issues one step without recording first
    /// (communicators, MoE engines and temporaries are made outside the recording); the
    /// outputs are those of the last replay either way.
    pub fn set_graph(&mut self, on: bool) {
        self.graph = on;
    }

    /// Host time of one step of the last run, µs: from the first instruction of the first step
    /// to the end of the last step's issue (recording and replay launches included with a
    /// graph), divided by the steps; device work still running is not waited for.
    pub fn host_us_per_step(&self) -> Option<f64> {
        self.host_us_per_step
    }

    /// The instruction being executed and its loop iteration (for reports after a panic),
    /// formatted ` at `inst` at i0=1`; empty when not inside an instruction.
    pub fn position(&self) -> String {
        match self.state.at {
            Some(at) => format!(
                " at `{}`{}",
                meshflow_ir::text::inst_to_string(self.program, self.plan.insts[at]),
                self.iteration_text(at, &self.state.iteration)
            ),
            None => String::new(),
        }
    }

    fn iteration_text(&self, at: PreorderIndex, values: &[i64]) -> String {
        let vars = &self.plan.enclosing[at];
        if vars.is_empty() {
            return String::new();
        }
        let parts: Vec<String> = vars
            .iter()
            .zip(values)
            .map(|(v, x)| format!("{v}={x}"))
            .collect();
        format!(" at {}", parts.join(", "))
    }

    /// Runs the program once: binds `inputs` (by host tensor name; those this rank holds),
    /// executes every instruction, waits for all work and returns the outputs this rank holds.
    pub fn run(
        &mut self,
        inputs: &BTreeMap<String, TensorData>,
    ) -> Result<BTreeMap<String, TensorData>, RuntimeError> {
        self.run_with(inputs, &BTreeMap::new())
    }

    /// [`Evaluator::run`] with caller-owned buffers: an input or output named in `external`
    /// uses that buffer as is (no allocation, upload or download, never released): inputs are
    /// read from it and outputs written into it in place. The returned map holds only the
    /// outputs not in `external`. Names this rank does not hold are ignored; naming a tensor
    /// that is neither an input nor an output is an error.
    pub fn run_with(
        &mut self,
        inputs: &BTreeMap<String, TensorData>,
        external: &BTreeMap<String, B::Buffer>,
    ) -> Result<BTreeMap<String, TensorData>, RuntimeError> {
        let result = self.run_inner(inputs, external);
        // Release every buffer, whatever happened (errors during cleanup are secondary).
        self.release_all();
        result
    }

    fn run_inner(
        &mut self,
        inputs: &BTreeMap<String, TensorData>,
        external: &BTreeMap<String, B::Buffer>,
    ) -> Result<BTreeMap<String, TensorData>, RuntimeError> {
        let rank = self.rank();
        // Buffers left by an interrupted (panicked) run.
        self.release_all();
        self.reset_state();
        self.backend
            .set_current_stream(StreamIndex::MAIN)
            .map_err(|source| RuntimeError::Backend { rank, source })?;
        self.bind_inputs_and_outputs(inputs, external)?;
        let plan = &self.plan;
        let mut cx = exec::Cx {
            program: self.program,
            plan,
            backend: &mut self.backend,
            state: &mut self.state,
            trace_epoch: self.options.trace_epoch,
            texts: &self.texts,
        };
        let steps = self.steps.max(1);
        let host_start = Instant::now();
        let recording = self.graph;
        if recording && !self.warm {
            cx.backend
                .check_graph()
                .map_err(|source| RuntimeError::Backend { rank, source })?;
            if let Err((at, iteration, err)) = cx.block(&plan.steps) {
                return Err(self.step_error(at, &iteration, err));
            }
            self.warm = true;
        }
        if recording {
            cx.backend
                .begin_graph()
                .map_err(|source| RuntimeError::Backend { rank, source })?;
        }
        for _ in 0..if recording { 1 } else { steps } {
            if let Err((at, iteration, err)) = cx.block(&plan.steps) {
                if recording {
                    // Drop the half-made recording; the step's error is what counts.
                    let _ = cx.backend.end_graph(0);
                }
                return Err(self.step_error(at, &iteration, err));
            }
        }
        if recording {
            cx.backend
                .end_graph(steps)
                .map_err(|source| RuntimeError::Backend { rank, source })?;
        }
        self.host_us_per_step = Some(host_start.elapsed().as_secs_f64() * 1e6 / steps as f64);
        self.state.at = None;
        if self.state.in_group {
            return Err(RuntimeError::Backend {
                rank,
                source: BackendError::Invalid("start_coalescing without end_coalescing".into()),
            });
        }
        let be = |source| RuntimeError::Backend { rank, source };
        self.backend.finish().map_err(be)?;
        let mut out = BTreeMap::new();
        for id in self.program.outputs() {
            if external.contains_key(&self.program.tensors[id].name) {
                continue;
            }
            if let Some(view) = &self.state.views[id] {
                let name = &self.program.tensors[id].name;
                let data = if self.program.is_padded(id) {
                    self.backend.download_padded(view)
                } else {
                    self.backend.download(view)
                };
                let data = data.map_err(|e| RuntimeError::Backend {
                    rank,
                    source: BackendError::Invalid(format!("output `{name}`: {e}")),
                })?;
                out.insert(self.program.tensors[id].name.clone(), data);
            }
        }
        Ok(out)
    }

    fn reset_state(&mut self) {
        let s = &mut self.state;
        s.loops.iter_mut().for_each(|l| *l = None);
        s.iteration.clear();
        s.saved.iter_mut().for_each(|v| *v = None);
        s.current = StreamIndex::MAIN;
        s.pending.iter_mut().for_each(|(_, p)| *p = None);
        s.moe_sent.iter_mut().for_each(|(_, p)| *p = None);
        s.in_group = false;
        s.at = None;
    }

    fn bind_inputs_and_outputs(
        &mut self,
        inputs: &BTreeMap<String, TensorData>,
        external: &BTreeMap<String, B::Buffer>,
    ) -> Result<(), RuntimeError> {
        let rank = self.rank();
        for name in external.keys() {
            let role = self
                .program
                .tensors
                .values()
                .find(|d| d.name == *name)
                .map(|d| d.role);
            if !matches!(
                role,
                Some(meshflow_ir::Role::Input | meshflow_ir::Role::Output)
            ) {
                return Err(RuntimeError::Input {
                    rank,
                    name: name.clone(),
                    message: "a caller-owned buffer names no input or output of the program".into(),
                });
            }
        }
        for (id, decl) in self.program.tensors.iter() {
            if !self.plan.held[id] || decl.role == meshflow_ir::Role::Internal {
                continue;
            }
            if let Some(&buffer) = external.get(&decl.name) {
                self.state.views[id] = Some(TensorView {
                    tensor: id,
                    buffer,
                    dtype: decl.dtype,
                    offset: 0,
                    strides: super::view::contiguous_strides(&decl.shape),
                    shape: decl.shape.clone(),
                });
                continue;
            }
            let input = decl.role == meshflow_ir::Role::Input;
            let data = if input {
                let data = inputs.get(&decl.name).ok_or_else(|| RuntimeError::Input {
                    rank,
                    name: decl.name.clone(),
                    message: "not supplied".into(),
                })?;
                if data.dtype() != decl.dtype || data.shape() != decl.shape.as_slice() {
                    return Err(RuntimeError::Input {
                        rank,
                        name: decl.name.clone(),
                        message: format!(
                            "must be {}{:?} on this rank, got {}",
                            decl.dtype,
                            decl.shape,
                            data.type_string()
                        ),
                    });
                }
                Some(data)
            } else {
                None
            };
            let be = |source| RuntimeError::Backend { rank, source };
            let buffer = self.backend.allocate(decl.dtype, &decl.shape).map_err(be)?;
            self.state.owned[id] = Some(buffer);
            self.state.views[id] = Some(TensorView {
                tensor: id,
                buffer,
                dtype: decl.dtype,
                offset: 0,
                strides: super::view::contiguous_strides(&decl.shape),
                shape: decl.shape.clone(),
            });
            if let Some(data) = data {
                self.backend.upload(buffer, data).map_err(be)?;
            }
        }
        Ok(())
    }

    /// Releases every buffer the evaluator holds. [`run`](Self::run) does this itself at
    /// its end; call it after catching a panic out of `run`, which skips that cleanup (the
    /// next `run` would also release them first).
    pub fn release_buffers(&mut self) {
        self.release_all();
    }

    fn release_all(&mut self) {
        let rank = self.rank();
        for (_, owned) in self.state.owned.iter_mut() {
            if let Some(b) = owned.take() {
                if let Err(e) = self.backend.deallocate(b) {
                    tracing::debug!(rank, "releasing a buffer failed: {e}");
                }
            }
        }
        self.state.views.iter_mut().for_each(|(_, v)| *v = None);
    }

    fn step_error(&self, at: PreorderIndex, iteration: &[i64], err: StepError) -> RuntimeError {
        let rank = self.rank();
        if let StepError::Backend(BackendError::Race(report)) = &err {
            return RuntimeError::Race {
                rank,
                message: self.race_message(report),
                report: report.clone(),
            };
        }
        RuntimeError::At {
            rank,
            inst: meshflow_ir::text::inst_to_string(self.program, self.plan.insts[at]),
            iteration: self.iteration_text(at, iteration),
            source: Box::new(err),
        }
    }

    fn race_message(&self, r: &RaceReport) -> String {
        let describe = |site: &super::backend::AccessSite| {
            let inst = self.plan.insts.get(site.preorder);
            let text = inst
                .map(|i| meshflow_ir::text::inst_to_string(self.program, i))
                .unwrap_or_else(|| site.preorder.to_string());
            let by = match site.comm_label {
                Some(_) => "as a communication".to_string(),
                None => format!("on stream {}", site.stream),
            };
            format!(
                "`{text}`{} {} {by}",
                self.iteration_text(site.preorder, &site.iteration),
                if site.write { "writes" } else { "reads" },
            )
        };
        let tensor = &self.program.tensors[r.tensor].name;
        let label = |l: CommLabel| self.plan.comm(l).map(|c| c.to_string()).unwrap_or_default();
        let fix = match r.earlier.comm_label {
            Some(l) => match self.plan.group_of.get(l).copied().flatten() {
                Some(g) => format!(
                    "missing `wait {}` (the coalescing group of {}) before the later instruction",
                    label(g),
                    label(l)
                ),
                None => format!("missing `wait {}` before the later instruction", label(l)),
            },
            None => match r.later.comm_label {
                Some(_) => format!(
                    "missing `synchronize` of stream {} before the communication is posted",
                    r.earlier.stream
                ),
                None => format!(
                    "missing `synchronize` of stream {} on stream {}",
                    r.earlier.stream, r.later.stream
                ),
            },
        };
        format!(
            "{} and later {} overlapping elements of `{tensor}` with no ordering between them ({fix})",
            describe(&r.earlier),
            describe(&r.later),
        )
    }
}
