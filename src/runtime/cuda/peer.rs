//! The copy-engine transport: collective permutes and broadcasts between the in-process ranks
//! of one run (one thread per GPU) as peer copies, without NCCL and without SMs.
//!
//! Protocol (pull): for every (communication label, instance, sender, receiver) the sender
//! records a *ready* event on its current stream (its send data is complete there) and offers
//! `(send bytes, ready)` in the run's [`PeerHub`]; the receiver takes the offer (the host
//! waits until the sender has posted), makes its copy stream wait for `ready`, pulls the bytes
//! with `cuMemcpyPeerAsync` (a copy engine of the receiving GPU), records a *done* event and
//! hands it back through the hub. The sender takes every *done* event of its sends before its
//! post returns (the receivers post the same instruction at the same time, so this host wait
//! is short) and attaches them to its send buffer: every later op that writes that buffer
//! first waits for them on its stream (write-after-read ordering is kept per buffer, so a
//! `wait` only waits for this rank's own receive and the next step's data can be offered
//! without waiting for the peers' reads of the last one). The sender's peer-read stream also
//! waits for them, so that deallocation, the allocator's reuse of send temporaries and the end
//! of the run are ordered after the peers' reads.
//!
//! A reduce-scatter (sum, floating point) pulls chunk `my` of every peer's send buffer into a
//! temporary and adds them to its own chunk (an elementwise kernel: the only SM work).
//!
//! Every host wait watches the run's abort signal and the backend's timeout.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::{CommKind, DeviceId, ReduceOp};
use meshflow_kernels::{Device, DeviceBuffer, Event};

use super::backend::CudaBackend;
use super::memory::CudaBuffer;
use super::profile::IntervalKind;
use crate::runtime::backend::{BackendError, CommRequest, InstCtx, TeamInfo, TensorView};

/// How communications move between GPUs.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaTransport {
    /// Copy engine for collective permutes and broadcasts of teams whose members all run in
    /// this process with peer access between every pair; NCCL otherwise.
    #[default]
    Auto,
    /// NCCL for everything.
    Nccl,
    /// Copy engine where possible (as `Auto`); a team that cannot use it is an error.
    CopyEngine,
}

impl CudaTransport {
    /// The runtime transport for the compile-time choice of the cost model
    /// ([`PassOptions::cost_model`](crate::pipeline::PassOptions)), so that the same
    /// choice decides the decomposition and moves the bytes.
    pub fn from_compiled(t: meshflow_passes::Transport) -> CudaTransport {
        match t {
            meshflow_passes::Transport::Nccl => CudaTransport::Nccl,
            meshflow_passes::Transport::CopyEngine => CudaTransport::CopyEngine,
        }
    }
}

/// Which stream runs a copy-engine pull.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum CopyStream {
    /// The stream the communication is posted on (ordered like an NCCL call there).
    #[default]
    Current,
    /// A copy stream of the rank: the pull starts once the posting stream has reached the
    /// post, and only a `wait` orders later work after it.
    Dedicated,
}

/// What one offer/done slot of the hub is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    label: usize,
    seq: u64,
    from: DeviceId,
    to: DeviceId,
}

/// A sender's data, ready once `ready` has completed.
struct Offer {
    src: DeviceBuffer,
    ready: Event,
}

#[derive(Default)]
struct HubState {
    devices: HashMap<DeviceId, Device>,
    offers: HashMap<Key, Offer>,
    dones: HashMap<Key, Event>,
    /// Per team (members): copy engine or not, decided once for every member.
    decisions: HashMap<Vec<DeviceId>, bool>,
}

/// The meeting point of the in-process ranks of one run for copy-engine transfers: which
/// GPU each rank runs on, and the offers and completions of posted transfers.
#[derive(Default)]
pub struct PeerHub {
    state: Mutex<HubState>,
    changed: Condvar,
}

impl std::fmt::Debug for PeerHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("PeerHub")
            .field("ranks", &s.devices.len())
            .field("offers", &s.offers.len())
            .field("dones", &s.dones.len())
            .finish()
    }
}

