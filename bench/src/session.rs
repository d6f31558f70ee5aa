//! Timing many host programs of one case on one set of GPUs, fairly and cheaply.
//!
//! A case's programs ([`Job`]s: the bound's parts, the variants, the parts alone) are set up
//! once per rank: one backend and one evaluator each (their NCCL communicators, transports and
//! temporaries stay for the whole case), and the inputs uploaded once into device buffers that
//! every evaluator reads in place. Then:
//!
//! 1. a check run of every job: its outputs are downloaded once and compared with the
//!    reference (the caller's checker, per rank on the outputs it holds);
//! 2. `warmup` untimed rounds;
//! 3. `rounds` timed rounds: every job runs once per round, in turn (A B C ... A B C ...),
//!    `steps` steps back to back on warm GPUs, so that drift of clocks or temperature hits
//!    every job alike. Each job's figure is the median over rounds (per rank; the maximum
//!    over ranks is reported, see [`Timing`](crate::stats::Timing)).
//!
//! The timed runs read and write device buffers only (no upload, no download). Ranks are
//! threads of this process ([`measure_in_process`]), or one process per GPU under
//! `meshflow launch` ([`measure_launched`], every process runs its rank; rank 0 gets every
//! rank's figures through the rendezvous).
//!
//! A failure of any rank aborts the case (its rendezvous and abort signal), so that no rank
//! waits for a peer that gave up; every job of the case is then reported failed with the
//! reason. A rank that makes no progress (one job's setup, check run or round) for longer than
//! the run's timeout plus [`STALL_MARGIN`] is reported by the [`watchdog`](crate::watchdog) as
//! such a failure, naming the job and the phase; a rank thread that even the abort does not
//! free (blocked inside NCCL) ends the process with that message rather than a hang.
//!
//! A case's NCCL communicators live as long as the case: they are made under a rendezvous
//! namespace of the case's own, and the process-wide cache is emptied (aborted) once every rank
//! of the case is done with it, so the next case creates its own and never pairs one rank's
//! communicator of an old clique with another rank's of a different one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::watchdog::{watch, Progress, Stall};

use meshflow::ir::{DType, DeviceId, HostProgram, Role};
use meshflow::kernels::{Device, DeviceBuffer, Stream};
use meshflow::runtime::cuda::{
    clear_communicator_cache, AbortSignal, CudaBackend, CudaBuffer, CudaConfig, PeerHub,
};
use meshflow::runtime::data::{Storage, TensorData};
use meshflow::runtime::rendezvous::{LocalRendezvous, Rendezvous, RendezvousError};
use meshflow::runtime::{EvalOptions, Evaluator};
use serde_json::{json, Value};

use crate::gpu::Setup;
use crate::launched::Launched;

/// One program of a case.
pub(crate) struct Job {
    /// What the logs call it.
    pub name: String,
    /// The host program.
    pub host: HostProgram,
    /// How the backend runs it.
    pub setup: Setup,
    /// Its inputs: an index into the case's input sets.
    pub inputs: usize,
    /// Whether its outputs are compared with the reference after the first run.
    pub check: bool,
}

/// How many runs of each job.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Rounds {
    /// Untimed rounds after the check run.
    pub warmup: usize,
    /// Timed rounds.
    pub rounds: usize,
    /// Steps of the host program per run.
    pub steps: usize,
}

/// What a job measured, every rank.
#[derive(Clone, Debug, Default)]
pub(crate) struct Measured {
    /// Device µs per step, `[rank][round]`.
    pub times_us: Vec<Vec<f64>>,
    /// Host µs to issue one step, `[rank][round]` (in-process runs).
    pub host_us: Vec<Vec<f64>>,
    /// The largest sampled relative error over ranks (NaN when not checked).
    pub error: f64,
}

/// Checks the outputs a rank holds after a job's first run: the sampled relative error.
pub(crate) type Checker<'a> =
    &'a (dyn Fn(DeviceId, usize, &BTreeMap<String, TensorData>) -> Result<f64, String> + Sync);

/// Per input set, every rank's tensors.
pub(crate) type InputSets = [BTreeMap<usize, BTreeMap<String, TensorData>>];

/// A rendezvous whose keys and barriers live under a prefix of another's, with its namespace
/// (so that communicators cached per namespace serve every scope), or one of its own.
#[derive(Debug)]
pub(crate) struct Scoped {
    inner: Arc<dyn Rendezvous>,
    prefix: String,
    namespace: Option<String>,
}

impl Scoped {
    pub(crate) fn new(inner: Arc<dyn Rendezvous>, prefix: String) -> Scoped {
        Scoped {
            inner,
            prefix,
            namespace: None,
        }
    }

