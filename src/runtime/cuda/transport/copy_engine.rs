//! The copy-engine transport: collective permutes, broadcasts and sum reduce-scatters between
//! the ranks of a team whose GPUs reach each other's memory, as copies by the receiving GPU's
//! copy engines, without NCCL and without SMs (but for the reduction). The ranks meet through a
//! [`PeerLink`]: threads of one process through the launch's hub, or processes of one host
//! through CUDA IPC (`peers.rs` says how each moves offers and completions).
//!
//! Protocol (pull): for every (communication label, instance, sender, receiver) the sender
//! offers its send region, ready at the current end of its current stream; the receiver takes
//! the offer (the host waits until the sender has posted), makes its copy stream wait until
//! the data is ready, pulls the bytes with a copy engine of the receiving GPU, and reports the
//! read done once its stream is past the copy. The sender collects the completions of its
//! sends and attaches them to its send buffer: every later op that writes that buffer first
//! waits for them on its stream (write-after-read ordering is kept per buffer, so a `wait`
//! only waits for this rank's own receive and the next step's data can be offered without
//! waiting for the peers' reads of the last one). The sender's peer-read stream also waits for
//! them, so that deallocation, the allocator's reuse of send temporaries and the end of the
//! run are ordered after the peers' reads. A permute sent in place (no staged send temporary,
//! no staged output) collects them lazily (`DeviceCore::defer_peer_reads`): its post returns
//! without waiting for the receiver, and the host waits only where the order matters (a later
//! write or release of the sent buffer, the end of the run); the other posts collect them
//! before they return.
//!
//! A reduce-scatter (sum, floating point) pulls chunk `my` of every peer's send buffer into a
//! temporary and adds them to its own chunk (an elementwise kernel: the only SM work).
//!
//! A pull whose sender's offer has not arrived when it is posted may be *deferred*
//! ([`CudaConfig::defer_pulls`](crate::runtime::cuda::CudaConfig) says when: by default only
//! before the run's first compute launch): the post returns without waiting for the offer
//! (across processes it takes a TCP hop, and the sender posts it only when its own host gets
//! there), so that the compute after it in program order is launched at once. It runs on a companion stream of the posting stream, joined to it at
//! the post; the stream it would have run on (the posting stream, or the copy stream) joins
//! the companion once the pull is enqueued, so that later work there stays ordered after it
//! as before. Taking the offer, the copy, the read report and the done event follow where
//! `deferred.rs` says: at a `wait` on the communication, before any
//! host wait that may block, or when the offer is found at a later post. Only a pull whose
//! post needs nothing after it is deferred: a permute sent in place into a packed output, a
//! broadcast received into one.
//!
//! Every host wait watches the run's abort signal and the backend's timeout. A step with
//! copy-engine transfers cannot be recorded as a CUDA graph (the pulls meet through host waits,
//! and the signals between GPUs do not order replays).

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use meshflow_ir::{CommKind, DeviceId, EntityRef};
use meshflow_kernels::{DeviceBuffer, Event, Stream};
use meshflow_passes::Transport;

use super::object::{CommTransport, PostCx, Posted};
use super::peers::{Key, PeerLink};
use crate::runtime::backend::{
    BackendError, CommRequest, InstCtx, PreorderIndex, TeamInfo, TensorView,
};
use crate::runtime::collective::member_buffers;
use crate::runtime::cuda::config::{CopyStream, DeferPulls};
use crate::runtime::cuda::core::{CudaComm, DeviceCore, DoneEvents};
use crate::runtime::cuda::deferred::{Finish, Pending};
use crate::runtime::cuda::memory::CudaBuffer;
use crate::runtime::cuda::profile::IntervalKind;

/// The copy-engine transport of one rank.
pub(crate) struct CopyEngine {
    link: Arc<dyn PeerLink>,
    copy_stream: CopyStream,
    /// When a pull whose offer has not arrived is deferred (see the module docs).
    defer: DeferPulls,
    /// Per communication label: instances posted so far.
    seq: HashMap<usize, u64>,
}

