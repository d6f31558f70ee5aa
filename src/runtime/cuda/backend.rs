//! [`CudaBackend`]: the [`Backend`] of one rank on one GPU.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshflow_ir::{ComputeOp, DType, DeviceId};
use meshflow_kernels::nccl::{self, Comm, NcclLib};
use meshflow_kernels::{Device, DeviceBuffer, Event, KernelError, Kernels, Stream, UserKernel};

use super::memory::{CudaBuffer, Memory};
use super::peer::{CopyStream, CudaTransport, PeerHub};
use super::profile::{Interval, IntervalKind, Timeline};
use super::teams::{self, TeamKey};
use super::user_kernels::CudaKernels;
use crate::runtime::backend::{
    Backend, BackendError, CommRequest, InstCtx, KernelId, PlanInfo, StreamIndex, TensorView,
};
use crate::runtime::data::TensorData;
use crate::runtime::rendezvous::Rendezvous;

/// Settings of the CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// Worker streams per rank (the main stream comes on top).
    pub stream_pool: usize,
    /// How long the host waits for the device at the end of a run, and for peers in the
    /// rendezvous, before giving up with an error.
    pub timeout: Duration,
    /// Record one [`Interval`] per compute op and communication.
    pub profile: bool,
    /// Kernels for `call_kernel`.
    pub kernels: CudaKernels,
    /// How collective permutes and broadcasts move (copy engine between in-process ranks by
    /// default, NCCL otherwise).
    pub transport: CudaTransport,
    /// Which stream runs copy-engine pulls.
    pub copy_stream: CopyStream,
    /// Host program steps per run of an in-process run ([`run_cuda_timed`](super::run_cuda_timed)):
    /// the program body runs this many times back to back between one upload of the inputs
    /// and one download of the outputs, and the run's device time is divided by it (at least 1).
    pub steps: usize,
    /// Record one step as a CUDA graph per run and replay it `steps` times (NCCL transport
    /// only; see [`Backend::begin_graph`]).
    pub graph: bool,
    /// Split the ranks of a run into nodes of this many consecutive ranks: collective
    /// permutes and MoE dispatch/combine between ranks of different nodes go through the
    /// inter-node host proxy over TCP, the rest stays on NCCL. `None`: `MESHFLOW_NODE_SIZE`
    /// when it is set, else one node.
    pub node_size: Option<usize>,
    /// Fault tests only: the process exits at once with
    /// [`FAULT_EXIT_STATUS`](crate::runtime::faults::FAULT_EXIT_STATUS) when this rank posts
    /// its n-th communication (0-based), as a killed process would.
    #[cfg(feature = "fault-injection")]
    pub exit_at_comm: Option<usize>,
}

impl Default for CudaConfig {
    fn default() -> CudaConfig {
        CudaConfig {
            stream_pool: 4,
            timeout: Duration::from_secs(120),
            profile: false,
            kernels: CudaKernels::new(),
            transport: CudaTransport::Auto,
            copy_stream: CopyStream::Current,
            steps: 1,
            graph: false,
            node_size: None,
            #[cfg(feature = "fault-injection")]
            exit_at_comm: None,
        }
    }
}

/// GPU resources the caller owns, for [`CudaBackend::with_resources`].
#[derive(Debug)]
pub struct CudaResources {
    /// The GPU (its primary context, the one the CUDA runtime and PyTorch use).
    pub device: Device,
    /// The caller's stream (see `Stream::from_raw_borrowed`): the rank's main stream, so the
    /// program runs in order with the caller's work on it. `None`: a stream of meshflow's.
    pub stream: Option<Stream>,
    /// Communicators the caller created (see `Comm::from_raw_borrowed`), each with the team it
    /// serves: the team's members (global ranks) in team order, its rank in the communicator
    /// being this rank's index there.
    pub comms: Vec<(Vec<DeviceId>, Comm)>,
}

/// A flag the ranks of one run share: set by the first rank that fails, so that the others
/// stop waiting for it (and abort their NCCL communicators) instead of hanging.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal {
    flag: Arc<AtomicBool>,
    first: Arc<Mutex<Option<(DeviceId, String)>>>,
}

impl AbortSignal {
    /// A signal that is not set.
    pub fn new() -> AbortSignal {
        AbortSignal::default()
    }

    /// Records that `rank` failed (the first report wins).
    pub fn abort(&self, rank: DeviceId, reason: impl Into<String>) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some((rank, reason.into()));
        }
        self.flag.store(true, Ordering::SeqCst);
    }

    /// Whether some rank failed.
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The first failure: rank and reason.
    pub fn first(&self) -> Option<(DeviceId, String)> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A posted communication: events on the streams it ran on, filled in when its coalescing
/// group ends (at once outside a group).
#[derive(Clone, Debug, Default)]
pub struct CudaComm {
    events: Rc<RefCell<Option<Vec<Rc<Event>>>>>,
}

/// An output written through a packed temporary and copied into its strided view afterwards.
#[derive(Debug)]
pub(super) struct Unstage {
    pub stream: usize,
    pub temp: DeviceBuffer,
    pub dst: TensorView<CudaBuffer>,
}

