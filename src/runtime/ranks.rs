//! Running a host program on N CPU ranks, one thread each.
//!
//! Every thread is joined, always. A rank that errors or panics records the failure on the
//! shared [`Fabric`]; every other rank then stops at its next communication or blocked
//! receive with an error naming the failed rank. A rank that stops (blocks forever) is detected
//! by its peers' receive timeout. Messages sent but never received are reported as an error
//! too (the ranks did not run matching programs).

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshflow_ir::{DeviceId, HostProgram, Program};

use super::cpu::fabric::Failure;
use super::cpu::{BufferStats, CpuBackend, CpuConfig, Fabric};
use super::data::TensorData;
use super::evaluator::{EvalOptions, Evaluator, RuntimeError};
use super::shard::{gather_tensor, scatter_inputs, ShardError};
use super::trace::{Trace, TraceEvent};

/// Inputs of a run.
#[derive(Clone, Debug)]
pub enum RunInputs<'a> {
    /// Local tensors by host tensor name, per rank.
    PerRank(BTreeMap<DeviceId, BTreeMap<String, TensorData>>),
    /// Full tensors by name, scattered by the level-1 program's layouts.
    Full {
        /// The level-1 program whose tensor layouts cut the inputs.
        program: &'a Program,
        /// Full input tensors by name.
        inputs: &'a BTreeMap<String, TensorData>,
    },
}

/// Options of a CPU run.
#[derive(Clone, Debug, Default)]
pub struct CpuOptions {
    /// Number of ranks (threads); at least the program's world size (the default).
    pub ranks: Option<usize>,
    /// Backend settings (stream pool, timeout, race checking, faults, kernels).
    pub config: CpuConfig,
    /// Record a Chrome/Perfetto trace.
    pub trace: bool,
}

/// The result of a successful run.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// Outputs by host tensor name, per rank (only those the rank holds).
    pub outputs: BTreeMap<DeviceId, BTreeMap<String, TensorData>>,
    /// The trace, when requested.
    pub trace: Option<Trace>,
    /// Wall-clock time of the run.
    pub elapsed: Duration,
}

impl RunOutcome {
    /// Gathers every output of the level-1 `program` from the ranks' local outputs.
    pub fn gather(&self, program: &Program) -> Result<BTreeMap<String, TensorData>, ShardError> {
        program
            .outputs
            .iter()
            .map(|&t| {
                let name = program.tensors[t].name.clone();
                gather_tensor(program, t, &self.outputs).map(|d| (name, d))
            })
            .collect()
    }
}

/// Why a run failed: every rank's error, the first failure, undelivered messages.
#[derive(Clone, Debug)]
pub struct RunFailure {
    /// The first rank that failed, and its error.
    pub first: Option<Failure>,
    /// The errors of every rank that failed, by rank.
    pub errors: Vec<RuntimeError>,
    /// Messages sent but never received, as text.
    pub undelivered: Vec<String>,
}

impl fmt::Display for RunFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(first) = &self.first {
            write!(f, "{}", first.reason)?;
        } else if let Some(e) = self.errors.first() {
            write!(f, "{e}")?;
        }
        let others = self
            .errors
            .iter()
            .filter(|e| self.first.as_ref().is_none_or(|x| x.rank != e.rank()))
            .count();
        if others > 0 {
            write!(f, " ({others} other rank(s) stopped as a consequence)")?;
        }
        if !self.undelivered.is_empty() {
            write!(
                f,
                "{}messages sent but never received: {}",
                if self.errors.is_empty() { "" } else { "; " },
                self.undelivered.join(", ")
            )?;
        }
        Ok(())
    }
}

/// Why [`run_cpu`] failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RunError {
    /// Inputs could not be scattered.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// Fewer ranks than the program's meshes need.
    #[error("the program needs {needed} ranks, {given} requested")]
    TooFewRanks {
        /// World size of the program.
        needed: usize,
        /// Ranks requested.
        given: usize,
    },
    /// A rank thread could not be started.
    #[error("could not start rank thread {rank}: {message}")]
    Spawn {
        /// The rank.
        rank: DeviceId,
        /// The OS error.
        message: String,
    },
    /// One or more ranks failed.
    #[error("{0}")]
    Failed(RunFailure),
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

