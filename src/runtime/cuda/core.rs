//! [`DeviceCore`]: what every op of one rank runs on, whatever moves its bytes: the GPU, its
//! main and worker streams (plus a copy stream and a peer-read stream), the caching allocator,
//! the run clock and profiling intervals, the open coalescing group, and the run's abort
//! signal. Compute (`compute.rs`), operands (`operands.rs`) and every transport (`transport/`)
//! work on a core; the core depends on none of them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::{Device, DeviceBuffer, Event, KernelError, Kernels, Stream};
use meshflow_passes::Transport;

use super::config::{AbortSignal, CudaConfig};
use super::deferred::{self, Deferrals, Defers, Finish};
use super::memory::{CudaBuffer, Memory};
use super::profile::{IntervalKind, Opened, Timeline};
use crate::runtime::backend::{BackendError, InstCtx, StreamIndex, TensorView};
use crate::runtime::rendezvous::{Rendezvous, RendezvousError};

/// Turns a kernels-crate error into a backend error naming the rank and the operation; a lost
/// or failed peer behind the host proxy is reported as that peer's failure.
pub(crate) fn dev_err(rank: DeviceId, call: &str, e: KernelError) -> BackendError {
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

/// A posted communication: events on the streams it ran on, filled in when its coalescing
/// group ends (at once outside a group).
#[derive(Clone, Debug, Default)]
pub struct CudaComm {
    pub(super) events: Rc<RefCell<Option<Vec<Rc<Event>>>>>,
    /// The stream (index into the core's streams) all of the communication's device work was
    /// issued on, when there is one: a wait on that same stream is ordered already.
    pub(super) stream: Option<usize>,
}

impl CudaComm {
    /// A handle that is complete once `events` are.
    pub(super) fn done_after(events: Vec<Rc<Event>>) -> CudaComm {
        CudaComm {
            events: Rc::new(RefCell::new(Some(events))),
            stream: None,
        }
    }

    /// A handle whose work is enqueued later, which fills in its events (a deferred pull,
    /// see `deferred.rs`).
    pub(super) fn deferred() -> CudaComm {
        CudaComm::default()
    }

    /// A handle for work issued entirely on stream `stream`, complete once `event` (recorded
    /// on that stream after it) is.
    pub(super) fn on_stream(stream: usize, event: Event) -> CudaComm {
        CudaComm {
            events: Rc::new(RefCell::new(Some(vec![Rc::new(event)]))),
            stream: Some(stream),
        }
    }
}

/// An output written through a packed temporary and copied into its strided view afterwards.
#[derive(Debug)]
pub(super) struct Unstage {
    pub stream: usize,
    pub temp: DeviceBuffer,
    pub dst: TensorView<CudaBuffer>,
}

/// An open coalescing group: its members are issued together at its end.
#[derive(Debug, Default)]
pub(super) struct Group {
    pub members: Vec<CudaComm>,
    pub unstage: Vec<Unstage>,
    pub streams: Vec<usize>,
    pub temps: Vec<DeviceBuffer>,
}

/// Why a host wait for the device ended without the device being done.
#[derive(Debug)]
pub(super) struct WaitFailed {
    /// The error to report.
    pub error: BackendError,
    /// Whether communications must be aborted (a peer failed or stopped), not only reported.
    pub abort: bool,
}

/// The elements `[first, last + 1)` a view touches (empty for an empty view).
pub(super) fn element_range(v: &TensorView<CudaBuffer>) -> (u64, u64) {
    if v.shape.contains(&0) {
        return (v.offset, v.offset);
    }
    let span: u64 = v
        .shape
        .iter()
        .zip(&v.strides)
        .map(|(n, s)| (n - 1) * s)
        .sum();
    (v.offset, v.offset + span + 1)
}

/// The device side of one rank (see the module docs).
pub(crate) struct DeviceCore {
    pub rank: DeviceId,
    pub device: Device,
    pub kernels: Kernels,
    /// The main stream (0) and the worker streams.
    pub streams: Vec<Stream>,
    /// The current stream (an index into `streams`).
    pub current: usize,
    pub memory: Memory,
    /// Temporaries of the op being issued, retired after it.
    pub scratch: Vec<DeviceBuffer>,
    pub timeline: Timeline,
    pub group: Option<Group>,
    /// A stream for transfers that must not run on the posting stream (copy-engine pulls
    /// with a dedicated copy stream).
    pub copy_stream: Stream,
    /// A stream that only waits for peers' reads of this rank's memory, so that releases and
    /// the end of a run are ordered after them.
    pub peer_reads: Stream,
    /// The stream that raises this rank's signals in peers' memory (CUDA IPC peers): one
    /// stream, so that the values of each signal grow in the order they are raised.
    pub signals: Stream,
    /// Per buffer: peers' reads of element ranges that later writes must wait for.
    #[allow(clippy::type_complexity)]
    pub pending_reads: HashMap<CudaBuffer, Vec<((u64, u64), Rc<Event>)>>,
    /// How long host waits for peers and the device may take.
    pub timeout: Duration,
    pub abort: Option<AbortSignal>,
    pub rendezvous: Option<Arc<dyn Rendezvous>>,
    /// Ranks that meet at a barrier before each run's first device work (timing).
    pub start_barrier: Option<usize>,
    /// Runs finished (names the start barriers).
    pub runs: u64,
    /// Host timings of the current run (diagnostics, see [`RunHost`]).
    pub run_host: RunHost,
    /// Peers' reads of this rank's memory whose completions the host has not collected yet,
    /// in posting order (see [`Self::defer_peer_reads`]).
    pub uncollected: Vec<Uncollected>,
    /// Copy-engine pulls posted before their senders' offers arrived, finished later in
    /// posting order (see `deferred.rs`).
    pub deferred: PullQueue,
    /// Per stream of `streams`: the stream its deferred pulls run on (made on first use),
    /// joined to it at the post.
    pub deferral_streams: Vec<Option<Stream>>,
}

/// The done events of a communication, filled in when its work is enqueued.
pub(crate) type DoneEvents = Vec<Rc<Event>>;

/// The rank's deferred copy-engine pulls, each naming the buffer it writes.
pub(crate) type PullQueue = Deferrals<DeviceCore, DoneEvents, CudaBuffer>;

impl Defers<DoneEvents, CudaBuffer> for DeviceCore {
    fn deferrals(&mut self) -> &mut PullQueue {
        &mut self.deferred
    }
}

/// Collects the completions of a post's sends: waits (host) until the receivers have posted
/// their reads, makes the peer-read stream wait for them and returns events of this GPU that
/// complete after them.
pub(crate) type CollectReads = Box<dyn FnOnce(&DeviceCore) -> Result<Vec<Event>, BackendError>>;

/// Peers' reads of a view of this rank whose completions are collected later.
pub(crate) struct Uncollected {
    buffer: CudaBuffer,
    range: (u64, u64),
    collect: CollectReads,
}

/// Host timings of one run, logged at its end with the host waits for peers (target
/// `meshflow::peer_waits`): where the device may have idled because the host was late.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RunHost {
    /// When the run's start event was recorded (after the start barrier).
    pub started: Option<Instant>,
    /// Time spent in the start barrier.
    pub barrier: Duration,
    /// From the start event to the launch of the run's first compute op.
    pub first_compute: Option<Duration>,
}