/// An open coalescing group.
#[derive(Debug, Default)]
pub(super) struct Group {
    pub members: Vec<CudaComm>,
    pub unstage: Vec<Unstage>,
    pub streams: Vec<usize>,
    pub temps: Vec<DeviceBuffer>,
}

/// The views a communication writes.
fn request_outputs<'a>(request: &CommRequest<'a, CudaBuffer>) -> Vec<&'a TensorView<CudaBuffer>> {
    match request {
        CommRequest::Collective { output, .. } => output.iter().copied().collect(),
        CommRequest::Permute { output, .. } => vec![*output],
        CommRequest::MoeDispatch {
            expert_x,
            expert_counts,
            routing,
            ..
        } => vec![*expert_x, *expert_counts, *routing],
        CommRequest::MoeCombine { out, .. } => vec![*out],
    }
}

/// Turns a kernels-crate error into a backend error naming the rank and the operation; a lost
/// or failed peer behind the host proxy is reported as that peer's failure.
pub(super) fn dev_err(rank: DeviceId, call: &str, e: KernelError) -> BackendError {
    use meshflow_kernels::proxy::ProxyError;
    match e {
        KernelError::Proxy(ProxyError::PeerLost { peer, reason }) => BackendError::Aborted {
            failed_rank: peer,
            reason: format!("rank {peer} (another node) was lost during {call}: {reason}"),
        },
        KernelError::Proxy(ProxyError::Aborted { rank, reason }) => BackendError::Aborted {
            failed_rank: rank,
            reason,
        },
        KernelError::Proxy(ProxyError::Timeout { peer, waited, what }) => BackendError::Timeout {
            peer,
            waited,
            what: format!("{call} (through the host proxy: {what})"),
        },
        e => BackendError::Device {
            rank,
            call: call.to_owned(),
            message: e.to_string(),
        },
    }
}

/// The CUDA backend of one rank: device `ordinal`, a main stream and a pool of worker streams,
/// a caching allocator, one NCCL communicator per team, and optional profiling.
pub struct CudaBackend {
    pub(super) rank: DeviceId,
    pub(super) device: Device,
    pub(super) kernels: Kernels,
    pub(super) streams: Vec<Stream>,
    pub(super) current: usize,
    pub(super) memory: Memory,
    pub(super) config: CudaConfig,
    rendezvous: Option<Arc<dyn Rendezvous>>,
    pub(super) abort: Option<AbortSignal>,
    pub(super) nccl: Option<Arc<NcclLib>>,
    pub(super) comms: Vec<(TeamKey, Comm)>,
    pub(super) team_comm: Vec<usize>,
    pub(super) group: Option<Group>,
    /// Temporaries of the op being issued, retired after it.
    pub(super) scratch: Vec<DeviceBuffer>,
    pub(super) timeline: Timeline,
    user: Vec<Option<UserKernel>>,
    pub(super) moe: Vec<super::moe::MoeEngine>,
    pub(super) moe_last: Option<usize>,
    start_barrier: Option<usize>,
    runs: u64,
    /// Communications posted by this backend (for [`CudaConfig::exit_at_comm`]).
    posted: usize,
    failed: bool,
    /// The copy-engine hub of an in-process run.
    pub(super) hub: Option<Arc<PeerHub>>,
    /// Per team slot: the team moves permutes and broadcasts over the copy engine.
    pub(super) team_ce: Vec<bool>,
    /// Per communication label: instances posted so far over the copy engine.
    pub(super) ce_seq: std::collections::HashMap<usize, u64>,
    /// The stream of copy-engine pulls ([`CopyStream::Dedicated`]).
    pub(super) copy_stream: Stream,
    /// A stream that only waits for peers' reads of this rank's memory (copy-engine sends), so
    /// that releases and the end of a run are ordered after them.
    pub(super) peer_reads: Stream,
    /// Per buffer: peers' reads of it (copy-engine sends) that later writes must wait for.
    #[allow(clippy::type_complexity)]
    pub(super) pending_reads: std::collections::HashMap<CudaBuffer, Vec<((u64, u64), Rc<Event>)>>,
    /// The graph being recorded or replayed in this run, and whether profiling was on before.
    graph: Option<GraphState>,
    /// This rank's host proxy to ranks of other nodes, with the run's nodes.
    pub(super) proxy: Option<super::proxy::ProxyAccess>,
    /// Per team crossing nodes: this rank's route for its collective permutes.
    pub(super) routes: Vec<(Vec<DeviceId>, meshflow_kernels::proxy::StagedRoute)>,
}

/// A step recorded as a graph: recording (`exec` empty) or replayed (until the run ends).
#[derive(Debug)]
struct GraphState {
    exec: Option<meshflow_kernels::Graph>,
    profile: bool,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("rank", &self.rank)
            .field("device", &self.device.ordinal())
            .field("streams", &self.streams.len())
            .field("teams", &self.comms.len())
            .finish()
    }
}