impl CopyEngine {
    pub fn new(link: Arc<dyn PeerLink>, copy_stream: CopyStream, defer: DeferPulls) -> CopyEngine {
        CopyEngine {
            link,
            copy_stream,
            defer,
            seq: HashMap::new(),
        }
    }

    /// Instance `seq` of communication `label`.
    fn transfer(&self, label: usize, seq: u64) -> Transfer<'_> {
        Transfer {
            link: &self.link,
            copy_stream: self.copy_stream,
            defer: self.defer,
            label,
            seq,
        }
    }

    /// The next instance number of communication `label` on this rank.
    fn next_seq(&mut self, label: usize) -> u64 {
        let c = self.seq.entry(label).or_insert(0);
        let s = *c;
        *c += 1;
        s
    }
}

impl CommTransport for CopyEngine {
    fn kind(&self) -> Transport {
        Transport::CopyEngine
    }

    fn prepare_team(&mut self, core: &DeviceCore, team: &TeamInfo) -> Result<(), BackendError> {
        self.link.prepare_copies(core, &team.members)
    }

    fn post(
        &mut self,
        cx: &mut PostCx<'_>,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        let core = &mut *cx.core;
        match request {
            CommRequest::Permute {
                label,
                team,
                send_peer,
                recv_peer,
                input,
                output,
            } => {
                // Every member counts every instance, also one that stays on the rank, so
                // that the instance numbers of a label agree across ranks.
                let seq = self.next_seq(label.index());
                if *send_peer == team.my_index && *recv_peer == team.my_index {
                    super::nccl::check_permute(input, output)?;
                    let opened = core.begin_op(request.name(), Transport::CopyEngine, ctx)?;
                    core.local_copy("collective_permute", input, output)?;
                    return Ok(Posted::OnStream(opened));
                }
                let t = self.transfer(label.index(), seq);
                t.permute(core, team, *send_peer, *recv_peer, input, output, ctx)
            }
            CommRequest::Collective {
                label,
                kind: CommKind::Broadcast,
                team,
                input,
                output,
                root,
                ..
            } => {
                let root = root.unwrap_or(0);
                let at = (team.members.len(), team.my_index, root);
                let views =
                    member_buffers(request.name(), CommKind::Broadcast, at, *input, *output)?;
                let seq = self.next_seq(label.index());
                let t = self.transfer(label.index(), seq);
                t.broadcast(core, team, root, views.send, views.recv, ctx)
            }
            CommRequest::Collective {
                label,
                kind: CommKind::ReduceScatter,
                team,
                input: Some(input),
                output: Some(output),
                ..
            } => {
                let at = (team.members.len(), team.my_index, 0);
                let kind = CommKind::ReduceScatter;
                member_buffers(request.name(), kind, at, Some(*input), Some(*output))?;
                let seq = self.next_seq(label.index());
                let t = self.transfer(label.index(), seq);
                t.reduce_scatter(core, team, input, output, ctx)
                    .map(Posted::Events)
            }
            _ => Err(BackendError::Invalid(format!(
                "{} is not carried by the copy engine (it needs both buffers on every member)",
                request.name()
            ))),
        }
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        Some(
            "copy-engine transfers meet through host waits and the signals between GPUs do not \
             order graph replays; force the NCCL transport to record graphs",
        )
    }
}

/// One instance of a labelled copy-engine transfer.
struct Transfer<'l> {
    link: &'l Arc<dyn PeerLink>,
    copy_stream: CopyStream,
    defer: DeferPulls,
    label: usize,
    seq: u64,
}