/// What a run left behind, for leak checks ([`run_cpu_observed`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunResources {
    /// Buffers each rank's backend still held when its evaluator returned, after the
    /// evaluator's cleanup (a rank that panicked is cleaned up too). Empty on every rank when
    /// nothing leaks, failed runs included.
    pub held_at_exit: BTreeMap<DeviceId, BufferStats>,
    /// Messages sent but never received when every rank had stopped (a failed run leaves
    /// some); they are dropped before the run returns.
    pub undelivered: BufferStats,
    /// Rank threads started.
    pub threads_started: usize,
    /// Rank threads joined (always all of them).
    pub threads_joined: usize,
}

type RankResult = (
    Result<BTreeMap<String, TensorData>, RuntimeError>,
    Vec<TraceEvent>,
    BufferStats,
);

fn run_rank(
    host: &HostProgram,
    rank: DeviceId,
    inputs: &BTreeMap<String, TensorData>,
    fabric: &Arc<Fabric>,
    config: &CpuConfig,
    eval: &EvalOptions,
) -> RankResult {
    let backend = CpuBackend::new(rank, fabric.clone(), config);
    let mut ev = match Evaluator::new(host, backend, eval.clone()) {
        Ok(ev) => ev,
        Err(e) => {
            fabric.fail(rank, e.to_string());
            return (Err(e), Vec::new(), BufferStats::default());
        }
    };
    let result = match catch_unwind(AssertUnwindSafe(|| ev.run(inputs))) {
        Ok(r) => r,
        Err(p) => {
            let error = RuntimeError::Panic {
                rank,
                position: ev.position(),
                message: panic_message(p.as_ref()),
            };
            // The panic skipped `run`'s own cleanup.
            ev.release_buffers();
            Err(error)
        }
    };
    let held = ev.backend().live_buffers();
    if let Err(e) = &result {
        match e.unresponsive_peer() {
            // Blame the rank that stopped responding, not the one that noticed first.
            Some(peer) if peer != rank => fabric.fail(
                peer,
                format!("rank {peer} stopped responding (detected by rank {rank}: {e})"),
            ),
            _ if !e.is_abort() => fabric.fail(rank, e.to_string()),
            _ => {}
        }
    }
    (result, ev.take_trace(), held)
}

/// What the rank threads of [`run_ranks`] produced.
pub(crate) struct RanksResult {
    /// Outputs of the ranks that succeeded.
    pub outputs: BTreeMap<DeviceId, BTreeMap<String, TensorData>>,
    /// Errors of the ranks that failed.
    pub errors: Vec<RuntimeError>,
    /// Trace events of every rank.
    pub events: Vec<TraceEvent>,
    /// Buffers each rank still held when its evaluator returned.
    pub held_at_exit: BTreeMap<DeviceId, BufferStats>,
    /// Rank threads started.
    pub threads_started: usize,
    /// Rank threads joined.
    pub threads_joined: usize,
}

