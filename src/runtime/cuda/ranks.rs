//! Running host programs on GPUs: in-process with one thread per GPU ([`run_cuda`],
//! [`run_cuda_timed`]), or one rank of a multi-process run ([`run_rank`]).
//!
//! Multi-process runs follow torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the GPU),
//! `MASTER_ADDR` and `MASTER_PORT` (rank 0's TCP rendezvous store). The same variables on
//! several hosts, with `MASTER_ADDR` naming rank 0's host, give a multi-node run: NCCL finds
//! the inter-node transport itself (set `NCCL_SOCKET_IFNAME` / `NCCL_IB_HCA` as usual). Ranks
//! in processes of one host share GPU memory over CUDA IPC where they can, so their teams get
//! the copy-engine and NVLink MoE transports as the threads of one process do.
//!
//! With [`CudaConfig::node_size`] or `MESHFLOW_NODE_SIZE` the ranks form nodes of that many
//! consecutive ranks (also on one host, to test the inter-node path): every rank with a peer on
//! another node gets a host proxy (over the wire of [`CudaConfig::wire`], connected through
//! the rendezvous), and collective permutes and MoE dispatch/combine with such peers go
//! through it.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use meshflow_ir::{DeviceId, HostProgram};
use meshflow_kernels::proxy::{node_size_from_env, Proxy, ProxyStats, Topology};
use meshflow_kernels::{Device, KernelError};
use meshflow_passes::Transport;

use super::backend::CudaBackend;
use super::config::{AbortSignal, CudaConfig};
use super::profile::Interval;
use super::teams::clear_communicator_cache;
use super::transport::PeerHub;
use crate::runtime::cpu::fabric::Failure;
use crate::runtime::data::TensorData;
use crate::runtime::evaluator::{EvalOptions, Evaluator, RuntimeError, SelectedTransport};
use crate::runtime::multinode::{connect_proxies, NodeProxies, NodeSpec, DEFAULT_RING};
use crate::runtime::ranks::{RunError, RunFailure, RunInputs, RunOutcome};
use crate::runtime::rendezvous::{LocalRendezvous, Rendezvous, RendezvousError};
use crate::runtime::shard::scatter_inputs;
use crate::runtime::trace::Trace;

/// Options of an in-process GPU run.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Number of ranks (one GPU each); at least the program's world size (the default).
    pub ranks: Option<usize>,
    /// Backend settings (stream pool, timeout, profiling, kernels).
    pub config: CudaConfig,
}

/// Why a GPU run could not be made or failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CudaRunError {
    /// Scattering inputs, rank counts, or a rank's failure (as for the CPU backend).
    #[error(transparent)]
    Run(#[from] RunError),
    /// No CUDA driver or GPU.
    #[error("no GPU: {0}")]
    NoDevice(String),
    /// More ranks than GPUs.
    #[error("the run needs {needed} GPUs (one per rank), this machine has {available}")]
    TooFewDevices {
        /// Ranks requested.
        needed: usize,
        /// GPUs visible.
        available: usize,
    },
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The split into nodes is invalid, or connecting the host proxies failed.
    #[error("nodes: {0}")]
    Nodes(String),
}