impl Transfer<'_> {
    fn key(&self, from: DeviceId, to: DeviceId) -> Key {
        Key {
            label: self.label,
            seq: self.seq,
            from,
            to,
        }
    }

    /// The region to offer for `src` (a staged copy where peers cannot read `src` in place,
    /// left in the core's scratch): call before taking the scratch as send temporaries.
    fn shareable(
        &self,
        core: &mut DeviceCore,
        src: DeviceBuffer,
    ) -> Result<DeviceBuffer, BackendError> {
        self.link.shareable(core, src)
    }

    /// Offers the send region to `to`, ready at the current stream's end.
    fn offer(
        &self,
        core: &DeviceCore,
        to: DeviceId,
        src: &DeviceBuffer,
    ) -> Result<(), BackendError> {
        self.link.offer(core, &self.key(core.rank, to), src)
    }

    /// The stream a pull enqueued at its post runs on (the posting stream, or the copy
    /// stream) and its number in traces.
    fn pull_stream(&self, core: &DeviceCore) -> (Stream, usize) {
        match self.copy_stream {
            CopyStream::Current => (core.stream().clone(), core.current),
            CopyStream::Dedicated => (core.copy_stream.clone(), core.streams.len()),
        }
    }

    /// Copies the taken offer of `key` into `dst` on `s` (from [`Self::pull_stream`]).
    #[allow(clippy::too_many_arguments)]
    fn copy_now(
        &self,
        core: &mut DeviceCore,
        name: &'static str,
        key: &Key,
        (s, lane): (&Stream, usize),
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        ctx: InstCtx<'_>,
    ) -> Result<Event, BackendError> {
        if self.copy_stream == CopyStream::Dedicated {
            // The pull must not overwrite `dst` before the posting stream is done with it.
            s.join(core.stream())
                .map_err(core.err("cuStreamWaitEvent"))?;
        }
        let copy = Copy {
            link: self.link.as_ref(),
            key,
            name,
            stream: s,
            lane,
            preorder: ctx.preorder,
            iteration: ctx.iteration,
        };
        copy.run(core, src, dst)
    }

    /// Pulls the offer of `from` into `dst` on the copy stream of the configured kind, the
    /// host waiting for the offer (deferred pulls first); returns the local done event (after
    /// reporting the read to the sender).
    fn pull_now(
        &self,
        core: &mut DeviceCore,
        name: &'static str,
        from: DeviceId,
        dst: &DeviceBuffer,
        ctx: InstCtx<'_>,
    ) -> Result<Event, BackendError> {
        core.finish_deferred(Finish::All)?;
        let (s, lane) = self.pull_stream(core);
        let key = self.key(from, core.rank);
        let src = self.link.take(core, &key, &s, name)?;
        self.copy_now(core, name, &key, (&s, lane), &src, dst, ctx)
    }

    /// [`Self::pull_now`] if the offer of `from` is here (or the policy does not defer this
    /// pull), else the pull deferred (see the module docs): complete once the returned events
    /// are.
    fn pull_or_defer(
        &self,
        core: &mut DeviceCore,
        name: &'static str,
        from: DeviceId,
        dst: &DeviceBuffer,
        writes: CudaBuffer,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        if !self.defer.defers(core.run_host.first_compute.is_some()) {
            return Ok(Posted::Events(vec![
                self.pull_now(core, name, from, dst, ctx)?
            ]));
        }
        // Earlier deferred pulls whose offers arrived go first; this one queues behind any
        // that remain, so that pulls are enqueued in posting order.
        core.finish_deferred(Finish::Ready)?;
        let (s, lane) = self.pull_stream(core);
        let key = self.key(from, core.rank);
        if core.deferred.is_empty() {
            if let Some(src) = self.link.try_take(core, &key, &s, name)? {
                let done = self.copy_now(core, name, &key, (&s, lane), &src, dst, ctx)?;
                return Ok(Posted::Events(vec![done]));
            }
        }
        // A companion stream of the posting stream runs it, from the posting stream's
        // current end; the stream it would have run on joins it once it is enqueued.
        let stream = core.deferral_stream(core.current)?;
        stream
            .join(core.stream())
            .map_err(core.err("cuStreamWaitEvent"))?;
        let comm = CudaComm::deferred();
        let pull = DeferredPull {
            link: self.link.clone(),
            key,
            name,
            dst: dst.clone(),
            stream,
            lane,
            join_back: s,
            preorder: ctx.preorder,
            iteration: ctx.iteration.to_vec(),
        };
        core.deferred
            .push(Box::new(pull), comm.events.clone(), writes);
        Ok(Posted::Deferred(comm))
    }

    /// The completions of this rank's sends to `to` (the host waits for the receivers'
    /// posts, deferred pulls first); the peer-read stream waits for them.
    fn collect_dones(
        &self,
        core: &mut DeviceCore,
        name: &'static str,
        to: &[DeviceId],
    ) -> Result<Vec<Event>, BackendError> {
        let keys: Vec<Key> = to.iter().map(|&peer| self.key(core.rank, peer)).collect();
        core.finish_deferred(Finish::All)?;
        self.link.reads_done(core, &keys, name)
    }

    /// A collective permute over the copy engine; returns how it completes.
    #[allow(clippy::too_many_arguments)]
    fn permute(
        &self,
        core: &mut DeviceCore,
        team: &TeamInfo,
        send_peer: usize,
        recv_peer: usize,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        const NAME: &str = "collective_permute";
        super::nccl::check_permute(input, output)?;
        let member = |i: usize| {
            team.members.get(i).copied().ok_or_else(|| {
                BackendError::Invalid(format!(
                    "{NAME}: peer {i} is outside the team {:?}",
                    team.members
                ))
            })
        };
        let (to, from) = (member(send_peer)?, member(recv_peer)?);
        let region = core.input_region(input)?;
        let src = self.shareable(core, region)?;
        let send_temps = std::mem::take(&mut core.scratch);
        self.offer(core, to, &src)?;
        let slot = core.output_slot(output, &[input])?;
        if send_temps.is_empty() && slot.is_direct() {
            // Nothing here needs the peer's read now: its completion is collected where it
            // matters (a later write of the sent buffer, its release, the end of the run),
            // not in the issue loop; nor the pull, which may be deferred.
            let posted = self.pull_or_defer(core, NAME, from, &slot.buf, output.buffer, ctx)?;
            core.finish_output(slot)?;
            let link = self.link.clone();
            let key = self.key(core.rank, to);
            core.defer_peer_reads(
                input,
                Box::new(move |core| link.reads_done(core, &[key], NAME)),
            );
            return Ok(posted);
        }
        let done = self.pull_now(core, NAME, from, &slot.buf, ctx)?;
        let dones = self.collect_dones(core, NAME, &[to])?;
        if !slot.is_direct() {
            // The unstaging copy runs on the current stream after the pull, and after the
            // peer's read of the send view (which may share the receive view's buffer).
            let s = core.stream().clone();
            if self.copy_stream == CopyStream::Dedicated {
                s.join(&core.copy_stream)
                    .map_err(core.err("cuStreamWaitEvent"))?;
            }
            for d in &dones {
                s.wait(d).map_err(core.err("cuStreamWaitEvent"))?;
            }
        }
        let staged = !slot.is_direct();
        core.finish_output(slot)?;
        let done = if staged {
            // After the copy out of the staging temporary.
            core.stream()
                .record_event()
                .map_err(core.err("cuEventRecord"))?
        } else {
            done
        };
        core.retire_after_peer_reads(send_temps)?;
        core.add_peer_reads(input, dones);
        Ok(Posted::Events(vec![done]))
    }

    /// A broadcast over the copy engine (every non-root pulls the root's data); returns how it
    /// completes.
    fn broadcast(
        &self,
        core: &mut DeviceCore,
        team: &TeamInfo,
        root: usize,
        input: Option<&TensorView<CudaBuffer>>,
        output: Option<&TensorView<CudaBuffer>>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        const NAME: &str = "broadcast";
        let root_rank = team.members.get(root).copied().ok_or_else(|| {
            BackendError::Invalid(format!(
                "{NAME}: root {root} is outside the team {:?}",
                team.members
            ))
        })?;
        if team.my_index != root {
            let o = output.ok_or_else(|| {
                BackendError::Invalid(format!(
                    "{NAME}: this rank takes part but does not hold the receive buffer"
                ))
            })?;
            let slot = core.output_slot(o, &[])?;
            if slot.is_direct() {
                return self.pull_or_defer(core, NAME, root_rank, &slot.buf, o.buffer, ctx);
            }
            self.pull_now(core, NAME, root_rank, &slot.buf, ctx)?;
            if self.copy_stream == CopyStream::Dedicated {
                core.stream()
                    .join(&core.copy_stream)
                    .map_err(core.err("cuStreamWaitEvent"))?;
            }
            core.finish_output(slot)?;
            // After the copy out of the staging temporary.
            let done = core
                .stream()
                .record_event()
                .map_err(core.err("cuEventRecord"))?;
            return Ok(Posted::Events(vec![done]));
        }
        let i = input.ok_or_else(|| {
            BackendError::Invalid(format!("{NAME}: the root holds no send buffer"))
        })?;
        let region = core.input_region(i)?;
        let src = self.shareable(core, region)?;
        let send_temps = std::mem::take(&mut core.scratch);
        let others: Vec<DeviceId> = team
            .members
            .iter()
            .copied()
            .filter(|&m| m != core.rank)
            .collect();
        for &m in &others {
            self.offer(core, m, &src)?;
        }
        let mut events = Vec::new();
        if let Some(o) = output {
            let opened = core.begin_op(NAME, Transport::CopyEngine, ctx)?;
            let slot = core.output_slot(o, &[i])?;
            slot.buf
                .copy_from(core.stream(), &src)
                .map_err(core.err("broadcast (local copy)"))?;
            core.finish_output(slot)?;
            core.close_op(opened)?;
            events.push(
                core.stream()
                    .record_event()
                    .map_err(core.err("cuEventRecord"))?,
            );
        }
        let dones = self.collect_dones(core, NAME, &others)?;
        core.retire_after_peer_reads(send_temps)?;
        core.add_peer_reads(i, dones);
        Ok(Posted::Events(events))
    }

    /// A sum reduce-scatter over the copy engine: every rank pulls its chunk of every peer's
    /// send buffer into a temporary, then adds them to its own chunk on the current stream.
    fn reduce_scatter(
        &self,
        core: &mut DeviceCore,
        team: &TeamInfo,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Vec<Event>, BackendError> {
        const NAME: &str = "reduce_scatter";
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
        let region = core.input_region(input)?;
        let src = self.shareable(core, region.clone())?;
        let send_temps = std::mem::take(&mut core.scratch);
        let my = team.my_index;
        // Peers in ring order from this rank (my + 1, my + 2, ...): at every point of the
        // sequence each rank's memory is read by one peer, instead of every rank pulling from
        // member 0 first.
        let others: Vec<DeviceId> = (1..d)
            .map(|k| (my + k) % d)
            .filter_map(|i| team.members.get(i).copied())
            .filter(|&m| m != core.rank)
            .collect();
        for &m in &others {
            self.offer(core, m, &src)?;
        }
        let mine = region
            .chunk(my, d)
            .map_err(core.err("reduce_scatter chunk"))?;
        let chunk_bytes = mine.len();
        let slot = core.output_slot(output, &[input])?;
        let received = core.temp(chunk_bytes * others.len())?;
        let s = core.stream().clone();
        let mut offers = Vec::with_capacity(others.len());
        // The takes below block: deferred pulls go first.
        core.finish_deferred(Finish::All)?;
        for &from in &others {
            let key = self.key(from, core.rank);
            let peer_src = self.link.take(core, &key, &s, NAME)?;
            if peer_src.len() != src.len() {
                return Err(BackendError::Invalid(format!(
                    "{NAME}: rank {from} sends {} bytes, rank {} sends {}",
                    peer_src.len(),
                    core.rank,
                    src.len()
                )));
            }
            offers.push((key, peer_src));
        }
        let opened = core
            .timeline
            .open_on(
                &s,
                core.current,
                IntervalKind::Comm,
                NAME,
                Some(Transport::CopyEngine),
                ctx.preorder,
                ctx.iteration,
            )
            .map_err(core.err("cuEventRecord"))?;
        let kd = crate::runtime::cuda::layout::kdtype(input.dtype);
        for (k, (key, peer_src)) in offers.into_iter().enumerate() {
            let part = peer_src
                .chunk(my, d)
                .map_err(core.err("reduce_scatter chunk"))?;
            let dst = received
                .view(k * chunk_bytes, chunk_bytes)
                .map_err(core.err("reduce_scatter temporary"))?;
            dst.copy_from(&s, &part)
                .map_err(core.err("cuMemcpyPeerAsync"))?;
            self.link.read_done(core, &key, &s)?;
        }
        for k in 0..others.len() {
            let part = received
                .view(k * chunk_bytes, chunk_bytes)
                .map_err(core.err("reduce_scatter temporary"))?;
            let a = if k == 0 { &mine } else { &slot.buf };
            core.kernels
                .binary(&s, meshflow_kernels::BinaryOp::Add, kd, a, &part, &slot.buf)
                .map_err(core.err("reduce_scatter (add)"))?;
        }
        core.timeline
            .close_on(&s, opened)
            .map_err(core.err("cuEventRecord"))?;
        let dones = self.collect_dones(core, NAME, &others)?;
        if !slot.is_direct() {
            for e in &dones {
                s.wait(e).map_err(core.err("cuStreamWaitEvent"))?;
            }
        }
        core.finish_output(slot)?;
        core.retire_after_peer_reads(send_temps)?;
        core.add_peer_reads(input, dones);
        let done = s.record_event().map_err(core.err("cuEventRecord"))?;
        Ok(vec![done])
    }
}

