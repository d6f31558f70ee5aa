//! [`CudaBackend`]: the [`Backend`] of one rank on one GPU: a [`DeviceCore`] (streams, memory,
//! events, timeline), the NCCL communicators of its teams, and the transport objects the
//! prepared program selected ([`Transports`]). This file only wires them together: compute
//! runs on the core, every communication goes to the transport selected for its label.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use meshflow_ir::{ComputeOp, DType, DeviceId, EntityRef};
use meshflow_kernels::nccl;
use meshflow_kernels::proxy::{Proxy, Topology};
use meshflow_kernels::{Device, DeviceBuffer, UserKernel};
use meshflow_passes::Transport;

use super::config::{AbortSignal, CudaConfig, CudaResources};
use super::core::{dev_err, CudaComm, DeviceCore, Group};
use super::deferred::Finish;
use super::graph::GraphRecorder;
use super::memory::CudaBuffer;
use super::profile::{Interval, IntervalKind};
use super::teams::Communicators;
use super::transport::{
    Environment, HubLink, IpcLink, PeerHub, PeerLink, PostCx, Posted, ProxyAccess, Transports,
};
use crate::runtime::backend::{
    Backend, BackendError, CommLabel, CommRequest, InstCtx, KernelId, PlanInfo, StreamIndex,
    TensorView,
};
use crate::runtime::data::TensorData;
use crate::runtime::rendezvous::Rendezvous;