impl RunHost {
    /// Notes that a compute op is being launched.
    pub fn computing(&mut self) {
        if let (Some(t), None) = (self.started, self.first_compute) {
            self.first_compute = Some(t.elapsed());
        }
    }
}

impl DeviceCore {
    /// The core of `rank` on `device`: `main` (the caller's stream) or a new one, and the
    /// stream pool, profiling mode and timeout of `config`.
    pub(super) fn new(
        rank: DeviceId,
        device: Device,
        main: Option<Stream>,
        config: &CudaConfig,
        rendezvous: Option<Arc<dyn Rendezvous>>,
        abort: Option<AbortSignal>,
    ) -> Result<DeviceCore, BackendError> {
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
        let new_stream = || Stream::new(&device).map_err(|e| dev_err(rank, "cuStreamCreate", e));
        while streams.len() <= pool {
            streams.push(new_stream()?);
        }
        let copy_stream = new_stream()?;
        let peer_reads = new_stream()?;
        let signals = new_stream()?;
        Ok(DeviceCore {
            rank,
            kernels: Kernels::new(&device),
            memory: Memory::new(&device),
            device,
            streams,
            current: 0,
            scratch: Vec::new(),
            timeline: Timeline::new(config.profile),
            group: None,
            copy_stream,
            peer_reads,
            signals,
            pending_reads: HashMap::new(),
            timeout: config.timeout,
            abort,
            rendezvous,
            start_barrier: None,
            runs: 0,
            run_host: RunHost::default(),
            uncollected: Vec::new(),
            deferred: Deferrals::default(),
            deferral_streams: Vec::new(),
        })
    }