    /// The same keys under the namespace `namespace`: communicators made through it are
    /// cached apart from every other namespace's.
    pub(crate) fn renamed(inner: Arc<dyn Rendezvous>, namespace: String) -> Scoped {
        Scoped {
            inner,
            prefix: String::new(),
            namespace: Some(namespace),
        }
    }
}

/// A namespace of this process's next case: its communicators are its own (the ranks of every
/// process number their cases alike, as they run the same cases in the same order). Numbering
/// per case also gives each case fresh creation generations, so that a case whose ranks
/// failed unevenly cannot leave the next one's ranks counting differently.
fn case_namespace(base: &str) -> String {
    static CASES: AtomicUsize = AtomicUsize::new(0);
    format!("{base}/case-{}", CASES.fetch_add(1, Ordering::Relaxed))
}

impl Rendezvous for Scoped {
    fn namespace(&self) -> &str {
        self.namespace
            .as_deref()
            .unwrap_or_else(|| self.inner.namespace())
    }
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.inner.publish(&format!("{}{key}", self.prefix), value)
    }
    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.inner.fetch(&format!("{}{key}", self.prefix), timeout)
    }
    fn barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.inner
            .barrier(&format!("{}{name}", self.prefix), parties, timeout)
    }
    fn timing_barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.inner
            .timing_barrier(&format!("{}{name}", self.prefix), parties, timeout)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
    fn spans_processes(&self) -> bool {
        self.inner.spans_processes()
    }
}

/// Where one rank runs.
struct RankCtx {
    rank: DeviceId,
    world: usize,
    ordinal: usize,
    rdv: Arc<dyn Rendezvous>,
    abort: AbortSignal,
    /// In-process: one copy-engine hub per job (as every in-process run has its own: the
    /// transfers of each job's backends are filed apart). Empty: CUDA IPC between processes.
    hubs: Vec<Arc<PeerHub>>,
    config: CudaConfig,
    /// What this rank is doing (its slot: `slot`), for the watchdog.
    progress: Arc<Progress>,
    slot: usize,
}

/// How long after the run's own timeout (device and peer waits) a rank that made no progress
/// is declared stalled.
pub(crate) const STALL_MARGIN: Duration = Duration::from_secs(10);
/// How long the watchdog waits for rank threads to return after aborting a stalled case.
const STALL_GRACE: Duration = Duration::from_secs(15);

impl RankCtx {
    fn at(&self, what: std::fmt::Arguments<'_>) {
        self.progress
            .at(self.slot, format!("rank {}: {what}", self.rank));
    }
}

/// One rank's figures of one job.
#[derive(Clone, Debug, Default)]
struct RankMeasured {
    times_us: Vec<f64>,
    host_us: Vec<f64>,
    error: f64,
}

fn upload(stream: &Stream, t: &TensorData) -> Result<DeviceBuffer, String> {
    let r = match t.storage() {
        Storage::F32(v) => DeviceBuffer::from_slice(stream, v),
        Storage::BF16(v) => DeviceBuffer::from_slice(stream, v),
        Storage::F16(v) => DeviceBuffer::from_slice(stream, v),
        Storage::I32(v) => DeviceBuffer::from_slice(stream, v),
        Storage::I64(v) => DeviceBuffer::from_slice(stream, v),
    };
    r.map_err(|e| format!("uploading an input: {e}"))
}

/// The names of `host`'s inputs.
fn input_names(host: &HostProgram) -> Vec<&str> {
    host.tensors
        .values()
        .filter(|d| d.role == Role::Input)
        .map(|d| d.name.as_str())
        .collect()
}

type Ev<'p> = Evaluator<'p, CudaBackend>;