/// Orders trace events by rank, then start time.
pub(crate) fn sort_events(events: &mut [TraceEvent]) {
    events.sort_by(|a, b| {
        (a.rank, a.start_us)
            .partial_cmp(&(b.rank, b.start_us))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
}

/// Runs `host` on `ranks` of `fabric`, one thread each, and joins every thread.
pub(crate) fn run_ranks(
    host: &HostProgram,
    ranks: &[DeviceId],
    per_rank: &BTreeMap<DeviceId, BTreeMap<String, TensorData>>,
    fabric: &Arc<Fabric>,
    options: &CpuOptions,
    start: Instant,
) -> Result<RanksResult, RunError> {
    let eval = EvalOptions {
        trace_epoch: options.trace.then_some(start),
    };
    let empty = BTreeMap::new();
    let (mut threads_started, mut threads_joined) = (0, 0);
    let results: Vec<Result<RankResult, RunError>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(ranks.len());
        for &rank in ranks {
            let inputs = per_rank.get(&rank).unwrap_or(&empty);
            let (fabric, config, eval) = (fabric, &options.config, &eval);
            let spawned = std::thread::Builder::new()
                .name(format!("meshflow-cpu-rank-{rank}"))
                .spawn_scoped(scope, move || {
                    run_rank(host, rank, inputs, fabric, config, eval)
                });
            match spawned {
                Ok(h) => handles.push((rank, Some(h))),
                Err(e) => {
                    fabric.fail(rank, format!("could not start its thread: {e}"));
                    handles.push((rank, None));
                    tracing::error!(rank, "could not start rank thread: {e}");
                }
            }
        }
        threads_started = handles.iter().filter(|(_, h)| h.is_some()).count();
        handles
            .into_iter()
            .map(|(rank, h)| match h {
                Some(h) => {
                    let joined = h.join();
                    threads_joined += 1;
                    joined.map_err(|p| RunError::Spawn {
                        rank,
                        message: panic_message(p.as_ref()),
                    })
                }
                None => Err(RunError::Spawn {
                    rank,
                    message: "thread not started".into(),
                }),
            })
            .collect()
    });
    let mut outputs = BTreeMap::new();
    let mut errors = Vec::new();
    let mut events = Vec::new();
    let mut held_at_exit = BTreeMap::new();
    let results: Vec<RankResult> = results.into_iter().collect::<Result<_, _>>()?;
    for (&rank, (result, trace, held)) in ranks.iter().zip(results) {
        held_at_exit.insert(rank, held);
        events.extend(trace);
        match result {
            Ok(o) => {
                outputs.insert(rank, o);
            }
            Err(e) => errors.push(e),
        }
    }
    Ok(RanksResult {
        outputs,
        errors,
        events,
        held_at_exit,
        threads_started,
        threads_joined,
    })
}

/// Runs `host` on CPU ranks `0..ranks`, one thread each, and returns every rank's outputs.
pub fn run_cpu(
    host: &HostProgram,
    inputs: RunInputs<'_>,
    options: &CpuOptions,
) -> Result<RunOutcome, RunError> {
    run_cpu_observed(host, inputs, options).0
}

/// [`run_cpu`], also reporting what the run left behind (buffers held per rank, messages
/// never received, threads started and joined), for leak checks.
pub fn run_cpu_observed(
    host: &HostProgram,
    inputs: RunInputs<'_>,
    options: &CpuOptions,
) -> (Result<RunOutcome, RunError>, RunResources) {
    let mut resources = RunResources::default();
    let result = run_cpu_into(host, inputs, options, &mut resources);
    (result, resources)
}

fn run_cpu_into(
    host: &HostProgram,
    inputs: RunInputs<'_>,
    options: &CpuOptions,
    resources: &mut RunResources,
) -> Result<RunOutcome, RunError> {
    let needed = host.world_size();
    let world = options.ranks.unwrap_or(needed);
    if world < needed || world == 0 {
        return Err(RunError::TooFewRanks {
            needed: needed.max(1),
            given: world,
        });
    }
    let per_rank = match inputs {
        RunInputs::PerRank(m) => m,
        RunInputs::Full { program, inputs } => scatter_inputs(program, inputs)?,
    };
    let fabric = Arc::new(Fabric::new());
    let start = Instant::now();
    let ranks: Vec<DeviceId> = (0..world).collect();
    let RanksResult {
        outputs,
        errors,
        mut events,
        held_at_exit,
        threads_started,
        threads_joined,
    } = run_ranks(host, &ranks, &per_rank, &fabric, options, start)?;
    resources.held_at_exit = held_at_exit;
    resources.threads_started = threads_started;
    resources.threads_joined = threads_joined;
    let elapsed = start.elapsed();
    let undelivered: Vec<String> = fabric
        .undelivered()
        .into_iter()
        .map(|(src, dst, _, seq)| format!("rank {src} -> rank {dst} (team operation #{seq})"))
        .collect();
    resources.undelivered = fabric.discard_undelivered();
    if !errors.is_empty() || !undelivered.is_empty() {
        return Err(RunError::Failed(RunFailure {
            first: fabric.failure(),
            errors,
            undelivered: if fabric.aborted() {
                Vec::new()
            } else {
                undelivered
            },
        }));
    }
    sort_events(&mut events);
    Ok(RunOutcome {
        outputs,
        trace: options.trace.then_some(Trace { events }),
        elapsed,
    })
}