    /// The current stream.
    pub fn stream(&self) -> &Stream {
        &self.streams[self.current]
    }

    /// A closure turning a kernels-crate error of `call` into a backend error of this rank.
    pub fn err(&self, call: &str) -> impl Fn(KernelError) -> BackendError {
        let rank = self.rank;
        let call = call.to_owned();
        move |e| dev_err(rank, &call, e)
    }

    /// The index of stream `s`, checked.
    pub fn check_stream(&self, s: StreamIndex) -> Result<usize, BackendError> {
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

    /// The rendezvous namespace (keys the communicator cache).
    pub fn namespace(&self) -> String {
        self.rendezvous
            .as_ref()
            .map(|r| r.namespace().to_owned())
            .unwrap_or_else(|| "local".into())
    }

    /// The abort error when another rank failed.
    pub fn aborted(&self) -> Option<BackendError> {
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

    /// A timeout error naming `peer` and what was waited for.
    pub fn timeout_error(&self, peer: DeviceId, what: String) -> BackendError {
        BackendError::Timeout {
            peer,
            waited: self.timeout,
            what,
        }
    }

    /// Events on every stream: the point after which a released buffer is free.
    pub fn events_on_all_streams(&self) -> Result<Vec<Event>, BackendError> {
        self.all_streams()
            .map(|s| s.record_event())
            .collect::<Result<_, _>>()
            .map_err(self.err("cuEventRecord"))
    }

    /// Fences the buffers released since the last fence (see `memory.rs`): one event on every
    /// stream, shared by all of them. Called before any allocation, so that a released buffer
    /// is reused only after the work issued before its release.
    pub fn fence_released(&mut self) -> Result<(), BackendError> {
        if !self.memory.needs_fence() {
            return Ok(());
        }
        let events = self.events_on_all_streams()?;
        self.memory.fence(events);
        Ok(())
    }

    /// The main, worker, copy, peer-read and signal streams, and the streams of deferred
    /// pulls made so far.
    pub fn all_streams(&self) -> impl Iterator<Item = &Stream> {
        self.streams
            .iter()
            .chain([&self.copy_stream, &self.peer_reads, &self.signals])
            .chain(self.deferral_streams.iter().flatten())
    }

    /// The stream that runs the deferred pulls posted on stream `posting` (made on first use).
    pub fn deferral_stream(&mut self, posting: usize) -> Result<Stream, BackendError> {
        if self.deferral_streams.len() <= posting {
            self.deferral_streams.resize(posting + 1, None);
        }
        if let Some(s) = &self.deferral_streams[posting] {
            return Ok(s.clone());
        }
        let s = Stream::new(&self.device).map_err(self.err("cuStreamCreate"))?;
        self.deferral_streams[posting] = Some(s.clone());
        Ok(s)
    }

    /// Finishes deferred copy-engine pulls as `how` says (see `deferred.rs`): call with
    /// [`Finish::All`] before any host wait that may block.
    pub fn finish_deferred(
        &mut self,
        how: Finish<'_, DoneEvents, CudaBuffer>,
    ) -> Result<(), BackendError> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        deferred::finish(self, how)
    }

    /// Retires the temporaries of the op just issued on the current stream.
    pub fn retire_scratch(&mut self) -> Result<(), BackendError> {
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
    pub fn step_started(&mut self) -> Result<(), BackendError> {
        if self.timeline.is_started() {
            return Ok(());
        }
        // Completions left uncollected, and pulls left deferred, by a run that failed before
        // its end belong to no run any more.
        self.uncollected.clear();
        self.deferred.clear();
        let barrier = Instant::now();
        self.align_ranks("start")?;
        let main = self.streams[0].clone();
        self.run_host = RunHost {
            started: Some(Instant::now()),
            barrier: barrier.elapsed(),
            first_compute: None,
        };
        self.timeline
            .ensure_started(&main)
            .map_err(self.err("cuEventRecord"))
    }

    /// With a start barrier ([`Self::start_barrier`]), waits until every rank of the run got to
    /// `what` (a timing barrier: the ranks leave it together, see `docs/architecture.md`,
    /// "Timed runs"); without one, returns at once.
    pub fn align_ranks(&self, what: &str) -> Result<(), BackendError> {
        let (Some(parties), Some(rdv)) = (self.start_barrier, self.rendezvous.clone()) else {
            return Ok(());
        };
        let name = format!("meshflow/{what}/{}", self.runs);
        rdv.timing_barrier(&name, parties, self.timeout)
            .map_err(|e| match e {
                RendezvousError::Aborted(reason) => BackendError::Aborted {
                    failed_rank: self
                        .abort
                        .as_ref()
                        .and_then(|a| a.first())
                        .map_or(self.rank, |f| f.0),
                    reason,
                },
                RendezvousError::Lost { rank, ref reason } => BackendError::Aborted {
                    failed_rank: rank,
                    reason: format!("rank {rank} stopped ({reason})"),
                },
                e => BackendError::Invalid(format!("rank {}: {what} barrier: {e}", self.rank)),
            })
    }

    /// Opens the profiling interval of a communication issued on the current stream by
    /// `transport` (none inside a coalescing group, whose interval covers its members).
    pub fn begin_op(
        &mut self,
        name: &'static str,
        transport: Transport,
        ctx: InstCtx<'_>,
    ) -> Result<Option<Opened>, BackendError> {
        if self.group.is_some() {
            return Ok(None);
        }
        self.timeline
            .open(
                &self.streams,
                self.current,
                IntervalKind::Comm,
                name,
                Some(transport),
                ctx.preorder,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))
    }

    /// Closes an interval opened on the current stream.
    pub fn close_op(&mut self, opened: Option<Opened>) -> Result<(), BackendError> {
        self.timeline
            .close(&self.streams, opened)
            .map_err(self.err("cuEventRecord"))
    }

    /// Records that peers read the elements of `view` until `dones` complete (see
    /// [`Self::before_writes`]).
    pub fn add_peer_reads(&mut self, view: &TensorView<CudaBuffer>, dones: Vec<Event>) {
        if dones.is_empty() {
            return;
        }
        let range = element_range(view);
        self.pending_reads
            .entry(view.buffer)
            .or_default()
            .extend(dones.into_iter().map(|e| (range, Rc::new(e))));
    }

    /// Records that peers read the elements of `view`, their completions to be collected by
    /// `collect` only when something needs them ([`Self::settle_peer_reads`]): before a write
    /// of the view's buffer, its release or upload, and at the end of the run. The host of a
    /// sender thus does not wait for its receivers in the post itself (a round trip between
    /// processes with one process per GPU), only where the order matters, by when the
    /// receivers have mostly posted. Device waits are still enqueued only after the peer
    /// posted the read (see `transport/peers.rs`).
    pub fn defer_peer_reads(&mut self, view: &TensorView<CudaBuffer>, collect: CollectReads) {
        self.uncollected.push(Uncollected {
            buffer: view.buffer,
            range: element_range(view),
            collect,
        });
    }

    /// Collects the deferred completions of peers' reads of `buffers` (of every buffer with
    /// `None`), in posting order, and files them as [`Self::add_peer_reads`] does.
    pub fn settle_peer_reads(
        &mut self,
        buffers: Option<&[CudaBuffer]>,
    ) -> Result<(), BackendError> {
        self.settle_where(|u| buffers.is_none_or(|b| b.contains(&u.buffer)))
    }

    /// Collects the deferred completions that `pick` selects, in posting order.
    fn settle_where(&mut self, pick: impl Fn(&Uncollected) -> bool) -> Result<(), BackendError> {
        if !self.uncollected.iter().any(&pick) {
            return Ok(());
        }
        // Collecting blocks until the receivers report: deferred pulls go first.
        self.finish_deferred(Finish::All)?;
        let (now, later): (Vec<Uncollected>, Vec<Uncollected>) =
            std::mem::take(&mut self.uncollected)
                .into_iter()
                .partition(|u| pick(u));
        self.uncollected = later;
        for u in now {
            let dones = (u.collect)(self)?;
            if !dones.is_empty() {
                self.pending_reads
                    .entry(u.buffer)
                    .or_default()
                    .extend(dones.into_iter().map(|e| (u.range, Rc::new(e))));
            }
        }
        Ok(())
    }

    /// Orders an op that writes `outputs` after the peers' reads of their buffers (the current
    /// stream waits for them).
    pub fn before_writes(
        &mut self,
        outputs: &[&TensorView<CudaBuffer>],
    ) -> Result<(), BackendError> {
        if !self.uncollected.is_empty() {
            let written: Vec<(CudaBuffer, (u64, u64))> = outputs
                .iter()
                .map(|o| (o.buffer, element_range(o)))
                .collect();
            self.settle_where(|u| {
                written
                    .iter()
                    .any(|&(b, (s, e))| b == u.buffer && s < u.range.1 && u.range.0 < e)
            })?;
        }
        if self.pending_reads.is_empty() {
            return Ok(());
        }
        for o in outputs {
            let (start, end) = element_range(o);
            if let Some(list) = self.pending_reads.get(&o.buffer) {
                for ((s, e), ev) in list {
                    if *s >= end || start >= *e {
                        continue;
                    }
                    self.streams[self.current]
                        .wait(ev)
                        .map_err(|err| dev_err(self.rank, "cuStreamWaitEvent", err))?;
                }
            }
        }
        Ok(())
    }

    /// Retires send temporaries once the peers' reads (which the peer-read stream waits for
    /// already) and this rank's own uses on the current stream are done.
    pub fn retire_after_peer_reads(
        &mut self,
        temps: Vec<DeviceBuffer>,
    ) -> Result<(), BackendError> {
        if !temps.is_empty() {
            self.peer_reads
                .join(self.stream())
                .map_err(self.err("cuStreamWaitEvent"))?;
        }
        for t in temps {
            let ev = self
                .peer_reads
                .record_event()
                .map_err(self.err("cuEventRecord"))?;
            self.memory.retire(t, vec![ev]);
        }
        Ok(())
    }

    /// Blocks until `done` completes, watching for aborts, the timeout and `poll` (which
    /// reports failures of communicators, e.g. NCCL's asynchronous errors).
    pub fn wait_device(
        &self,
        done: &Event,
        mut poll: impl FnMut() -> Option<BackendError>,
    ) -> Result<(), WaitFailed> {
        let start = Instant::now();
        let mut spins = 0u32;
        let abort = |error| WaitFailed { error, abort: true };
        loop {
            let complete = done.is_complete().map_err(|e| WaitFailed {
                error: dev_err(self.rank, "cuEventQuery", e),
                abort: false,
            })?;
            if complete {
                // A peer that failed during the run may have let this rank's collectives end
                // early (aborted communicators): the device being done proves nothing then.
                return match self.aborted() {
                    Some(e) => Err(abort(e)),
                    None => Ok(()),
                };
            }
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(Duration::from_micros(200));
            if spins.is_multiple_of(50) {
                if let Some(e) = self.aborted() {
                    return Err(abort(e));
                }
                if let Some(e) = poll() {
                    return Err(abort(e));
                }
                if start.elapsed() > self.timeout {
                    return Err(abort(BackendError::Timeout {
                        peer: self.rank,
                        waited: self.timeout,
                        what: "the device to finish the program (a peer may have stopped; \
                               communicators aborted)"
                            .into(),
                    }));
                }
            }
        }
    }
}

impl std::fmt::Debug for DeviceCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCore")
            .field("rank", &self.rank)
            .field("device", &self.device.ordinal())
            .field("streams", &self.streams.len())
            .finish()
    }
}