/// One rank of a case: set up every job, check, warm up, time the rounds.
fn rank_worker(
    cx: &RankCtx,
    jobs: &[Job],
    sets: &[&BTreeMap<String, TensorData>],
    rounds: Rounds,
    checker: Checker<'_>,
) -> Result<Vec<RankMeasured>, String> {
    let rank = cx.rank;
    cx.at(format_args!("uploading the inputs"));
    let device = Device::new(cx.ordinal).map_err(|e| format!("rank {rank}: GPU: {e}"))?;
    let stream = Stream::new(&device).map_err(|e| format!("rank {rank}: stream: {e}"))?;
    // Inputs: uploaded once, lent to every job's backend.
    let mut inputs: Vec<BTreeMap<String, (DeviceBuffer, DType)>> = Vec::new();
    for set in sets {
        let mut m = BTreeMap::new();
        for (name, t) in set.iter() {
            m.insert(name.clone(), (upload(&stream, t)?, t.dtype()));
        }
        inputs.push(m);
    }
    let mut evs: Vec<(Ev<'_>, BTreeMap<String, CudaBuffer>)> = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        let what = |e: &dyn std::fmt::Display| format!("{}: rank {rank}: {e}", job.name);
        cx.at(format_args!("{}: setting up", job.name));
        let mut config = cx.config.clone();
        config.transport = Some(job.setup.transport);
        config.copy_stream = job.setup.copy_stream;
        config.graph = job.setup.graph;
        let rdv: Arc<dyn Rendezvous> = Arc::new(Scoped::new(cx.rdv.clone(), format!("job{j}/")));
        let mut b = CudaBackend::new(rank, cx.ordinal, config, Some(rdv), Some(cx.abort.clone()))
            .map_err(|e| what(&e))?;
        b.set_start_barrier(cx.world);
        if let Some(h) = cx.hubs.get(j) {
            b.set_peer_hub(h.clone());
            b.disable_ipc_peers();
        }
        let mut ext = BTreeMap::new();
        let set = inputs
            .get(job.inputs)
            .ok_or_else(|| what(&"no such input set"))?;
        for name in input_names(&job.host) {
            if let Some((buf, dtype)) = set.get(name) {
                let lent = b.import(buf.clone(), *dtype).map_err(|e| what(&e))?;
                ext.insert(name.to_string(), lent);
            }
        }
        let mut ev = Evaluator::new(&job.host, b, EvalOptions::default()).map_err(|e| what(&e))?;
        ev.set_steps(rounds.steps);
        ev.set_graph(job.setup.graph);
        evs.push((ev, ext));
    }
    if rank == 0 {
        tracing::info!("bench: {} programs set up", jobs.len());
    }
    let none = BTreeMap::new();
    let mut out = vec![RankMeasured::default(); jobs.len()];
    // Outputs of the timed runs: one device buffer per name and type, lent to every backend.
    let mut outputs: BTreeMap<(String, Vec<u64>, DType), DeviceBuffer> = BTreeMap::new();
    for (j, (ev, ext)) in evs.iter_mut().enumerate() {
        let job = &jobs[j];
        cx.at(format_args!("{}: first run (check)", job.name));
        let got = ev
            .run_with(&none, ext)
            .map_err(|e| format!("{}: {e}", job.name))?;
        out[j].error = if job.check {
            checker(rank, j, &got).map_err(|e| format!("{}: {e}", job.name))?
        } else {
            f64::NAN
        };
        for (name, t) in got {
            let key = (name.clone(), t.shape().to_vec(), t.dtype());
            let buf = match outputs.get(&key) {
                Some(b) => b.clone(),
                None => {
                    let b = DeviceBuffer::alloc(&device, t.storage().size_bytes() as usize)
                        .map_err(|e| format!("{}: output `{name}`: {e}", job.name))?;
                    outputs.insert(key, b.clone());
                    b
                }
            };
            let lent = ev
                .backend_mut()
                .import(buf, t.dtype())
                .map_err(|e| format!("{}: {e}", job.name))?;
            ext.insert(name, lent);
        }
        if rank == 0 && job.check {
            tracing::info!(
                "bench: {}: checked (rank 0: rel err {:.2e})",
                job.name,
                out[j].error
            );
        }
    }
    for round in 0..rounds.warmup + rounds.rounds {
        for (j, (ev, ext)) in evs.iter_mut().enumerate() {
            cx.at(format_args!(
                "{}: round {} of {} ({} untimed first)",
                jobs[j].name,
                round + 1,
                rounds.warmup + rounds.rounds,
                rounds.warmup
            ));
            ev.run_with(&none, ext)
                .map_err(|e| format!("{}: {e}", jobs[j].name))?;
            if round >= rounds.warmup {
                let steps = rounds.steps.max(1) as f64;
                if let Some(t) = ev.backend().last_run_us() {
                    out[j].times_us.push(t / steps);
                }
                if let Some(h) = ev.host_us_per_step() {
                    out[j].host_us.push(h);
                }
            }
        }
        if rank == 0 && round >= rounds.warmup {
            tracing::info!(
                "bench: round {}/{} done",
                round + 1 - rounds.warmup,
                rounds.rounds
            );
        }
    }
    cx.at(format_args!("releasing the case's backends"));
    drop(evs);
    Ok(out)
}