/// How long a peer process must have been gone before a rank waiting for its device gives up
/// on it (a peer that left after doing its part is no failure if the device finishes
/// meanwhile); well under the usual timeouts, so that a dead peer is reported long before them.
const LOST_PEER_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// The CUDA backend of one rank: device `ordinal`, a main stream and a pool of worker streams,
/// a caching allocator, one NCCL communicator per team, the transports its program selected,
/// and optional profiling.
pub struct CudaBackend {
    core: DeviceCore,
    config: CudaConfig,
    comms: Communicators,
    transports: Transports,
    /// Kernels of `config.kernels`, loaded on first launch.
    user: Vec<Option<UserKernel>>,
    /// Communications posted by this backend (for [`CudaConfig::exit_at_comm`]).
    posted: usize,
    failed: bool,
    /// The graph recorded or replayed in this run.
    graph: GraphRecorder,
    /// How this rank reaches its peers' GPU memory: the hub of an in-process launch, or CUDA
    /// IPC with ranks in other processes (made at the first prepare that needs it).
    link: Option<Arc<dyn PeerLink>>,
    /// Whether a CUDA IPC link was tried already (it is made once).
    ipc_tried: bool,
    /// This rank's host proxy to ranks of other nodes, with the run's nodes.
    proxy: Option<ProxyAccess>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("rank", &self.core.rank)
            .field("device", &self.core.device.ordinal())
            .field("streams", &self.core.streams.len())
            .field("teams", &self.comms.len())
            .field("transports", &self.transports)
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
        for (members, comm) in comms {
            b.comms.adopt(&b.core, members, comm)?;
        }
        Ok(b)
    }

    /// Lends the caller's device memory `data` (elements of `dtype`) to the program as a
    /// buffer, used in place; [`Backend::deallocate`] ends the loan (nothing is freed).
    pub fn import(&mut self, data: DeviceBuffer, dtype: DType) -> Result<CudaBuffer, BackendError> {
        let core = &mut self.core;
        if !data.device().same_as(&core.device) {
            return Err(BackendError::Invalid(format!(
                "rank {}: a caller buffer on GPU {} lent to the backend of GPU {}",
                core.rank,
                data.device().ordinal(),
                core.device.ordinal()
            )));
        }
        let e = core.err("importing a caller buffer");
        core.memory.import(data, dtype).map_err(e)
    }

    fn on_device(
        rank: DeviceId,
        device: Device,
        main: Option<meshflow_kernels::Stream>,
        config: CudaConfig,
        rendezvous: Option<Arc<dyn Rendezvous>>,
        abort: Option<AbortSignal>,
    ) -> Result<CudaBackend, BackendError> {
        let core = DeviceCore::new(rank, device, main, &config, rendezvous, abort)?;
        Ok(CudaBackend {
            core,
            user: vec![None; config.kernels.defs.len()],
            config,
            comms: Communicators::default(),
            transports: Transports::default(),
            posted: 0,
            failed: false,
            graph: GraphRecorder::default(),
            link: None,
            ipc_tried: false,
            proxy: None,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Device {
        &self.core.device
    }

    /// Device time of the last finished run in µs, from an event at its start (its first
    /// instruction that reaches the device, after the inputs are uploaded and, with
    /// [`set_start_barrier`](Self::set_start_barrier), after every rank got there; in a run
    /// recorded as a CUDA graph, the first replay) to one after all its streams were done.
    pub fn last_run_us(&self) -> Option<f64> {
        self.core.timeline.last_run_us
    }

    /// The intervals of the last finished run (profiling mode; empty otherwise).
    pub fn intervals(&self) -> &[Interval] {
        &self.core.timeline.intervals
    }

    /// Switches profiling on or off for later runs.
    pub fn set_profiling(&mut self, on: bool) {
        self.core.timeline.profile = on;
    }

    /// Whether [`CudaConfig::graph`] asks for every run to be recorded as a CUDA graph.
    pub fn records_graphs(&self) -> bool {
        self.config.graph
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
        if let Some(a) = &self.core.abort {
            a.abort(self.core.rank, reason.to_string());
        }
        if let Some(r) = &self.core.rendezvous {
            r.abort(&format!("rank {} failed: {reason}", self.core.rank));
        }
    }

    /// Makes every run start with a barrier of `parties` ranks (all ranks of the run, each with
    /// such a backend on the same rendezvous), so that device times of different ranks start
    /// together; used for timing.
    pub fn set_start_barrier(&mut self, parties: usize) {
        self.core.start_barrier = Some(parties);
    }

    /// Joins the copy-engine hub of an in-process launch (every rank of the launch joins the
    /// same hub): teams whose members all joined, with peer access between their GPUs, can
    /// use the copy-engine and NVLink MoE transports (see [`CudaConfig::transport`]).
    ///
    /// Without a hub, a backend given a rendezvous that spans processes meets the members of
    /// its teams in other processes of this host through it and shares memory with them over
    /// CUDA IPC: teams
    /// whose every pair of ranks can (another process, peer access between their GPUs) use
    /// those transports too; the others use NCCL (the reason is logged).
    pub fn set_peer_hub(&mut self, hub: Arc<PeerHub>) {
        hub.register(self.core.rank, &self.core.device);
        self.link = Some(Arc::new(HubLink::new(hub)));
    }

    /// Keeps this rank off CUDA IPC: its teams with ranks of other processes use NCCL. Every
    /// rank of a run must agree (a rank with a link waits at the rendezvous for its teammates'
    /// verdicts): launchers call it on all ranks or none.
    pub fn disable_ipc_peers(&mut self) {
        self.ipc_tried = true;
    }

    /// Makes the CUDA IPC link before the first program with a team of several ranks, unless
    /// the rank has a hub, was kept off CUDA IPC, has no rendezvous or one of threads of this
    /// process only, or NCCL is forced.
    fn ensure_link(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError> {
        if self.link.is_some()
            || self.ipc_tried
            || self.config.transport == Some(Transport::Nccl)
            || !info.teams.values().any(|t| t.members.len() > 1)
        {
            return Ok(());
        }
        let Some(rdv) = self.core.rendezvous.clone() else {
            return Ok(());
        };
        self.ipc_tried = true;
        if !rdv.spans_processes() {
            return Ok(());
        }
        self.link = Some(Arc::new(IpcLink::new(&self.core, rdv)?));
        Ok(())
    }

    /// Reaches ranks of other nodes (by `topology`) through `proxy`, this rank's host proxy:
    /// collective permutes and MoE dispatch/combine with a peer on another node use it, the
    /// rest stays on NCCL (also with ranks of its node in other processes: no CUDA IPC, see
    /// [`CudaBackend::disable_ipc_peers`]). CUDA graph recording is refused for programs that
    /// use it.
    pub fn set_proxy(&mut self, proxy: Arc<Proxy>, topology: Topology) {
        self.proxy = Some(ProxyAccess { proxy, topology });
        self.ipc_tried = true;
    }

    /// Tells the ranks of other nodes that this rank failed (their waits for its messages end
    /// at once with the reason).
    pub fn notify_proxy_failure(&self, reason: &str) {
        if let Some(p) = &self.proxy {
            p.proxy.notify_failure(self.core.rank, reason);
        }
    }

    /// Aborts every communicator and transport (unblocks device work waiting for a peer) and
    /// marks the rank failed.
    fn abort_all(&mut self) {
        self.failed = true;
        // Unblock the device first (signal words, NCCL), so that releasing the transports,
        // which may wait for the device, cannot wait for a peer that will never come.
        if let Some(l) = &self.link {
            l.abandon();
        }
        self.comms.abort_all(self.core.rank);
        self.transports.release(false);
    }

    /// Logs (debug, target `meshflow::peer_waits`) where the host of the run just finished
    /// waited: the start barrier, the time from the run's start event to its first compute
    /// launch, and the copy-engine posts' waits for peers (see `PeerWaits`). With one process
    /// per GPU, compare with the same program's in-process run to see whether a slower run is
    /// the host's doing.
    fn log_host_waits(&mut self) {
        let h = std::mem::take(&mut self.core.run_host);
        let w = self
            .link
            .as_ref()
            .map(|l| l.drain_waits())
            .unwrap_or_default();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        tracing::debug!(
            target: "meshflow::peer_waits",
            rank = self.core.rank,
            run = self.core.runs,
            link = self.link.as_ref().map_or("none", |l| l.name()),
            barrier_us = us(h.barrier),
            first_compute_us = h.first_compute.map_or(f64::NAN, us),
            offer_waits = w.offers,
            offer_wait_us = us(w.offers_time),
            completion_waits = w.completions,
            completion_wait_us = us(w.completions_time),
            longest_wait_us = us(w.longest),
            "host waits of the run"
        );
    }

    /// Blocks until `done` completes (see [`DeviceCore::wait_device`]); aborts everything when
    /// a peer failed or stopped.
    fn wait_device(&mut self, done: &meshflow_kernels::Event) -> Result<(), BackendError> {
        let comms = &self.comms;
        let link = self.link.as_ref();
        let rank = self.core.rank;
        let poll = || {
            comms
                .async_error(rank)
                .or_else(|| link.and_then(|l| l.failure(LOST_PEER_GRACE)))
        };
        match self.core.wait_device(done, poll) {
            Ok(()) => Ok(()),
            Err(f) => {
                // A peer process that stopped is the cause of whatever the device reports
                // since (e.g. a fault reading its memory).
                let lost = self.lost_peer();
                if f.abort || lost.is_some() {
                    self.abort_all();
                }
                Err(lost.unwrap_or(f.error))
            }
        }
    }

    /// A peer process known to have stopped, as the error to report.
    fn lost_peer(&self) -> Option<BackendError> {
        self.link
            .as_ref()
            .and_then(|l| l.failure(std::time::Duration::ZERO))
    }

    fn user_kernel(&mut self, k: KernelId) -> Result<UserKernel, BackendError> {
        let def = self
            .config
            .kernels
            .defs
            .get(k.index())
            .ok_or_else(|| BackendError::Invalid(format!("unknown kernel {k:?}")))?;
        if let Some(Some(u)) = self.user.get(k.index()) {
            return Ok(u.clone());
        }
        let u = UserKernel::load(&self.core.device, &def.image, &def.function).map_err(|e| {
            BackendError::Kernel {
                name: def.name.clone(),
                message: format!("loading on rank {}: {e}", self.core.rank),
            }
        })?;
        if let Some(slot) = self.user.get_mut(k.index()) {
            *slot = Some(u.clone());
        }
        Ok(u)
    }

    /// Runs `op` on the core between opening and closing a compute interval, retiring its
    /// temporaries after it.
    fn computing(
        &mut self,
        name: &'static str,
        outputs: &[&TensorView<CudaBuffer>],
        ctx: InstCtx<'_>,
        op: impl FnOnce(&mut DeviceCore) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let core = &mut self.core;
        core.step_started()?;
        core.run_host.computing();
        let opened = core
            .timeline
            .open(
                &core.streams,
                core.current,
                IntervalKind::Compute,
                name,
                None,
                ctx.preorder,
                ctx.iteration,
            )
            .map_err(core.err("cuEventRecord"))?;
        core.before_writes(outputs)?;
        let r = op(core);
        let retired = core.retire_scratch();
        r?;
        retired?;
        core.timeline
            .close(&core.streams, opened)
            .map_err(core.err("cuEventRecord"))?;
        // Deferred pulls whose offers arrived meanwhile start now.
        core.finish_deferred(Finish::Ready)
    }
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

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.failed {
            // Abort first: device work waiting for a peer must stop before memory is freed.
            self.abort_all();
        } else {
            self.transports.release(true);
            self.comms.checkin_all();
        }
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Comm = CudaComm;

    fn device(&self) -> DeviceId {
        self.core.rank
    }

    fn stream_pool_size(&self) -> usize {
        self.core.streams.len() - 1
    }

    fn prepare(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError> {
        self.core.current = 0;
        self.core.group = None;
        // Pulls a failed run left deferred belong to no run any more.
        self.core.deferred.clear();
        self.comms.prepare(&self.core, info.teams)?;
        self.ensure_link(info)?;
        let env = Environment {
            link: self.link.as_ref(),
            proxy: self.proxy.as_ref(),
            config: &self.config,
        };
        self.transports.prepare(&self.core, info, &env)
    }

    fn transport_of(&self, label: CommLabel) -> Option<Transport> {
        self.transports.transport_of(label)
    }

    /// Both MoE transports (NCCL, NVLink) move native rows and FP8 rows with per-token or
    /// per-128-channel scales; the dispatch checks that the token width allows the scales.
    fn supports_moe_wire(&self, _wire: meshflow_ir::MoeWire) -> bool {
        true
    }

    fn allocate(&mut self, dtype: DType, shape: &[u64]) -> Result<CudaBuffer, BackendError> {
        let n = crate::runtime::data::numel_of(shape)
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
        let n = usize::try_from(n)
            .map_err(|_| BackendError::Invalid(format!("{shape:?} is too large")))?;
        self.core.fence_released()?;
        let e = self.core.err("allocate (cuMemAlloc)");
        self.core.memory.allocate(dtype, n).map_err(e)
    }

    fn deallocate(&mut self, buffer: CudaBuffer) -> Result<(), BackendError> {
        if self.core.memory.get(buffer).is_none() {
            return Err(BackendError::Invalid(format!(
                "release of an unknown buffer {buffer:?}"
            )));
        }
        // Deferred pulls into this buffer are enqueued, and a permute's pending peer reads of
        // it end, before it can be reused; the buffer is fenced at the next allocation (one
        // set of events for every buffer released since).
        self.core.finish_deferred(Finish::Writing(&buffer))?;
        self.core.settle_peer_reads(Some(&[buffer]))?;
        self.core.memory.release(buffer);
        Ok(())
    }

    fn upload(&mut self, buffer: CudaBuffer, data: &TensorData) -> Result<(), BackendError> {
        self.core.finish_deferred(Finish::All)?;
        self.core.settle_peer_reads(Some(&[buffer]))?;
        self.core.upload(buffer, data)
    }

    fn download(&mut self, view: &TensorView<CudaBuffer>) -> Result<TensorData, BackendError> {
        self.core.finish_deferred(Finish::All)?;
        self.core.download(view)
    }

    fn set_current_stream(&mut self, stream: StreamIndex) -> Result<(), BackendError> {
        self.core.current = self.core.check_stream(stream)?;
        Ok(())
    }

    fn synchronize(&mut self, stream: StreamIndex, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        let core = &mut self.core;
        let other = core.check_stream(stream)?;
        core.step_started()?;
        if other == core.current {
            return Ok(());
        }
        let o = core.streams[other].clone();
        core.stream()
            .join(&o)
            .map_err(core.err("synchronize (cuStreamWaitEvent)"))
    }

    fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TensorView<CudaBuffer>],
        outputs: &[&TensorView<CudaBuffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.computing(op.name(), outputs, ctx, |core| {
            core.compute_op(op, inputs, outputs)
        })
    }

    fn kernel(&self, name: &str) -> Option<KernelId> {
        self.config
            .kernels
            .defs
            .iter()
            .position(|d| d.name == name)
            .map(KernelId::new)
    }

    fn call_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<CudaBuffer>],
        outputs: &[&TensorView<CudaBuffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.core.step_started()?;
        let k = self.user_kernel(kernel)?;
        let def = self.config.kernels.defs[kernel.index()].clone();
        self.computing("call_kernel", outputs, ctx, |core| {
            core.call_user(&k, &def, inputs, outputs, args)
        })
    }

    fn post(
        &mut self,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<CudaComm, BackendError> {
        if let Some(e) = self.core.aborted() {
            return Err(e);
        }
        #[cfg(feature = "fault-injection")]
        if self.config.exit_at_comm == Some(self.posted) {
            tracing::warn!(
                rank = self.core.rank,
                "injected process exit at communication #{}",
                self.posted
            );
            std::process::exit(crate::runtime::faults::FAULT_EXIT_STATUS);
        }
        self.posted += 1;
        self.core.step_started()?;
        if self.transports.transport_of(request.label()) != Some(Transport::CopyEngine) {
            // Other transports' device or host waits may depend on peers' hosts: deferred
            // pulls go first (see `deferred.rs`).
            self.core.finish_deferred(Finish::All)?;
        }
        self.core.before_writes(&request_outputs(request))?;
        let transport = self.transports.carrier_of(request.label())?;
        let mut cx = PostCx {
            core: &mut self.core,
            comms: &self.comms,
        };
        let posted = transport.post(&mut cx, request, ctx);
        let core = &mut self.core;
        // A communication on the stream ends its profiling interval with its own device work:
        // the events recorded below (the temporaries' retirement, the completion) come after,
        // so that the interval spans what the communication does, as a kernel timed alone.
        let posted = match posted {
            Ok(Posted::OnStream(opened)) => core.close_op(opened).map(|()| Posted::OnStream(None)),
            other => other,
        };
        let retired = core.retire_scratch();
        let posted = posted?;
        retired?;
        match posted {
            Posted::Events(events) => Ok(CudaComm::done_after(
                events.into_iter().map(Rc::new).collect(),
            )),
            Posted::Deferred(comm) => Ok(comm),
            Posted::OnStream(_) => core.complete_on_stream(),
        }
    }

    fn begin_group(&mut self) -> Result<(), BackendError> {
        if self.core.group.is_some() {
            return Err(BackendError::Invalid("nested coalescing group".into()));
        }
        let lib = self.comms.loaded().map_err(|_| {
            BackendError::Invalid("a coalescing group in a program without teams".into())
        })?;
        let lib = lib.clone();
        self.core.step_started()?;
        self.core.finish_deferred(Finish::All)?;
        nccl::group_start(&lib).map_err(self.core.err("ncclGroupStart"))?;
        self.core.group = Some(Group::default());
        Ok(())
    }

    fn end_group(&mut self, label: CommLabel, ctx: InstCtx<'_>) -> Result<CudaComm, BackendError> {
        let lib = self.comms.loaded()?.clone();
        let transport = self.transports.transport_of(label);
        let core = &mut self.core;
        let e = core.err("ncclGroupEnd");
        core.end_group(transport, ctx, || nccl::group_end(&lib).map_err(e))
    }

    fn check_graph(&self) -> Result<(), BackendError> {
        let rank = self.core.rank;
        if let Some((transport, why)) = self.transports.capture_blocker() {
            return Err(BackendError::Invalid(format!(
                "rank {rank}: this program cannot be recorded as a CUDA graph: it uses the \
                 {transport} transport ({why})"
            )));
        }
        if self.proxy.is_some() {
            return Err(BackendError::Invalid(format!(
                "rank {rank}: graph recording is not supported in runs split into nodes \
                 (transfers through the host proxy are staged by the host)"
            )));
        }
        Ok(())
    }

    fn begin_graph(&mut self) -> Result<(), BackendError> {
        self.check_graph()?;
        self.core.finish_deferred(Finish::All)?;
        self.graph.begin(&mut self.core)
    }

    fn end_graph(&mut self, replays: usize) -> Result<(), BackendError> {
        self.graph.end(&mut self.core, replays)
    }

    fn wait(&mut self, comm: &CudaComm, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        if let Some(e) = self.core.aborted() {
            return Err(e);
        }
        // A deferred pull (and those posted before it) is enqueued first.
        self.core.finish_deferred(Finish::Through(&comm.events))?;
        let events = comm.events.borrow();
        let events = events.as_ref().ok_or_else(|| {
            BackendError::Invalid(
                "wait on a communication whose coalescing group has not ended".into(),
            )
        })?;
        let core = &self.core;
        if comm.stream == Some(core.current) {
            // Issued on this very stream: its work precedes whatever follows in stream order.
            return Ok(());
        }
        for e in events {
            core.stream()
                .wait(e)
                .map_err(core.err("wait (cuStreamWaitEvent)"))?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        if self.core.group.is_some() {
            return Err(BackendError::Invalid(
                "a coalescing group was never ended".into(),
            ));
        }
        let core = &mut self.core;
        core.step_started()?;
        core.runs += 1;
        core.finish_deferred(Finish::All)?;
        core.settle_peer_reads(None)?;
        let main = core.streams[0].clone();
        for w in core.all_streams().skip(1) {
            main.join(w).map_err(core.err("cuStreamWaitEvent"))?;
        }
        let end = core
            .timeline
            .end_event(&main)
            .map_err(core.err("cuEventRecord"))?;
        let done = main.record_event().map_err(core.err("cuEventRecord"))?;
        if let Err(e) = self.wait_device(&done) {
            self.core.timeline.reset();
            return Err(e);
        }
        if let Some(e) = self.transports.transfer_failure(self.core.rank) {
            self.core.timeline.reset();
            return Err(e);
        }
        self.graph.end_run(&mut self.core)?;
        self.core.pending_reads.clear();
        if let Err(e) = self.transports.check_status(&self.core) {
            // A device wait for a peer gave up: the team's transports cannot go on.
            let gave_up = matches!(
                e,
                BackendError::Aborted { .. } | BackendError::Timeout { .. }
            );
            if gave_up {
                self.abort_all();
            }
            return Err(match self.lost_peer() {
                Some(BackendError::Aborted {
                    failed_rank,
                    reason,
                }) if gave_up => {
                    let detail = match e {
                        BackendError::Aborted { reason, .. } => reason,
                        other => other.to_string(),
                    };
                    BackendError::Aborted {
                        failed_rank,
                        reason: format!("{reason}; {detail}"),
                    }
                }
                lost => lost.unwrap_or(e),
            });
        }
        self.log_host_waits();
        let core = &mut self.core;
        let rank = core.rank;
        let e = core.err("cuEventElapsedTime");
        core.timeline.collect(rank, end).map_err(e)
    }
}