/// Where and how one pull copies an offer it took.
struct Copy<'a> {
    link: &'a dyn PeerLink,
    key: &'a Key,
    name: &'static str,
    /// The stream that waited for the offer's data and runs the copy, and its number in
    /// traces.
    stream: &'a Stream,
    lane: usize,
    preorder: PreorderIndex,
    iteration: &'a [i64],
}

impl Copy<'_> {
    /// Copies the taken offer `src` into `dst` on the stream, reports the read to the sender
    /// and returns the local done event.
    fn run(
        &self,
        core: &mut DeviceCore,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
    ) -> Result<Event, BackendError> {
        let (name, s) = (self.name, self.stream);
        if src.len() != dst.len() {
            return Err(BackendError::Invalid(format!(
                "{name}: rank {} sends {} bytes, rank {} receives {}",
                self.key.from,
                src.len(),
                core.rank,
                dst.len()
            )));
        }
        let opened = core
            .timeline
            .open_on(
                s,
                self.lane,
                IntervalKind::Comm,
                name,
                Some(Transport::CopyEngine),
                self.preorder,
                self.iteration,
            )
            .map_err(core.err("cuEventRecord"))?;
        dst.copy_from(s, src)
            .map_err(core.err("cuMemcpyPeerAsync"))?;
        core.timeline
            .close_on(s, opened)
            .map_err(core.err("cuEventRecord"))?;
        self.link.read_done(core, self.key, s)?;
        s.record_event().map_err(core.err("cuEventRecord"))
    }
}