/// Runs the worker; on failure tells the other ranks (abort signal and rendezvous).
fn guarded(
    cx: &RankCtx,
    jobs: &[Job],
    sets: &[&BTreeMap<String, TensorData>],
    rounds: Rounds,
    checker: Checker<'_>,
) -> Result<Vec<RankMeasured>, String> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rank_worker(cx, jobs, sets, rounds, checker)
    }))
    .unwrap_or_else(|_| Err(format!("rank {}: the benchmark panicked", cx.rank)));
    if let Err(e) = &r {
        if !cx.abort.is_aborted() {
            cx.abort.abort(cx.rank, e.clone());
            cx.rdv.abort(&format!("rank {} failed: {e}", cx.rank));
        }
    }
    cx.progress.done(cx.slot);
    r
}

/// Aborts a case whose rank `rank` stalled (every wait of meshflow's own ends with the
/// reason).
fn abort_stalled(abort: &AbortSignal, rdv: &dyn Rendezvous, rank: DeviceId, stall: &Stall) {
    let why = format!("{stall} (a peer or the device stopped answering)");
    tracing::warn!("bench: {why}: aborting the case");
    abort.abort(rank, why.clone());
    rdv.abort(&why);
}

/// The end of a watch that gave up: a rank thread is blocked where no abort reaches (inside
/// NCCL). The process cannot end the thread; it ends itself with the reason instead of
/// hanging.
fn give_up(stall: &Stall) -> ! {
    tracing::error!(
        "bench: {stall}, and the rank did not return {} s after the abort (blocked inside a \
         library call): ending the process",
        STALL_GRACE.as_secs()
    );
    std::process::exit(3)
}

fn this_rank<'a>(
    sets: &'a InputSets,
    rank: DeviceId,
    empty: &'a BTreeMap<String, TensorData>,
) -> Vec<&'a BTreeMap<String, TensorData>> {
    sets.iter().map(|s| s.get(&rank).unwrap_or(empty)).collect()
}

/// Combines the ranks' figures per job.
fn combine(per_rank: Vec<Vec<RankMeasured>>, jobs: usize) -> Vec<Measured> {
    let mut out = vec![Measured::default(); jobs];
    for m in &mut out {
        m.error = f64::NAN;
    }
    for rank in per_rank {
        for (j, r) in rank.into_iter().enumerate().take(jobs) {
            out[j].times_us.push(r.times_us);
            out[j].host_us.push(r.host_us);
            if !r.error.is_nan() {
                out[j].error = if out[j].error.is_nan() {
                    r.error
                } else {
                    out[j].error.max(r.error)
                };
            }
        }
    }
    out
}

/// Measures `jobs` on GPUs `0..world` of this process, one thread per rank.
pub(crate) fn measure_in_process(
    world: usize,
    jobs: &[Job],
    sets: &InputSets,
    rounds: Rounds,
    config: &CudaConfig,
    checker: Checker<'_>,
) -> Result<Vec<Measured>, String> {
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new(case_namespace("bench")));
    let abort = AbortSignal::new();
    let hubs: Vec<Arc<PeerHub>> = jobs.iter().map(|_| PeerHub::new()).collect();
    let progress = Arc::new(Progress::new(world));
    let empty = BTreeMap::new();
    let results: Vec<Result<Vec<RankMeasured>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let cx = RankCtx {
                    rank,
                    world,
                    ordinal: rank,
                    rdv: rdv.clone(),
                    abort: abort.clone(),
                    hubs: hubs.clone(),
                    config: config.clone(),
                    progress: progress.clone(),
                    slot: rank,
                };
                let mine = this_rank(sets, rank, &empty);
                std::thread::Builder::new()
                    .name(format!("meshflow-bench-rank-{rank}"))
                    .spawn_scoped(scope, move || guarded(&cx, jobs, &mine, rounds, checker))
            })
            .collect();
        let finished = || {
            handles
                .iter()
                .all(|h| h.as_ref().map_or(true, |h| h.is_finished()))
        };
        let watched = watch(
            &progress,
            config.timeout + STALL_MARGIN,
            STALL_GRACE,
            finished,
            |s| abort_stalled(&abort, rdv.as_ref(), s.slot, s),
        );
        if let Err(stall) = watched {
            give_up(&stall);
        }
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err("a rank thread panicked".into())),
                Err(e) => Err(format!("could not start a rank thread: {e}")),
            })
            .collect()
    });
    // The case's communicators end with it (see the module's documentation); after a failure
    // the ranks may also disagree about which communicators are healthy.
    clear_communicator_cache();
    let mut per_rank = Vec::new();
    for r in results {
        match r {
            Ok(m) => per_rank.push(m),
            Err(e) => {
                return Err(abort.first().map_or(e, |(rank, why)| {
                    if why.contains(&format!("rank {rank}")) {
                        why
                    } else {
                        format!("rank {rank}: {why}")
                    }
                }));
            }
        }
    }
    Ok(combine(per_rank, jobs.len()))
}