impl PeerHub {
    /// An empty hub for one run.
    pub fn new() -> Arc<PeerHub> {
        Arc::new(PeerHub::default())
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `rank` runs on `device`.
    pub(super) fn register(&self, rank: DeviceId, device: &Device) {
        self.lock().devices.insert(rank, device.clone());
        self.changed.notify_all();
    }

    /// Waits (host) until `pred` returns `Some`, re-checking on every hub change and every
    /// 5 ms (for aborts), until `deadline`.
    fn wait_for<T>(
        &self,
        deadline: Instant,
        abort: &dyn Fn() -> Option<BackendError>,
        mut pred: impl FnMut(&mut HubState) -> Option<T>,
    ) -> Result<T, Option<BackendError>> {
        // Peers usually post within microseconds: spin (yielding) before sleeping.
        for _ in 0..SPINS {
            if let Some(v) = pred(&mut self.lock()) {
                return Ok(v);
            }
            std::thread::yield_now();
        }
        let mut g = self.lock();
        loop {
            if let Some(v) = pred(&mut g) {
                return Ok(v);
            }
            if let Some(e) = abort() {
                return Err(Some(e));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(None);
            }
            let slice = (deadline - now).min(Duration::from_millis(5));
            g = self
                .changed
                .wait_timeout(g, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn put_offer(&self, key: Key, offer: Offer) {
        self.lock().offers.insert(key, offer);
        self.changed.notify_all();
    }

    fn put_done(&self, key: Key, done: Event) {
        self.lock().dones.insert(key, done);
        self.changed.notify_all();
    }
}

/// The elements `[first, last + 1)` a view touches (empty for an empty view).
fn element_range(v: &TensorView<CudaBuffer>) -> (u64, u64) {
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

/// Host waits on the hub spin this many times (yielding the thread) before sleeping.
const SPINS: usize = 2000;

/// A transfer this rank pulled: its `done` event on this GPU.
struct Pulled {
    done: Event,
}

impl CudaBackend {
    /// Posts `request` over the copy engine when its team uses it (permutes that leave the
    /// rank, broadcasts); `None` when it goes through NCCL.
    pub(super) fn post_ce(
        &mut self,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Option<Vec<Event>>, BackendError> {
        match request {
            CommRequest::Permute {
                label,
                team,
                send_peer,
                recv_peer,
                input,
                output,
            } if self.team_uses_ce(team.slot) => {
                // Every member counts every instance, also one that stays on the rank, so
                // that the instance numbers of a label agree across ranks.
                let seq = self.next_seq(*label);
                if *send_peer == team.my_index && *recv_peer == team.my_index {
                    return Ok(None);
                }
                self.permute_ce(
                    *label, seq, team, *send_peer, *recv_peer, input, output, ctx,
                )
                .map(Some)
            }
            CommRequest::Collective {
                label,
                kind: CommKind::Broadcast,
                team,
                input,
                output,
                root,
                ..
            } if self.team_uses_ce(team.slot) && team.members.len() > 1 => self
                .broadcast_ce(*label, team, root.unwrap_or(0), *input, *output, ctx)
                .map(Some),
            CommRequest::Collective {
                label,
                kind: CommKind::ReduceScatter,
                team,
                input: Some(input),
                output: Some(output),
                op: ReduceOp::Sum,
                ..
            } if self.team_uses_ce(team.slot)
                && team.members.len() > 1
                && input.dtype.is_float() =>
            {
                self.reduce_scatter_ce(*label, team, input, output, ctx)
                    .map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Whether the team in `slot` moves its permutes and broadcasts over the copy engine.
    pub(super) fn team_uses_ce(&self, slot: usize) -> bool {
        self.group.is_none() && self.team_ce.get(slot).copied().unwrap_or(false)
    }

    /// Decides, for every team of the program, whether it uses the copy engine: all members in
    /// this run's hub and peer access between every pair (decided once per team for all
    /// members, so the ranks agree), then enables this GPU's access to the members' memory.
    pub(super) fn prepare_peer(&mut self, teams: &[TeamInfo]) -> Result<(), BackendError> {
        self.team_ce.clear();
        self.team_ce.resize(teams.len(), false);
        let policy = self.config.transport;
        let Some(hub) = self.hub.clone() else {
            if policy == CudaTransport::CopyEngine && teams.iter().any(|t| t.members.len() > 1) {
                return Err(BackendError::Invalid(format!(
                    "rank {}: the copy-engine transport needs every rank in this process \
                     (an in-process run)",
                    self.rank
                )));
            }
            return Ok(());
        };
        if policy == CudaTransport::Nccl {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.timeout;
        for t in teams {
            if t.members.len() < 2 {
                continue;
            }
            let abort = || self.aborted_error();
            let members = t.members.clone();
            let devices = hub
                .wait_for(deadline, &abort, |s| {
                    members
                        .iter()
                        .map(|m| s.devices.get(m).cloned())
                        .collect::<Option<Vec<Device>>>()
                })
                .map_err(|e| {
                    e.unwrap_or_else(|| BackendError::Timeout {
                        peer: t.members[0],
                        waited: self.config.timeout,
                        what: format!("the members of team {:?} to start", t.members),
                    })
                })?;
            let decided = {
                let mut s = hub.lock();
                match s.decisions.get(&t.members) {
                    Some(&d) => d,
                    None => {
                        let mut ok = true;
                        for a in &devices {
                            for b in &devices {
                                ok &= a.can_access_peer(b).unwrap_or(false);
                            }
                        }
                        s.decisions.insert(t.members.clone(), ok);
                        ok
                    }
                }
            };
            if !decided {
                if policy == CudaTransport::CopyEngine {
                    return Err(BackendError::Invalid(format!(
                        "rank {}: the GPUs of team {:?} cannot access each other's memory; \
                         the copy-engine transport needs peer access",
                        self.rank, t.members
                    )));
                }
                continue;
            }
            for d in &devices {
                self.device
                    .enable_peer_access(d)
                    .map_err(self.err("cuCtxEnablePeerAccess"))?;
            }
            if let Some(slot) = self.team_ce.get_mut(t.slot) {
                *slot = true;
            }
        }
        Ok(())
    }

    fn aborted_error(&self) -> Option<BackendError> {
        self.aborted()
    }

    /// The next instance number of communication `label` on this rank.
    fn next_seq(&mut self, label: usize) -> u64 {
        let c = self.ce_seq.entry(label).or_insert(0);
        let s = *c;
        *c += 1;
        s
    }

    fn hub(&self) -> Result<Arc<PeerHub>, BackendError> {
        self.hub
            .clone()
            .ok_or_else(|| BackendError::Invalid(format!("rank {}: no copy-engine hub", self.rank)))
    }

    fn timeout_error(&self, peer: DeviceId, what: String) -> BackendError {
        BackendError::Timeout {
            peer,
            waited: self.config.timeout,
            what,
        }
    }

    /// Offers the send region to `to` (a ready event per receiver, on the current stream).
    fn offer(
        &self,
        hub: &PeerHub,
        label: usize,
        seq: u64,
        to: DeviceId,
        src: &DeviceBuffer,
    ) -> Result<(), BackendError> {
        let ready = self
            .stream()
            .record_event()
            .map_err(self.err("cuEventRecord"))?;
        hub.put_offer(
            Key {
                label,
                seq,
                from: self.rank,
                to,
            },
            Offer {
                src: src.clone(),
                ready,
            },
        );
        Ok(())
    }

    /// Pulls the offer of `from` into `dst` on the copy stream of the configured kind; returns
    /// the local done event (after handing one to the sender).
    #[allow(clippy::too_many_arguments)]
    fn pull(
        &mut self,
        hub: &PeerHub,
        name: &'static str,
        label: usize,
        seq: u64,
        from: DeviceId,
        dst: &DeviceBuffer,
        ctx: InstCtx<'_>,
    ) -> Result<Pulled, BackendError> {
        let key = Key {
            label,
            seq,
            from,
            to: self.rank,
        };
        let deadline = Instant::now() + self.config.timeout;
        let abort = || self.aborted_error();
        let offer = hub
            .wait_for(deadline, &abort, |s| s.offers.remove(&key))
            .map_err(|e| {
                e.unwrap_or_else(|| {
                    self.timeout_error(from, format!("{name} #{label} instance {seq} data"))
                })
            })?;
        if offer.src.len() != dst.len() {
            return Err(BackendError::Invalid(format!(
                "{name}: rank {from} sends {} bytes, rank {} receives {}",
                offer.src.len(),
                self.rank,
                dst.len()
            )));
        }
        let on = match self.config.copy_stream {
            CopyStream::Current => self.current,
            CopyStream::Dedicated => {
                // The pull must not overwrite `dst` before the posting stream is done with it.
                let cs = self.copy_stream.clone();
                cs.join(self.stream())
                    .map_err(self.err("cuStreamWaitEvent"))?;
                self.streams.len()
            }
        };
        let s = if on == self.streams.len() {
            self.copy_stream.clone()
        } else {
            self.streams[on].clone()
        };
        s.wait(&offer.ready)
            .map_err(self.err("cuStreamWaitEvent (peer data ready)"))?;
        let opened = self
            .timeline
            .open_on(&s, on, IntervalKind::Comm, name, ctx.inst, ctx.iteration)
            .map_err(self.err("cuEventRecord"))?;
        dst.copy_from(&s, &offer.src)
            .map_err(self.err("cuMemcpyPeerAsync"))?;
        self.timeline
            .close_on(&s, opened)
            .map_err(self.err("cuEventRecord"))?;
        let for_sender = s.record_event().map_err(self.err("cuEventRecord"))?;
        hub.put_done(key, for_sender);
        let done = s.record_event().map_err(self.err("cuEventRecord"))?;
        Ok(Pulled { done })
    }

    /// Takes the done events of this rank's sends to `to` (the host waits for the receivers'
    /// posts); the peer-read stream waits for them.
    fn collect_dones(
        &mut self,
        hub: &PeerHub,
        name: &'static str,
        label: usize,
        seq: u64,
        to: &[DeviceId],
    ) -> Result<Vec<Event>, BackendError> {
        let deadline = Instant::now() + self.config.timeout;
        let mut out = Vec::with_capacity(to.len());
        for &peer in to {
            let key = Key {
                label,
                seq,
                from: self.rank,
                to: peer,
            };
            let abort = || self.aborted_error();
            let done = hub
                .wait_for(deadline, &abort, |s| s.dones.remove(&key))
                .map_err(|e| {
                    e.unwrap_or_else(|| {
                        self.timeout_error(
                            peer,
                            format!("{name} #{label} instance {seq}: the receiver's copy"),
                        )
                    })
                })?;
            self.peer_reads
                .wait(&done)
                .map_err(self.err("cuStreamWaitEvent (peer read done)"))?;
            out.push(done);
        }
        Ok(out)
    }

    /// Records that peers read the elements of `view` until `dones` complete (see
    /// [`Self::before_writes`]).
    fn add_peer_reads(&mut self, view: &TensorView<CudaBuffer>, dones: Vec<Event>) {
        if dones.is_empty() {
            return;
        }
        let range = element_range(view);
        self.pending_reads
            .entry(view.buffer)
            .or_default()
            .extend(dones.into_iter().map(|e| (range, Rc::new(e))));
    }

    /// Orders an op that writes `outputs` after the peers' reads of their buffers (the current
    /// stream waits for them).
    pub(super) fn before_writes(
        &mut self,
        outputs: &[&TensorView<CudaBuffer>],
    ) -> Result<(), BackendError> {
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
                    self.streams[self.current].wait(ev).map_err(|err| {
                        super::backend::dev_err(self.rank, "cuStreamWaitEvent", err)
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Retires send temporaries once the peers' reads (which the peer-read stream waits for
    /// already) and this rank's own uses on the current stream are done.
    fn retire_after_peer_reads(&mut self, temps: Vec<DeviceBuffer>) -> Result<(), BackendError> {
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

    /// A collective permute over the copy engine; returns the events a `wait` waits for.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn permute_ce(
        &mut self,
        label: usize,
        seq: u64,
        team: &TeamInfo,
        send_peer: usize,
        recv_peer: usize,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Vec<Event>, BackendError> {
        const NAME: &str = "collective_permute";
        let hub = self.hub()?;
        let member = |i: usize| {
            team.members.get(i).copied().ok_or_else(|| {
                BackendError::Invalid(format!(
                    "{NAME}: peer {i} is outside the team {:?}",
                    team.members
                ))
            })
        };
        let (to, from) = (member(send_peer)?, member(recv_peer)?);
        let src = self.input_region(input)?;
        let send_temps = std::mem::take(&mut self.scratch);
        self.offer(&hub, label, seq, to, &src)?;
        let slot = self.output_slot(output, &[input])?;
        let pulled = self.pull(&hub, NAME, label, seq, from, &slot.buf, ctx)?;
        let events = vec![pulled.done];
        let dones = self.collect_dones(&hub, NAME, label, seq, &[to])?;
        if !slot.is_direct() {
            // The unstaging copy runs on the current stream after the pull, and after the
            // peer's read of the send view (which may share the receive view's buffer).
            let s = self.stream().clone();
            if self.config.copy_stream == CopyStream::Dedicated {
                s.join(&self.copy_stream)
                    .map_err(self.err("cuStreamWaitEvent"))?;
            }
            for d in &dones {
                s.wait(d).map_err(self.err("cuStreamWaitEvent"))?;
            }
        }
        self.finish_output(slot)?;
        self.retire_after_peer_reads(send_temps)?;
        self.add_peer_reads(input, dones);
        Ok(events)
    }

    /// A broadcast over the copy engine (every non-root pulls the root's data); returns the
    /// events a `wait` waits for.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn broadcast_ce(
        &mut self,
        label: usize,
        team: &TeamInfo,
        root: usize,
        input: Option<&TensorView<CudaBuffer>>,
        output: Option<&TensorView<CudaBuffer>>,
        ctx: InstCtx<'_>,
    ) -> Result<Vec<Event>, BackendError> {
        const NAME: &str = "broadcast";
        let hub = self.hub()?;
        let root_rank = team.members.get(root).copied().ok_or_else(|| {
            BackendError::Invalid(format!(
                "{NAME}: root {root} is outside the team {:?}",
                team.members
            ))
        })?;
        let seq = self.next_seq(label);
        if team.my_index == root {
            let i = input.ok_or_else(|| {
                BackendError::Invalid(format!("{NAME}: the root holds no send buffer"))
            })?;
            let src = self.input_region(i)?;
            let send_temps = std::mem::take(&mut self.scratch);
            let others: Vec<DeviceId> = team
                .members
                .iter()
                .copied()
                .filter(|&m| m != self.rank)
                .collect();
            for &m in &others {
                self.offer(&hub, label, seq, m, &src)?;
            }
            let mut events = Vec::new();
            if let Some(o) = output {
                let opened = self
                    .timeline
                    .open(
                        &self.streams,
                        self.current,
                        IntervalKind::Comm,
                        NAME,
                        ctx.inst,
                        ctx.iteration,
                    )
                    .map_err(self.err("cuEventRecord"))?;
                let slot = self.output_slot(o, &[i])?;
                slot.buf
                    .copy_from(self.stream(), &src)
                    .map_err(self.err("broadcast (local copy)"))?;
                self.finish_output(slot)?;
                self.timeline
                    .close(&self.streams, opened)
                    .map_err(self.err("cuEventRecord"))?;
                events.push(
                    self.stream()
                        .record_event()
                        .map_err(self.err("cuEventRecord"))?,
                );
            }
            let dones = self.collect_dones(&hub, NAME, label, seq, &others)?;
            self.retire_after_peer_reads(send_temps)?;
            self.add_peer_reads(i, dones);
            Ok(events)
        } else {
            let o = output.ok_or_else(|| {
                BackendError::Invalid(format!(
                    "{NAME}: this rank takes part but does not hold the receive buffer"
                ))
            })?;
            let slot = self.output_slot(o, &[])?;
            let pulled = self.pull(&hub, NAME, label, seq, root_rank, &slot.buf, ctx)?;
            if self.config.copy_stream == CopyStream::Dedicated && !slot.is_direct() {
                let e = self
                    .copy_stream
                    .record_event()
                    .map_err(self.err("cuEventRecord"))?;
                self.stream()
                    .wait(&e)
                    .map_err(self.err("cuStreamWaitEvent"))?;
            }
            self.finish_output(slot)?;
            Ok(vec![pulled.done])
        }
    }

    /// A sum reduce-scatter over the copy engine: every rank pulls its chunk of every peer's
    /// send buffer into a temporary, then adds them to its own chunk on the current stream.
    pub(super) fn reduce_scatter_ce(
        &mut self,
        label: usize,
        team: &TeamInfo,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Vec<Event>, BackendError> {
        const NAME: &str = "reduce_scatter";
        let hub = self.hub()?;
        let d = team.members.len();
        if input.numel() != output.numel() * d as u64 || input.dtype != output.dtype {
            return Err(BackendError::Invalid(format!(
                "{NAME}: a send buffer of {} {} cannot be scattered into {} chunks of {} {}",
                input.numel(),
                input.dtype,
                d,
                output.numel(),
                output.dtype
            )));
        }
        let seq = self.next_seq(label);
        let src = self.input_region(input)?;
        let send_temps = std::mem::take(&mut self.scratch);
        let my = team.my_index;
        // Peers in ring order from this rank (my + 1, my + 2, ...): at every point of the
        // sequence each rank's memory is read by one peer, instead of every rank pulling from
        // member 0 first.
        let others: Vec<(usize, DeviceId)> = (1..d)
            .map(|k| (my + k) % d)
            .filter_map(|i| Some((i, *team.members.get(i)?)))
            .filter(|&(_, m)| m != self.rank)
            .collect();
        for &(_, m) in &others {
            self.offer(&hub, label, seq, m, &src)?;
        }
        let mine = src.chunk(my, d).map_err(self.err("reduce_scatter chunk"))?;
        let chunk_bytes = mine.len();
        let slot = self.output_slot(output, &[input])?;
        let received = self.temp(chunk_bytes * others.len())?;
        let s = self.stream().clone();
        let deadline = Instant::now() + self.config.timeout;
        let mut offers = Vec::with_capacity(others.len());
        for &(_, from) in &others {
            let key = Key {
                label,
                seq,
                from,
                to: self.rank,
            };
            let abort = || self.aborted_error();
            let offer = hub
                .wait_for(deadline, &abort, |h| h.offers.remove(&key))
                .map_err(|e| {
                    e.unwrap_or_else(|| {
                        self.timeout_error(from, format!("{NAME} #{label} instance {seq} data"))
                    })
                })?;
            if offer.src.len() != src.len() {
                return Err(BackendError::Invalid(format!(
                    "{NAME}: rank {from} sends {} bytes, rank {} sends {}",
                    offer.src.len(),
                    self.rank,
                    src.len()
                )));
            }
            s.wait(&offer.ready)
                .map_err(self.err("cuStreamWaitEvent (peer data ready)"))?;
            offers.push((key, offer));
        }
        let opened = self
            .timeline
            .open_on(
                &s,
                self.current,
                IntervalKind::Comm,
                NAME,
                ctx.inst,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))?;
        let kd = super::layout::kdtype(input.dtype);
        for (k, (key, offer)) in offers.into_iter().enumerate() {
            let part = offer
                .src
                .chunk(my, d)
                .map_err(self.err("reduce_scatter chunk"))?;
            let dst = received
                .view(k * chunk_bytes, chunk_bytes)
                .map_err(self.err("reduce_scatter temporary"))?;
            dst.copy_from(&s, &part)
                .map_err(self.err("cuMemcpyPeerAsync"))?;
            let for_sender = s.record_event().map_err(self.err("cuEventRecord"))?;
            hub.put_done(key, for_sender);
        }
        for k in 0..others.len() {
            let part = received
                .view(k * chunk_bytes, chunk_bytes)
                .map_err(self.err("reduce_scatter temporary"))?;
            let a = if k == 0 { &mine } else { &slot.buf };
            self.kernels
                .binary(&s, meshflow_kernels::BinaryOp::Add, kd, a, &part, &slot.buf)
                .map_err(self.err("reduce_scatter (add)"))?;
        }
        self.timeline
            .close_on(&s, opened)
            .map_err(self.err("cuEventRecord"))?;
        let targets: Vec<DeviceId> = others.iter().map(|&(_, m)| m).collect();
        let dones = self.collect_dones(&hub, NAME, label, seq, &targets)?;
        if !slot.is_direct() {
            for e in &dones {
                s.wait(e).map_err(self.err("cuStreamWaitEvent"))?;
            }
        }
        self.finish_output(slot)?;
        self.retire_after_peer_reads(send_temps)?;
        self.add_peer_reads(input, dones);
        let done = s.record_event().map_err(self.err("cuEventRecord"))?;
        Ok(vec![done])
    }
}