impl CudaBackend {
    /// The backend of `rank` on GPU `ordinal`. `rendezvous` is needed as soon as a team has
    /// more than one member; `abort` lets the ranks of a run stop each other.
    pub fn new(
        rank: DeviceId,
        ordinal: usize,
        config: CudaConfig,
        rendezvous: Option<Arc<dyn Rendezvous>>,
        abort: Option<AbortSignal>,
    ) -> Result<CudaBackend, BackendError> {
        let device = Device::new(ordinal).map_err(|e| dev_err(rank, "cuDeviceGet", e))?;
        CudaBackend::on_device(rank, device, None, config, rendezvous, abort)
    }

    /// The backend of `rank` on the caller's resources (see [`CudaResources`]): its stream is
    /// the main stream, its communicators serve their teams (borrowed ones are never aborted,
    /// destroyed or cached here), and caller-owned buffers are lent with
    /// [`CudaBackend::import`]. Teams without a communicator are created through `rendezvous`
    /// as with [`CudaBackend::new`].
    pub fn with_resources(
        rank: DeviceId,
        resources: CudaResources,
        config: CudaConfig,
        rendezvous: Option<Arc<dyn Rendezvous>>,
        abort: Option<AbortSignal>,
    ) -> Result<CudaBackend, BackendError> {
        let CudaResources {
            device,
            stream,
            comms,
        } = resources;
        let mut b = CudaBackend::on_device(rank, device, stream, config, rendezvous, abort)?;
        let namespace = b.namespace();
        for (members, comm) in comms {
            let invalid = |m: String| BackendError::Invalid(format!("rank {rank}: {m}"));
            let my_index = members.iter().position(|&m| m == rank).ok_or_else(|| {
                invalid(format!(
                    "a communicator is given for team {members:?}, without this rank"
                ))
            })?;
            if comm.size() != members.len() || comm.rank() != my_index {
                return Err(invalid(format!(
                    "the communicator given for team {members:?} has rank {} of {}, not {my_index} \
                     of {}",
                    comm.rank(),
                    comm.size(),
                    members.len()
                )));
            }
            if !comm.device().same_as(&b.device) {
                return Err(invalid(format!(
                    "the communicator given for team {members:?} is on GPU {}, not {}",
                    comm.device().ordinal(),
                    b.device.ordinal()
                )));
            }
            b.nccl.get_or_insert_with(|| comm.lib().clone());
            let key = TeamKey {
                namespace: namespace.clone(),
                ordinal: b.device.ordinal(),
                members,
            };
            b.comms.retain(|(k, _)| *k != key);
            b.comms.push((key, comm));
        }
        Ok(b)
    }

    /// Lends the caller's device memory `data` (elements of `dtype`) to the program as a
    /// buffer, used in place; [`Backend::deallocate`] ends the loan (nothing is freed).
    pub fn import(&mut self, data: DeviceBuffer, dtype: DType) -> Result<CudaBuffer, BackendError> {
        if !data.device().same_as(&self.device) {
            return Err(BackendError::Invalid(format!(
                "rank {}: a caller buffer on GPU {} lent to the backend of GPU {}",
                self.rank,
                data.device().ordinal(),
                self.device.ordinal()
            )));
        }
        self.memory
            .import(data, dtype)
            .map_err(self.err("importing a caller buffer"))
    }