fn encode(m: &[RankMeasured]) -> Vec<u8> {
    let f = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
    let rows: Vec<Value> = m
        .iter()
        .map(|r| {
            json!({
                "times_us": r.times_us.iter().copied().map(f).collect::<Vec<_>>(),
                "host_us": r.host_us.iter().copied().map(f).collect::<Vec<_>>(),
                "error": f(r.error),
            })
        })
        .collect();
    Value::Array(rows).to_string().into_bytes()
}

fn decode(b: &[u8]) -> Result<Vec<RankMeasured>, String> {
    let v: Value = serde_json::from_slice(b).map_err(|e| format!("a rank's figures: {e}"))?;
    let nums = |v: &Value| -> Vec<f64> {
        v.as_array()
            .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
            .unwrap_or_default()
    };
    Ok(v.as_array()
        .map(|a| {
            a.iter()
                .map(|r| RankMeasured {
                    times_us: nums(&r["times_us"]),
                    host_us: nums(&r["host_us"]),
                    error: r["error"].as_f64().unwrap_or(f64::NAN),
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Measures `jobs` with one process per GPU: this process runs its rank; every rank gets
/// every rank's figures (rank 0 reports them).
pub(crate) fn measure_launched(
    launched: &Launched,
    jobs: &[Job],
    sets: &InputSets,
    rounds: Rounds,
    config: &CudaConfig,
    checker: Checker<'_>,
) -> Result<Vec<Measured>, String> {
    let store = launched.scope();
    let rdv: Arc<dyn Rendezvous> = Arc::new(Scoped::renamed(
        store.clone(),
        case_namespace(store.namespace()),
    ));
    let (rank, world) = (launched.rank(), launched.world());
    let cx = RankCtx {
        rank,
        world,
        ordinal: launched.local_rank(),
        rdv: rdv.clone(),
        abort: AbortSignal::new(),
        hubs: Vec::new(),
        config: config.clone(),
        progress: Arc::new(Progress::new(1)),
        slot: 0,
    };
    let empty = BTreeMap::new();
    let mine_sets = this_rank(sets, rank, &empty);
    // This rank runs on a thread of its own, watched from here like an in-process rank.
    let mine = std::thread::scope(|scope| {
        let h = std::thread::Builder::new()
            .name(format!("meshflow-bench-rank-{rank}"))
            .spawn_scoped(scope, || guarded(&cx, jobs, &mine_sets, rounds, checker))
            .map_err(|e| format!("could not start the rank thread: {e}"))?;
        let watched = watch(
            &cx.progress,
            config.timeout + STALL_MARGIN,
            STALL_GRACE,
            || h.is_finished(),
            |s| abort_stalled(&cx.abort, rdv.as_ref(), rank, s),
        );
        if let Err(stall) = watched {
            give_up(&stall);
        }
        h.join()
            .unwrap_or_else(|_| Err("the rank thread panicked".into()))
    })
    .inspect_err(|_| clear_communicator_cache())?;
    let err = |e: RendezvousError| format!("sharing the figures: {e}");
    rdv.publish(&format!("figures/{rank}"), &encode(&mine))
        .map_err(err)?;
    let mut per_rank = Vec::with_capacity(world);
    for r in 0..world {
        let b = rdv
            .fetch(&format!("figures/{r}"), config.timeout)
            .map_err(err)?;
        per_rank.push(decode(&b)?);
    }
    rdv.barrier("figures/read", world, config.timeout)
        .map_err(err)?;
    // Every rank is done with the case: its communicators end with it (see the module's
    // documentation).
    clear_communicator_cache();
    Ok(combine(per_rank, jobs.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_survive_the_rendezvous_and_combine_per_job() {
        let a = vec![RankMeasured {
            times_us: vec![1.0, 2.0],
            host_us: vec![],
            error: 1e-3,
        }];
        let b = vec![RankMeasured {
            times_us: vec![3.0, f64::NAN],
            host_us: vec![0.5],
            error: f64::NAN,
        }];
        let back = decode(&encode(&b)).unwrap();
        assert_eq!(back[0].times_us[0], 3.0);
        assert!(back[0].times_us[1].is_nan() && back[0].error.is_nan());
        let m = combine(vec![a, back], 1);
        assert_eq!(m[0].times_us.len(), 2);
        assert_eq!(m[0].error, 1e-3);
    }
}