/// A pull posted before its sender's offer arrived: everything it does after the post.
struct DeferredPull {
    link: Arc<dyn PeerLink>,
    key: Key,
    name: &'static str,
    dst: DeviceBuffer,
    /// The stream it runs on (a companion of the posting stream, joined to it at the post),
    /// and its number in traces.
    stream: Stream,
    lane: usize,
    /// The stream the pull would have run on at its post (the posting stream, or the copy
    /// stream), which joins `stream` once the pull is enqueued: its work from then on is
    /// ordered after the pull, as if the pull had been enqueued there.
    join_back: Stream,
    preorder: PreorderIndex,
    iteration: Vec<i64>,
}

impl Pending<DeviceCore, DoneEvents> for DeferredPull {
    fn finish(
        &mut self,
        core: &mut DeviceCore,
        block: bool,
    ) -> Result<Option<DoneEvents>, BackendError> {
        let (key, s) = (&self.key, &self.stream);
        let src = if block {
            self.link.take(core, key, s, self.name)?
        } else {
            match self.link.try_take(core, key, s, self.name)? {
                Some(src) => src,
                None => return Ok(None),
            }
        };
        let copy = Copy {
            link: self.link.as_ref(),
            key,
            name: self.name,
            stream: s,
            lane: self.lane,
            preorder: self.preorder,
            iteration: &self.iteration,
        };
        let done = copy.run(core, &src, &self.dst)?;
        self.join_back
            .join(s)
            .map_err(core.err("cuStreamWaitEvent"))?;
        Ok(Some(vec![Rc::new(done)]))
    }
}