/// A timed in-process run.
#[derive(Clone, Debug)]
pub struct TimedRun {
    /// Outputs of the last iteration (and its intervals as a trace in profiling mode).
    pub outcome: RunOutcome,
    /// Device time of every timed iteration, µs, per rank (`times_us[rank][iteration]`); with
    /// [`CudaConfig::steps`] > 1, the time of one step (the iteration's time / steps).
    pub times_us: Vec<Vec<f64>>,
    /// Intervals of the last iteration, every rank (profiling mode; empty otherwise).
    pub intervals: Vec<Interval>,
    /// Intervals of every timed iteration (`timed_intervals[iteration]`), every rank, in the
    /// order each rank recorded them (profiling mode; empty otherwise): for figures over more
    /// samples than the last iteration holds.
    pub timed_intervals: Vec<Vec<Interval>>,
    /// Host time per step of every timed iteration, µs, per rank (issuing the step's work,
    /// without waiting for the device; see [`Evaluator::host_us_per_step`]).
    pub host_us: Vec<Vec<f64>>,
    /// In runs split into nodes: the counters of every rank's host proxy (what crossed nodes).
    pub proxy_stats: BTreeMap<DeviceId, ProxyStats>,
    /// Per rank, every communication it posts and the transport selected for it.
    pub transports: BTreeMap<DeviceId, Vec<SelectedTransport>>,
    /// In runs split into nodes: the wire of the host proxies and why it was chosen.
    pub wire: Option<(&'static str, String)>,
}

/// One rank's result of [`run_rank`].
#[derive(Clone, Debug)]
pub struct RankRun {
    /// Outputs this rank holds (last iteration).
    pub outputs: BTreeMap<String, TensorData>,
    /// Device time of every timed iteration, µs.
    pub times_us: Vec<f64>,
    /// Intervals of the last iteration (profiling mode).
    pub intervals: Vec<Interval>,
    /// In runs split into nodes: the counters of this rank's host proxy.
    pub proxy_stats: Option<ProxyStats>,
    /// Every communication this rank posts and the transport selected for it.
    pub transports: Vec<SelectedTransport>,
    /// In runs split into nodes: the wire of this rank's host proxy and why it was chosen.
    pub wire: Option<(&'static str, String)>,
}

/// Number of visible GPUs, or why there are none.
pub fn device_count() -> Result<usize, CudaRunError> {
    match Device::count() {
        Ok(0) => Err(CudaRunError::NoDevice("the CUDA driver sees no GPU".into())),
        Ok(n) => Ok(n),
        Err(e @ KernelError::NoDevice(_)) => Err(CudaRunError::NoDevice(e.to_string())),
        Err(e) => Err(CudaRunError::NoDevice(e.to_string())),
    }
}

/// The GPU model the programs of this process are priced for
/// ([`Options::device`](crate::Options::device)): the name of device 0, as the driver gives it.
/// Every process of a host asks the same device, so the ranks a launcher starts on one host
/// lower the same plans.
pub fn target_device() -> Result<String, CudaRunError> {
    device_count()?;
    Device::name_of(0).map_err(|e| CudaRunError::NoDevice(e.to_string()))
}

/// In-process GPU runs use every GPU of the process: one at a time.
fn run_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

/// What [`iterate`] returns.
struct Iterated {
    /// The outputs of the last iteration.
    last: BTreeMap<String, TensorData>,
    /// Device µs per step of every timed iteration.
    times: Vec<f64>,
    /// Host µs per step of every timed iteration.
    host: Vec<f64>,
    /// The profile's intervals of every timed iteration (profiling mode; empty otherwise).
    intervals: Vec<Vec<Interval>>,
}

/// The iterations of one rank on a live evaluator: a barrier before each so the ranks start
/// together, then the run; device times of the timed ones.
#[allow(clippy::too_many_arguments)]
fn iterate(
    ev: &mut Evaluator<'_, CudaBackend>,
    rank: DeviceId,
    world: usize,
    inputs: &BTreeMap<String, TensorData>,
    rdv: &dyn Rendezvous,
    config: &CudaConfig,
    warmup: usize,
    iterations: usize,
) -> Result<Iterated, RuntimeError> {
    let mut times = Vec::with_capacity(iterations);
    let mut host = Vec::with_capacity(iterations);
    let mut intervals = Vec::new();
    let mut last = BTreeMap::new();
    for it in 0..warmup + iterations.max(1) {
        rdv.barrier(&format!("meshflow/iteration/{it}"), world, config.timeout)
            .map_err(|e| RuntimeError::Backend {
                rank,
                source: match e {
                    RendezvousError::Aborted(reason) => {
                        crate::runtime::backend::BackendError::Aborted {
                            failed_rank: rank,
                            reason,
                        }
                    }
                    RendezvousError::Lost { rank: lost, reason } => {
                        crate::runtime::backend::BackendError::Aborted {
                            failed_rank: lost,
                            reason: format!("rank {lost} stopped ({reason})"),
                        }
                    }
                    e => crate::runtime::backend::BackendError::Invalid(e.to_string()),
                },
            })?;
        last = match catch_unwind(AssertUnwindSafe(|| ev.run(inputs))) {
            Ok(r) => r?,
            Err(p) => {
                return Err(RuntimeError::Panic {
                    rank,
                    position: ev.position(),
                    message: panic_message(p.as_ref()),
                })
            }
        };
        if it >= warmup {
            if let Some(t) = ev.backend().last_run_us() {
                times.push(t / config.steps.max(1) as f64);
            }
            if let Some(h) = ev.host_us_per_step() {
                host.push(h);
            }
            if config.profile {
                intervals.push(ev.backend().intervals().to_vec());
            }
        }
    }
    Ok(Iterated {
        last,
        times,
        host,
        intervals,
    })
}

/// What one rank of a launch returns.
struct RankOutput {
    outputs: BTreeMap<String, TensorData>,
    times_us: Vec<f64>,
    intervals: Vec<Interval>,
    timed_intervals: Vec<Vec<Interval>>,
    host_us: Vec<f64>,
    transports: Vec<SelectedTransport>,
}

type RankResult = Result<RankOutput, RuntimeError>;

/// Runs one rank: backend, evaluator, iterations. On failure, tells the others.
#[allow(clippy::too_many_arguments)]
fn rank_main(
    host: &HostProgram,
    rank: DeviceId,
    ordinal: usize,
    world: usize,
    inputs: &BTreeMap<String, TensorData>,
    rdv: Arc<dyn Rendezvous>,
    abort: &AbortSignal,
    config: &CudaConfig,
    warmup: usize,
    iterations: usize,
    hub: Option<Arc<PeerHub>>,
    proxy: Option<(Arc<Proxy>, Topology)>,
    ipc: bool,
) -> RankResult {
    let notifier = proxy.as_ref().map(|(p, _)| p.clone());
    let fail = |e: &RuntimeError| {
        if !e.is_abort() {
            abort.abort(rank, e.to_string());
            rdv.abort(&format!("rank {rank} failed: {e}"));
            if let Some(p) = &notifier {
                p.notify_failure(rank, &e.to_string());
            }
        }
    };
    let backend = CudaBackend::new(
        rank,
        ordinal,
        config.clone(),
        Some(rdv.clone()),
        Some(abort.clone()),
    )
    .map_err(|source| RuntimeError::Backend { rank, source });
    let backend = match backend {
        Ok(mut b) => {
            b.set_start_barrier(world);
            if let Some(h) = hub {
                b.set_peer_hub(h);
            }
            if !ipc {
                b.disable_ipc_peers();
            }
            if let Some((p, topology)) = proxy {
                b.set_proxy(p, topology);
            }
            b
        }
        Err(e) => {
            fail(&e);
            return Err(e);
        }
    };
    let mut ev = match Evaluator::new(host, backend, EvalOptions::default()) {
        Ok(mut ev) => {
            ev.set_steps(config.steps);
            ev.set_graph(config.graph);
            ev
        }
        Err(e) => {
            fail(&e);
            return Err(e);
        }
    };
    match iterate(
        &mut ev,
        rank,
        world,
        inputs,
        rdv.as_ref(),
        config,
        warmup,
        iterations,
    ) {
        Ok(it) => Ok(RankOutput {
            outputs: it.last,
            times_us: it.times,
            intervals: ev.backend().intervals().to_vec(),
            timed_intervals: it.intervals,
            host_us: it.host,
            transports: ev.comm_transports(),
        }),
        Err(e) => {
            fail(&e);
            ev.backend_mut().mark_failed();
            Err(e)
        }
    }
}

/// The nodes of a run of `world` ranks: [`CudaConfig::node_size`], else
/// `MESHFLOW_NODE_SIZE`; `None` when every rank is on one node.
fn nodes_of(world: usize, config: &CudaConfig) -> Result<Option<Topology>, CudaRunError> {
    let size = match config.node_size {
        Some(n) => Some(n),
        None => node_size_from_env().map_err(|e| CudaRunError::Nodes(e.to_string()))?,
    };
    let Some(size) = size else {
        return Ok(None);
    };
    let topology =
        Topology::contiguous(world, size).map_err(|e| CudaRunError::Nodes(e.to_string()))?;
    if topology.nodes() < 2 {
        return Ok(None);
    }
    if let Some(t @ (Transport::CopyEngine | Transport::Nvlink)) = config.transport {
        return Err(CudaRunError::Nodes(format!(
            "the {t} transport cannot reach ranks of other nodes ({world} ranks in nodes of \
             {size}); use the NCCL or automatic transport"
        )));
    }
    Ok(Some(topology))
}

/// The host proxies of a launch's ranks and their wire.
#[derive(Default)]
struct Proxies {
    by_rank: BTreeMap<DeviceId, Arc<Proxy>>,
    /// The wire's name and why it was chosen.
    wire: Option<(&'static str, String)>,
}

/// Connects the host proxies of `ranks` (those with a peer on another node) through `rdv`,
/// listening on `host`, over the wire of `config`.
fn connect_nodes(
    topology: &Topology,
    ranks: &[DeviceId],
    host: &str,
    rdv: &Arc<dyn Rendezvous>,
    config: &CudaConfig,
) -> Result<Proxies, CudaRunError> {
    let spec = NodeSpec {
        node: 0,
        topology: topology.clone(),
        host: host.to_string(),
        ring: DEFAULT_RING,
        setup_timeout: config.timeout,
        wire: config.wire,
    };
    let NodeProxies { proxies, reason } =
        connect_proxies(&spec, ranks, rdv).map_err(CudaRunError::Nodes)?;
    let wire = proxies.values().next().map(|p| (p.wire_name(), reason));
    Ok(Proxies {
        by_rank: proxies.into_iter().map(|(r, p)| (r, Arc::new(p))).collect(),
        wire,
    })
}

/// Runs `host` on GPUs `0..ranks` of this process, one thread per GPU (rank `r` on GPU `r`),
/// and returns every rank's outputs, like [`run_cpu`](crate::runtime::run_cpu). With
/// [`CudaConfig::profile`] the trace holds one event per compute op and communication, with
/// device timestamps.
pub fn run_cuda(
    host: &HostProgram,
    inputs: RunInputs<'_>,
    options: &CudaOptions,
) -> Result<RunOutcome, CudaRunError> {
    run_cuda_timed(host, inputs, options, 0, 1).map(|t| t.outcome)
}

/// [`run_cuda`] repeated: `warmup` untimed iterations, then `iterations` timed ones, on the
/// same backends (buffers and communicators are reused), with a barrier before each.
pub fn run_cuda_timed(
    host: &HostProgram,
    inputs: RunInputs<'_>,
    options: &CudaOptions,
    warmup: usize,
    iterations: usize,
) -> Result<TimedRun, CudaRunError> {
    let needed = host.world_size();
    let world = options.ranks.unwrap_or(needed);
    if world < needed || world == 0 {
        return Err(RunError::TooFewRanks {
            needed: needed.max(1),
            given: world,
        }
        .into());
    }
    let available = device_count()?;
    if world > available {
        return Err(CudaRunError::TooFewDevices {
            needed: world,
            available,
        });
    }
    let per_rank = match inputs {
        RunInputs::PerRank(m) => m,
        RunInputs::Full { program, inputs } => {
            scatter_inputs(program, inputs).map_err(RunError::from)?
        }
    };
    let _guard = run_lock();
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("inproc"));
    let abort = AbortSignal::new();
    let topology = nodes_of(world, &options.config)?;
    let ranks: Vec<DeviceId> = (0..world).collect();
    let proxies = match &topology {
        Some(t) => connect_nodes(t, &ranks, "127.0.0.1", &rdv, &options.config)?,
        None => Proxies::default(),
    };
    // The copy-engine hub serves runs on one node only.
    let hub = topology.is_none().then(PeerHub::new);
    let start = Instant::now();
    let empty = BTreeMap::new();
    let config = &options.config;
    let results: Vec<(DeviceId, Option<RankResult>)> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world);
        for rank in 0..world {
            let inputs = per_rank.get(&rank).unwrap_or(&empty);
            let (rank_rdv, abort, hub) = (rdv.clone(), &abort, hub.clone());
            let proxy = proxies
                .by_rank
                .get(&rank)
                .zip(topology.as_ref())
                .map(|(p, t)| (p.clone(), t.clone()));
            let spawned = std::thread::Builder::new()
                .name(format!("meshflow-cuda-rank-{rank}"))
                .spawn_scoped(scope, move || {
                    // Every rank is a thread of this process: no CUDA IPC.
                    rank_main(
                        host, rank, rank, world, inputs, rank_rdv, abort, config, warmup,
                        iterations, hub, proxy, false,
                    )
                });
            match spawned {
                Ok(h) => handles.push((rank, Some(h))),
                Err(e) => {
                    abort.abort(rank, format!("could not start its thread: {e}"));
                    rdv.abort(&format!("rank {rank} could not start"));
                    handles.push((rank, None));
                }
            }
        }
        handles
            .into_iter()
            .map(|(rank, h)| (rank, h.and_then(|h| h.join().ok())))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut outputs = BTreeMap::new();
    let mut times_us = Vec::with_capacity(world);
    let mut intervals = Vec::new();
    let mut timed_intervals: Vec<Vec<Interval>> = Vec::new();
    let mut host_us = Vec::with_capacity(world);
    let mut transports = BTreeMap::new();
    let mut errors = Vec::new();
    for (rank, r) in results {
        match r {
            Some(Ok(out)) => {
                outputs.insert(rank, out.outputs);
                times_us.push(out.times_us);
                intervals.extend(out.intervals);
                for (i, iv) in out.timed_intervals.into_iter().enumerate() {
                    if timed_intervals.len() <= i {
                        timed_intervals.resize_with(i + 1, Vec::new);
                    }
                    timed_intervals[i].extend(iv);
                }
                host_us.push(out.host_us);
                transports.insert(rank, out.transports);
            }
            Some(Err(e)) => errors.push(e),
            None => errors.push(RuntimeError::Panic {
                rank,
                position: String::new(),
                message: "the rank thread did not start or could not be joined".into(),
            }),
        }
    }
    if !errors.is_empty() {
        // The ranks may disagree about which communicators are healthy: start afresh.
        clear_communicator_cache();
        let first = abort.first().map(|(rank, reason)| Failure { rank, reason });
        return Err(RunError::Failed(RunFailure {
            first,
            errors,
            undelivered: Vec::new(),
        })
        .into());
    }
    intervals.sort_by(|a, b| {
        (a.rank, a.start_us)
            .partial_cmp(&(b.rank, b.start_us))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let trace = config.profile.then(|| Trace {
        events: intervals.iter().map(Interval::to_trace_event).collect(),
    });
    let proxy_stats = proxies
        .by_rank
        .iter()
        .map(|(&r, p)| (r, p.stats()))
        .collect();
    Ok(TimedRun {
        outcome: RunOutcome {
            outputs,
            trace,
            elapsed,
        },
        times_us,
        intervals,
        timed_intervals,
        host_us,
        proxy_stats,
        transports,
        wire: proxies.wire,
    })
}

/// Runs one rank of a multi-process run: this process is `rank` of `world` and uses GPU
/// `ordinal`; `inputs` are the local tensors of this rank. On failure the rendezvous is
/// aborted so the other ranks stop waiting at their next rendezvous operation (a launcher such
/// as `meshflow launch` also terminates them).
#[allow(clippy::too_many_arguments)]
pub fn run_rank(
    host: &HostProgram,
    rank: DeviceId,
    world: usize,
    ordinal: usize,
    inputs: &BTreeMap<String, TensorData>,
    rendezvous: Arc<dyn Rendezvous>,
    config: &CudaConfig,
    warmup: usize,
    iterations: usize,
) -> Result<RankRun, CudaRunError> {
    let abort = AbortSignal::new();
    let topology = nodes_of(world, config)?;
    // One process per rank on one node: the ranks share GPU memory over CUDA IPC where they
    // can (a run split into nodes keeps each node's peers on NCCL).
    let ipc = topology.is_none();
    let (proxy, wire) = match topology {
        Some(topology) => {
            let host_addr = proxy_host();
            let mut p = connect_nodes(&topology, &[rank], &host_addr, &rendezvous, config)?;
            (p.by_rank.remove(&rank).map(|p| (p, topology)), p.wire)
        }
        None => (None, None),
    };
    let held = proxy.as_ref().map(|(p, _)| p.clone());
    let ran = rank_main(
        host,
        rank,
        ordinal,
        world,
        inputs,
        rendezvous.clone(),
        &abort,
        config,
        warmup,
        iterations,
        None,
        proxy,
        ipc,
    );
    if let (Ok(_), Some(p)) = (&ran, &held) {
        if let Err(e) = p.flush(config.timeout) {
            tracing::warn!(rank, "proxy flush: {e}");
        }
        // Keep this rank's proxy up until every rank has run (a rank that leaves early would
        // close links the others may still read from).
        rendezvous.barrier("meshflow/proxy/ran", world, config.timeout)?;
    }
    let proxy_stats = held.as_ref().map(|p| p.stats());
    ran.map(|out| RankRun {
        outputs: out.outputs,
        times_us: out.times_us,
        intervals: out.intervals,
        proxy_stats,
        transports: out.transports,
        wire,
    })
    .map_err(|e| {
        RunError::Failed(RunFailure {
            first: Some(Failure {
                rank,
                reason: e.to_string(),
            }),
            errors: vec![e],
            undelivered: Vec::new(),
        })
        .into()
    })
}

/// The address this process's proxy listens on in a multi-process run: the one that reaches
/// `MASTER_ADDR` (another host's rank 0), else the loopback address.
fn proxy_host() -> String {
    match (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) {
        (Ok(addr), Ok(port)) => {
            crate::runtime::multinode::local_address_toward(&format!("{addr}:{port}"))
        }
        _ => "127.0.0.1".to_string(),
    }
}