    fn on_device(
        rank: DeviceId,
        device: Device,
        main: Option<Stream>,
        config: CudaConfig,
        rendezvous: Option<Arc<dyn Rendezvous>>,
        abort: Option<AbortSignal>,
    ) -> Result<CudaBackend, BackendError> {
        let pool = config.stream_pool.max(1);
        let mut streams = Vec::with_capacity(pool + 1);
        if let Some(main) = main {
            if !main.device().same_as(&device) {
                return Err(BackendError::Invalid(format!(
                    "rank {rank}: the caller's stream is on GPU {}, not {}",
                    main.device().ordinal(),
                    device.ordinal()
                )));
            }
            streams.push(main);
        }
        while streams.len() <= pool {
            streams.push(Stream::new(&device).map_err(|e| dev_err(rank, "cuStreamCreate", e))?);
        }
        let timeline = Timeline::new(config.profile);
        let copy_stream = Stream::new(&device).map_err(|e| dev_err(rank, "cuStreamCreate", e))?;
        let peer_reads = Stream::new(&device).map_err(|e| dev_err(rank, "cuStreamCreate", e))?;
        Ok(CudaBackend {
            rank,
            kernels: Kernels::new(&device),
            memory: Memory::new(&device),
            device,
            streams,
            current: 0,
            user: vec![None; config.kernels.defs.len()],
            config,
            rendezvous,
            abort,
            nccl: None,
            comms: Vec::new(),
            team_comm: Vec::new(),
            group: None,
            scratch: Vec::new(),
            timeline,
            moe: Vec::new(),
            moe_last: None,
            start_barrier: None,
            runs: 0,
            posted: 0,
            failed: false,
            hub: None,
            team_ce: Vec::new(),
            ce_seq: std::collections::HashMap::new(),
            copy_stream,
            peer_reads,
            pending_reads: std::collections::HashMap::new(),
            graph: None,
            proxy: None,
            routes: Vec::new(),
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Device {
        &self.device
    }

    /// Device time of the last finished run in µs, from an event at its start (its first
    /// instruction that reaches the device, after the inputs are uploaded and, with
    /// [`set_start_barrier`](Self::set_start_barrier), after every rank got there) to one after
    /// all its streams were done.
    pub fn last_run_us(&self) -> Option<f64> {
        self.timeline.last_run_us
    }

    /// The intervals of the last finished run (profiling mode; empty otherwise).
    pub fn intervals(&self) -> &[Interval] {
        &self.timeline.intervals
    }

    /// Switches profiling on or off for later runs.
    pub fn set_profiling(&mut self, on: bool) {
        self.timeline.profile = on;
    }

    /// Marks this rank as failed: its communicators are aborted (not cached) when it is
    /// dropped, and nothing waits for its pending device work.
    pub fn mark_failed(&mut self) {
        self.failed = true;
    }

    /// Marks this rank as failed and tells the other ranks of the run, through the abort
    /// signal and the rendezvous it was given, so that they stop instead of waiting for it.
    pub fn signal_failure(&mut self, reason: &str) {
        self.failed = true;
        if let Some(a) = &self.abort {
            a.abort(self.rank, reason.to_string());
        }
        if let Some(r) = &self.rendezvous {
            r.abort(&format!("rank {} failed: {reason}", self.rank));
        }
    }

    /// The rendezvous namespace (keys the communicator cache).
    pub(super) fn namespace(&self) -> String {
        self.rendezvous
            .as_ref()
            .map(|r| r.namespace().to_owned())
            .unwrap_or_else(|| "local".into())
    }

    /// The rendezvous, if any.
    pub(super) fn rendezvous(&self) -> Option<&Arc<dyn Rendezvous>> {
        self.rendezvous.as_ref()
    }

    pub(super) fn stream(&self) -> &Stream {
        &self.streams[self.current]
    }

    pub(super) fn err(&self, call: &str) -> impl Fn(KernelError) -> BackendError {
        let rank = self.rank;
        let call = call.to_owned();
        move |e| dev_err(rank, &call, e)
    }

    fn check_stream(&self, s: StreamIndex) -> Result<usize, BackendError> {
        if s.0 < self.streams.len() {
            Ok(s.0)
        } else {
            Err(BackendError::Invalid(format!(
                "no stream {} (pool of {})",
                s.0,
                self.streams.len() - 1
            )))
        }
    }

    /// Events on every stream: the point after which a released buffer is free.
    fn events_on_all_streams(&self) -> Result<Vec<Event>, BackendError> {
        self.streams
            .iter()
            .chain([&self.copy_stream, &self.peer_reads])
            .map(|s| s.record_event())
            .collect::<Result<_, _>>()
            .map_err(self.err("cuEventRecord"))
    }

    /// Retires the temporaries of the op just issued on the current stream.
    pub(super) fn retire_scratch(&mut self) -> Result<(), BackendError> {
        if self.scratch.is_empty() {
            return Ok(());
        }
        let mut temps = std::mem::take(&mut self.scratch);
        if let Some(g) = self.group.as_mut() {
            // Inside a group the communication runs at the group's end.
            g.temps.append(&mut temps);
            return Ok(());
        }
        for t in temps {
            let ev = self
                .stream()
                .record_event()
                .map_err(self.err("cuEventRecord"))?;
            self.memory.retire(t, vec![ev]);
        }
        Ok(())
    }

    /// Marks the start of the run's device work (once per run, at its first instruction that
    /// reaches the device, or at its end): with a start barrier, first waits for every rank to
    /// get there (so that uploads of different lengths do not skew the ranks' clocks), then
    /// records the start event on the main stream.
    fn step_started(&mut self) -> Result<(), BackendError> {
        if self.timeline.is_started() {
            return Ok(());
        }
        if let (Some(parties), Some(rdv)) = (self.start_barrier, self.rendezvous.clone()) {
            let name = format!("meshflow/start/{}", self.runs);
            rdv.barrier(&name, parties, self.config.timeout)
                .map_err(|e| match e {
                    crate::runtime::rendezvous::RendezvousError::Aborted(reason) => {
                        BackendError::Aborted {
                            failed_rank: self
                                .abort
                                .as_ref()
                                .and_then(|a| a.first())
                                .map_or(self.rank, |f| f.0),
                            reason,
                        }
                    }
                    e => BackendError::Invalid(format!("rank {}: start barrier: {e}", self.rank)),
                })?;
        }
        let main = self.streams[0].clone();
        self.timeline
            .ensure_started(&main)
            .map_err(self.err("cuEventRecord"))
    }

    /// Makes every run start with a barrier of `parties` ranks (all ranks of the run, each with
    /// such a backend on the same rendezvous), so that device times of different ranks start
    /// together; used for timing.
    pub fn set_start_barrier(&mut self, parties: usize) {
        self.start_barrier = Some(parties);
    }

    /// After a run's device work is done: drops its graph and returns the memory the graph
    /// used to the allocator.
    fn end_graph_run(&mut self) -> Result<(), BackendError> {
        let Some(state) = self.graph.take() else {
            return Ok(());
        };
        drop(state.exec);
        self.timeline.profile = state.profile;
        let streams: Vec<Stream> = self.streams.clone();
        self.memory
            .end_hold(|| streams.iter().map(|s| s.record_event()).collect())
            .map_err(self.err("cuEventRecord"))
    }

    /// Joins the copy-engine hub of an in-process run (every rank of the run joins the
    /// same hub): teams whose members all joined move permutes and broadcasts over the copy
    /// engine (see [`CudaConfig::transport`]).
    pub fn set_peer_hub(&mut self, hub: Arc<PeerHub>) {
        hub.register(self.rank, &self.device);
        self.hub = Some(hub);
    }

    /// The abort error when another rank failed.
    pub(super) fn aborted(&self) -> Option<BackendError> {
        let a = self.abort.as_ref()?;
        if !a.is_aborted() {
            return None;
        }
        let (failed_rank, reason) = a.first().unwrap_or((self.rank, "unknown".into()));
        Some(BackendError::Aborted {
            failed_rank,
            reason,
        })
    }

    /// Blocks until `done` completes, watching for aborts, NCCL errors and the timeout.
    fn wait_device(&mut self, done: &Event) -> Result<(), BackendError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if done.is_complete().map_err(self.err("cuEventQuery"))? {
                // A peer that failed during the run may have let this rank's collectives end
                // early (aborted communicators): the device being done proves nothing then.
                if let Some(e) = self.aborted() {
                    self.abort_comms();
                    return Err(e);
                }
                return Ok(());
            }
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(Duration::from_micros(200));
            if spins.is_multiple_of(50) {
                if let Some(e) = self.aborted() {
                    self.abort_comms();
                    return Err(e);
                }
                for (key, c) in &self.comms {
                    if let Err(e) = c.check_async_error() {
                        let e = dev_err(
                            self.rank,
                            &format!("NCCL communicator of team {:?}", key.members),
                            e,
                        );
                        self.abort_comms();
                        return Err(e);
                    }
                }
                if start.elapsed() > self.config.timeout {
                    self.abort_comms();
                    return Err(BackendError::Timeout {
                        peer: self.rank,
                        waited: self.config.timeout,
                        what: "the device to finish the program (a peer may have stopped; \
                               communicators aborted)"
                            .into(),
                    });
                }
            }
        }
    }

    /// Connects NCCL's point-to-point channels between this rank and every other member of the
    /// communicator `self.comms[i]` now, right after its creation, while every member is known
    /// to be here: a one-byte send and receive with each peer in one group, waited for like a
    /// program's end. NCCL otherwise connects a pair inside the first `ncclGroupEnd` of a
    /// send/recv between them, which blocks the host thread until the peer posts its side, and
    /// never returns if the peer has failed by then (no abort can reach a thread inside NCCL).
    fn preconnect(&mut self, i: usize, lib: &Arc<NcclLib>) -> Result<(), BackendError> {
        let Some((_, comm)) = self.comms.get(i) else {
            return Ok(());
        };
        let (n, me) = (comm.size(), comm.rank());
        if n < 2 {
            return Ok(());
        }
        let bytes = DeviceBuffer::alloc(&self.device, 2 * n).map_err(self.err("cuMemAlloc"))?;
        let s = self.streams[0].clone();
        let e = self.err("NCCL point-to-point connection");
        nccl::group(lib, || {
            for p in (0..n).filter(|&p| p != me) {
                comm.send(&bytes.view(p, 1)?, meshflow_kernels::DType::U8, p, &s)?;
                comm.recv(&bytes.view(n + p, 1)?, meshflow_kernels::DType::U8, p, &s)?;
            }
            Ok(())
        })
        .map_err(e)?;
        let done = s.record_event().map_err(self.err("cuEventRecord"))?;
        self.wait_device(&done)
    }

    /// Aborts every communicator (unblocks device work waiting for a peer) and marks the rank
    /// failed.
    fn abort_comms(&mut self) {
        self.failed = true;
        self.moe_release(false);
        self.team_comm.clear();
        for (key, c) in self.comms.drain(..) {
            if c.is_borrowed() {
                // Never aborted here: the caller owns it.
                continue;
            }
            if let Err(e) = c.abort() {
                tracing::warn!(rank = self.rank, ?key.members, "ncclCommAbort failed: {e}");
            }
        }
    }

    fn user_kernel(&mut self, k: KernelId) -> Result<UserKernel, BackendError> {
        let def = self
            .config
            .kernels
            .defs
            .get(k.0)
            .ok_or_else(|| BackendError::Invalid(format!("unknown kernel {k:?}")))?;
        if let Some(Some(u)) = self.user.get(k.0) {
            return Ok(u.clone());
        }
        let u = UserKernel::load(&self.device, &def.image, &def.function).map_err(|e| {
            BackendError::Kernel {
                name: def.name.clone(),
                message: format!("loading on rank {}: {e}", self.rank),
            }
        })?;
        if let Some(slot) = self.user.get_mut(k.0) {
            *slot = Some(u.clone());
        }
        Ok(u)
    }

    fn host_data(&self, data: &TensorData, dst: &DeviceBuffer) -> Result<(), BackendError> {
        use crate::runtime::data::Storage;
        let s = &self.streams[0];
        let r = match data.storage() {
            Storage::F32(v) => dst.upload(s, v),
            Storage::BF16(v) => dst.upload(s, v),
            Storage::F16(v) => dst.upload(s, v),
            Storage::I32(v) => dst.upload(s, v),
            Storage::I64(v) => dst.upload(s, v),
        };
        r.map_err(self.err("upload (cuMemcpyHtoD)"))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.failed {
            // Abort first: device work waiting for a peer must stop before memory is freed.
            self.abort_comms();
        } else {
            self.moe_release(true);
            for (key, c) in self.comms.drain(..) {
                // The caller's communicators go back to the caller, not to the cache.
                if !c.is_borrowed() {
                    teams::checkin(key, c);
                }
            }
        }
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Comm = CudaComm;

    fn device(&self) -> DeviceId {
        self.rank
    }

    fn stream_pool_size(&self) -> usize {
        self.streams.len() - 1
    }

    fn prepare(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError> {
        self.current = 0;
        self.group = None;
        self.team_comm.clear();
        self.team_ce.clear();
        if info.teams.is_empty() {
            return Ok(());
        }
        let lib = match &self.nccl {
            Some(l) => l.clone(),
            None => {
                let l = NcclLib::load().map_err(self.err("loading NCCL"))?;
                self.nccl = Some(l.clone());
                l
            }
        };
        let namespace = self
            .rendezvous
            .as_ref()
            .map(|r| r.namespace().to_owned())
            .unwrap_or_else(|| "local".into());
        let ordinal = self.device.ordinal();
        let key_of = |members: &[DeviceId]| TeamKey {
            namespace: namespace.clone(),
            ordinal,
            members: members.to_vec(),
        };
        // Teams not held yet, in the global order of their member lists.
        let mut missing: Vec<(TeamKey, usize)> = Vec::new();
        for t in info.teams {
            let key = key_of(&t.members);
            if self.comms.iter().any(|(k, _)| *k == key) || missing.iter().any(|(k, _)| *k == key) {
                continue;
            }
            match teams::checkout(&key) {
                Some(c) => self.comms.push((key, c)),
                None => missing.push((key, t.my_index)),
            }
        }
        missing.sort_by(|a, b| a.0.members.cmp(&b.0.members));
        for (key, my_index) in missing {
            if let Some(e) = self.aborted() {
                return Err(e);
            }
            let comm = teams::create(
                self.rank,
                &lib,
                &self.device,
                self.rendezvous.as_deref(),
                &key,
                my_index,
                self.config.timeout,
            )?;
            self.comms.push((key, comm));
            self.preconnect(self.comms.len() - 1, &lib)?;
        }
        for t in info.teams {
            let key = key_of(&t.members);
            let i = self
                .comms
                .iter()
                .position(|(k, _)| *k == key)
                .ok_or_else(|| BackendError::Invalid(format!("no communicator for {key:?}")))?;
            if self.team_comm.len() <= t.slot {
                self.team_comm.resize(t.slot + 1, usize::MAX);
            }
            self.team_comm[t.slot] = i;
        }
        self.prepare_peer(info.teams)
    }

    fn allocate(&mut self, dtype: DType, shape: &[u64]) -> Result<CudaBuffer, BackendError> {
        let n = crate::runtime::data::numel_of(shape)
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
        let n = usize::try_from(n)
            .map_err(|_| BackendError::Invalid(format!("{shape:?} is too large")))?;
        self.memory
            .allocate(dtype, n)
            .map_err(self.err("allocate (cuMemAlloc)"))
    }

    fn deallocate(&mut self, buffer: CudaBuffer) -> Result<(), BackendError> {
        if self.memory.get(buffer).is_none() {
            return Err(BackendError::Invalid(format!(
                "release of an unknown buffer {buffer:?}"
            )));
        }
        let pending = self.events_on_all_streams()?;
        self.memory.release(buffer, pending);
        Ok(())
    }

    fn upload(&mut self, buffer: CudaBuffer, data: &TensorData) -> Result<(), BackendError> {
        let entry = self
            .memory
            .get(buffer)
            .ok_or_else(|| BackendError::Invalid(format!("upload into unknown {buffer:?}")))?;
        if entry.dtype != data.dtype() {
            return Err(BackendError::Invalid(format!(
                "uploading {} into a {} buffer",
                data.type_string(),
                entry.dtype
            )));
        }
        let dst = entry.data.clone();
        self.host_data(data, &dst)
    }

    fn download(&mut self, view: &TensorView<CudaBuffer>) -> Result<TensorData, BackendError> {
        self.current = 0;
        let buf = self.input_region(view)?;
        self.retire_scratch()?;
        let n = view.numel() as usize;
        let s = self.streams[0].clone();
        let e = self.err("download (cuMemcpyDtoH)");
        let shape = view.shape.clone();
        let bad = |x: crate::runtime::data::DataError| BackendError::Invalid(x.to_string());
        use crate::runtime::data::Storage;
        let storage = match view.dtype {
            DType::F32 => {
                let mut v = vec![0f32; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::F32(v)
            }
            DType::BF16 => {
                let mut v = vec![half::bf16::ZERO; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::BF16(v)
            }
            DType::F16 => {
                let mut v = vec![half::f16::ZERO; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::F16(v)
            }
            DType::I32 => {
                let mut v = vec![0i32; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::I32(v)
            }
            DType::I64 => {
                let mut v = vec![0i64; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::I64(v)
            }
        };
        TensorData::new(shape, storage).map_err(bad)
    }

    fn set_current_stream(&mut self, stream: StreamIndex) -> Result<(), BackendError> {
        self.current = self.check_stream(stream)?;
        Ok(())
    }

    fn synchronize(&mut self, stream: StreamIndex, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        let other = self.check_stream(stream)?;
        self.step_started()?;
        if other == self.current {
            return Ok(());
        }
        let o = self.streams[other].clone();
        self.stream()
            .join(&o)
            .map_err(self.err("synchronize (cuStreamWaitEvent)"))
    }

    fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TensorView<CudaBuffer>],
        outputs: &[&TensorView<CudaBuffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.step_started()?;
        let opened = self
            .timeline
            .open(
                &self.streams,
                self.current,
                IntervalKind::Compute,
                op.name(),
                ctx.inst,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))?;
        self.before_writes(outputs)?;
        let r = self.compute_op(op, inputs, outputs);
        let retired = self.retire_scratch();
        r?;
        retired?;
        self.timeline
            .close(&self.streams, opened)
            .map_err(self.err("cuEventRecord"))
    }

    fn kernel(&self, name: &str) -> Option<KernelId> {
        self.config
            .kernels
            .defs
            .iter()
            .position(|d| d.name == name)
            .map(KernelId)
    }

    fn call_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<CudaBuffer>],
        outputs: &[&TensorView<CudaBuffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.step_started()?;
        let k = self.user_kernel(kernel)?;
        let def = self.config.kernels.defs[kernel.0].clone();
        let opened = self
            .timeline
            .open(
                &self.streams,
                self.current,
                IntervalKind::Compute,
                "call_kernel",
                ctx.inst,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))?;
        self.before_writes(outputs)?;
        let r = self.call_user(&k, &def, inputs, outputs, args);
        let retired = self.retire_scratch();
        r?;
        retired?;
        self.timeline
            .close(&self.streams, opened)
            .map_err(self.err("cuEventRecord"))
    }

    fn post(
        &mut self,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<CudaComm, BackendError> {
        if let Some(e) = self.aborted() {
            return Err(e);
        }
        #[cfg(feature = "fault-injection")]
        if self.config.exit_at_comm == Some(self.posted) {
            tracing::warn!(
                rank = self.rank,
                "injected process exit at communication #{}",
                self.posted
            );
            std::process::exit(crate::runtime::faults::FAULT_EXIT_STATUS);
        }
        self.posted += 1;
        self.step_started()?;
        self.before_writes(&request_outputs(request))?;
        if let Some(events) = self.post_ce(request, ctx)? {
            self.retire_scratch()?;
            return Ok(CudaComm {
                events: Rc::new(RefCell::new(Some(
                    events.into_iter().map(Rc::new).collect(),
                ))),
            });
        }
        let opened = match self.group {
            Some(_) => None,
            None => self
                .timeline
                .open(
                    &self.streams,
                    self.current,
                    IntervalKind::Comm,
                    request.name(),
                    ctx.inst,
                    ctx.iteration,
                )
                .map_err(self.err("cuEventRecord"))?,
        };
        let r = self.post_request(request);
        let retired = self.retire_scratch();
        r?;
        retired?;
        let handle = CudaComm::default();
        match self.group.as_mut() {
            Some(g) => {
                if !g.streams.contains(&self.current) {
                    g.streams.push(self.current);
                }
                g.members.push(handle.clone());
            }
            None => {
                let e = self
                    .stream()
                    .record_event()
                    .map_err(self.err("cuEventRecord"))?;
                *handle.events.borrow_mut() = Some(vec![Rc::new(e)]);
                self.timeline
                    .close(&self.streams, opened)
                    .map_err(self.err("cuEventRecord"))?;
            }
        }
        Ok(handle)
    }

    fn begin_group(&mut self) -> Result<(), BackendError> {
        if self.group.is_some() {
            return Err(BackendError::Invalid("nested coalescing group".into()));
        }
        let lib = self.nccl.clone().ok_or_else(|| {
            BackendError::Invalid("a coalescing group in a program without teams".into())
        })?;
        self.step_started()?;
        nccl::group_start(&lib).map_err(self.err("ncclGroupStart"))?;
        self.group = Some(Group::default());
        Ok(())
    }

    fn end_group(&mut self, _label: usize, ctx: InstCtx<'_>) -> Result<CudaComm, BackendError> {
        let g = self
            .group
            .take()
            .ok_or_else(|| BackendError::Invalid("end_coalescing without a group".into()))?;
        let lib = self
            .nccl
            .clone()
            .ok_or_else(|| BackendError::Invalid("no NCCL library loaded".into()))?;
        // The group's interval spans from its first member's stream position to its end.
        let opened = self
            .timeline
            .open(
                &self.streams,
                self.current,
                IntervalKind::Comm,
                "coalesced",
                ctx.inst,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))?;
        nccl::group_end(&lib).map_err(self.err("ncclGroupEnd"))?;
        let Group {
            members,
            unstage,
            mut streams,
            temps,
            ..
        } = g;
        for u in unstage {
            let saved = self.current;
            self.current = u.stream;
            let r = self.unstage(&u.temp, &u.dst);
            self.current = saved;
            r?;
        }
        if !streams.contains(&self.current) {
            streams.push(self.current);
        }
        let mut events = Vec::with_capacity(streams.len());
        for s in &streams {
            let e = self.streams[*s]
                .record_event()
                .map_err(self.err("cuEventRecord"))?;
            events.push(Rc::new(e));
        }
        for t in temps {
            let pending = streams
                .iter()
                .map(|s| self.streams[*s].record_event())
                .collect::<Result<Vec<_>, _>>()
                .map_err(self.err("cuEventRecord"))?;
            self.memory.retire(t, pending);
        }
        for m in &members {
            *m.events.borrow_mut() = Some(events.clone());
        }
        self.timeline
            .close(&self.streams, opened)
            .map_err(self.err("cuEventRecord"))?;
        Ok(CudaComm {
            events: Rc::new(RefCell::new(Some(events))),
        })
    }

    fn begin_graph(&mut self) -> Result<bool, BackendError> {
        if self.proxy.is_some() {
            return Err(BackendError::Invalid(format!(
                "rank {}: graph recording is not supported in runs split into nodes (transfers \
                 through the host proxy are staged by the host)",
                self.rank
            )));
        }
        if self.team_ce.iter().any(|&c| c) {
            return Err(BackendError::Invalid(format!(
                "rank {}: graph recording with the copy-engine transport is not supported \
                 (cross-GPU events do not order replays); use the NCCL transport",
                self.rank
            )));
        }
        if self.graph.is_some() {
            return Err(BackendError::Invalid(
                "a graph is already being recorded".into(),
            ));
        }
        self.step_started()?;
        let profile = self.timeline.profile;
        // Timing events cannot be read back from inside a graph.
        self.timeline.profile = false;
        self.streams[0]
            .begin_capture()
            .map_err(self.err("cuStreamBeginCapture"))?;
        self.memory.begin_hold();
        self.graph = Some(GraphState {
            exec: None,
            profile,
        });
        Ok(true)
    }

    fn end_graph(&mut self, replays: usize) -> Result<(), BackendError> {
        let Some(state) = self.graph.as_mut() else {
            return Err(BackendError::Invalid(
                "end_graph without begin_graph".into(),
            ));
        };
        let made = self.streams[0].end_capture();
        if replays == 0 {
            // Nothing will replay: forget the recording now.
            drop(made);
            return self.end_graph_run();
        }
        let exec = match made {
            Ok(g) => g,
            Err(e) => return Err(dev_err(self.rank, "cuStreamEndCapture", e)),
        };
        for _ in 0..replays {
            exec.replay(&self.streams[0])
                .map_err(|e| dev_err(self.rank, "cuGraphLaunch", e))?;
        }
        state.exec = Some(exec);
        Ok(())
    }

    fn wait(&mut self, comm: &CudaComm, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        if let Some(e) = self.aborted() {
            return Err(e);
        }
        let events = comm.events.borrow();
        let events = events.as_ref().ok_or_else(|| {
            BackendError::Invalid(
                "wait on a communication whose coalescing group has not ended".into(),
            )
        })?;
        for e in events {
            self.stream()
                .wait(e)
                .map_err(self.err("wait (cuStreamWaitEvent)"))?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        if self.group.is_some() {
            return Err(BackendError::Invalid(
                "a coalescing group was never ended".into(),
            ));
        }
        self.step_started()?;
        self.runs += 1;
        let main = self.streams[0].clone();
        for w in self.streams[1..]
            .iter()
            .chain([&self.copy_stream, &self.peer_reads])
        {
            main.join(w).map_err(self.err("cuStreamWaitEvent"))?;
        }
        let end = self
            .timeline
            .end_event(&main)
            .map_err(self.err("cuEventRecord"))?;
        let done = main.record_event().map_err(self.err("cuEventRecord"))?;
        if let Err(e) = self.wait_device(&done) {
            self.timeline.reset();
            return Err(e);
        }
        if let Some(e) = self.proxy_failure() {
            self.timeline.reset();
            return Err(e);
        }
        self.end_graph_run()?;
        self.pending_reads.clear();
        self.moe_check_status()?;
        self.timeline
            .collect(self.rank, end)
            .map_err(self.err("cuEventElapsedTime"))
    }
}
