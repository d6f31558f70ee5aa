//! [`IpcLink`]: a rank's [`PeerLink`] to ranks in other processes of its host, over CUDA IPC.
//!
//! - **Memory.** A sender offers the region it sends as the CUDA IPC handle of the allocation
//!   holding it and an offset (regions peers cannot map, e.g. of a stream-ordered pool, are
//!   first copied into a temporary of this rank's allocator); the receiver maps each handle
//!   once (kept for the link's life: a peer's caching allocator reuses its allocations, so they
//!   are few) and copies straight from the peer's memory with its copy engines.
//! - **Ordering.** Every rank has a block of 32-bit signal words that its peers map: word
//!   `ready[p]` counts the transfers rank `p` has made ready for this rank, `done[p]` the
//!   transfers of this rank that `p` has read. The sender raises the receiver's `ready[me]` to
//!   `n` (its `n`-th transfer to it) after the data is ready on its stream; the receiver's copy
//!   stream waits for its own `ready[from] >= n`; after the copy it raises the sender's
//!   `done[me]`; the sender's peer-read stream waits for its own `done[to] >= n`. Remote
//!   writes go through one stream of the rank (`DeviceCore::signals`), so each word's values
//!   grow in time; waits are always on this rank's own words.
//! - **Messages.** The offer (handle, offset, length, `n`) and the completion travel over TCP
//!   between the two processes (`net.rs`), always after the signal they announce was enqueued:
//!   a device wait is only ever enqueued for a signal a peer has already enqueued, so no host
//!   call that synchronizes a context can wait for a later host call.
//! - **Set-up** at the rendezvous (`meet.rs`): cards once, then per team a verdict from every
//!   member (it mapped every other member's signal words, so IPC and peer access work between
//!   them), the same decision on all.
//! - **Failures.** A peer whose connection ends without a goodbye is lost: host waits for it
//!   end at once and [`PeerLink::failure`] reports it while the host waits for the device; after
//!   a failure [`PeerLink::abandon`] raises this rank's own words past every wait it enqueued,
//!   so that the device drains.

mod meet;
mod net;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::moe::{MoeShape, MoeWire, NvlinkMoe};
use meshflow_kernels::{Device, DeviceBuffer, DeviceFlag, Event, Stream};

use self::meet::{members_key, Card, Meeting};
use self::net::{Ended, Msg, Net, OfferMsg, WaitError};
use super::peers::{Access, Key, PeerLink, PeerWaits};
use crate::runtime::backend::{BackendError, TeamInfo};
use crate::runtime::cuda::core::{dev_err, DeviceCore};
use crate::runtime::rendezvous::Rendezvous;

/// Ranks whose signal words fit in a rank's block (`ready[r]`, then `done[r]`).
const MAX_RANKS: usize = 4096;
/// Mappings of one peer's allocations past which a warning is logged (they are kept).
const MANY_MAPPINGS: usize = 1024;

fn ready_word(peer: DeviceId) -> usize {
    4 * peer
}

fn done_word(peer: DeviceId) -> usize {
    4 * (MAX_RANKS + peer)
}

/// What the link tracks (behind one lock).
#[derive(Default)]
struct State {
    cards: HashMap<DeviceId, Card>,
    decisions: HashMap<Vec<DeviceId>, Access>,
    /// The peers' signal words, mapped.
    pads: HashMap<DeviceId, DeviceBuffer>,
    /// Per peer: its allocations mapped here, by handle.
    maps: HashMap<DeviceId, HashMap<meshflow_kernels::IpcHandle, DeviceBuffer>>,
    /// Transfers offered to each peer, and taken from each peer.
    sent: HashMap<DeviceId, u32>,
    received: HashMap<DeviceId, u32>,
    /// The `n` of each offer whose completion has not been collected.
    offered: HashMap<Key, u32>,
    /// The `n` of each taken transfer whose read has not been reported.
    taken: HashMap<Key, u32>,
    /// NVLink MoE handle exchanges per team.
    exchanges: HashMap<Vec<DeviceId>, u64>,
    /// Host waits for peers' messages since they were last drained.
    waits: PeerWaits,
}

/// What a rank needs to share memory over CUDA IPC.
struct Reach {
    /// This rank's signal words (`2 * MAX_RANKS` u32).
    pad: DeviceBuffer,
    net: Net,
}

/// A rank's link to its CUDA IPC peers (see the module docs).
pub(crate) struct IpcLink {
    rank: DeviceId,
    device: Device,
    meeting: Meeting,
    card: Card,
    /// Its signal words and messages, or why this rank cannot share memory over CUDA IPC (it
    /// still meets its peers, so that they all decide alike).
    reach: Result<Reach, String>,
    state: Mutex<State>,
}

impl IpcLink {
    /// The link of the core's rank, meeting its peers through `rendezvous` (its card is
    /// published at once). A rank that cannot share memory over CUDA IPC gets a link too,
    /// which tells its peers why (their teams then use NCCL).
    pub fn new(
        core: &DeviceCore,
        rendezvous: Arc<dyn Rendezvous>,
    ) -> Result<IpcLink, BackendError> {
        let rank = core.rank;
        let device = core.device.clone();
        let reach = IpcLink::reach_of(rank, &device);
        if let Err(why) = &reach {
            tracing::info!(rank, "CUDA IPC is not possible: {why}");
        }
        let card = Card {
            process: meet::process_token(),
            host: meet::host_id(),
            reach: match &reach {
                Ok(r) => r
                    .pad
                    .export_ipc()
                    .map(|e| (r.net.port(), e.handle))
                    .map_err(|e| e.to_string()),
                Err(why) => Err(why.clone()),
            },
        };
        let generation = meet::next_generation(rendezvous.namespace(), rank);
        let meeting = Meeting::new(rendezvous, rank, generation, core.timeout);
        meeting.publish_card(&card)?;
        Ok(IpcLink {
            rank,
            device,
            meeting,
            card,
            reach,
            state: Mutex::new(State::default()),
        })
    }

    /// This rank's signal words (exportable) and listener, or why not.
    fn reach_of(rank: DeviceId, device: &Device) -> Result<Reach, String> {
        if rank >= MAX_RANKS {
            return Err(format!(
                "rank {rank} is past the {MAX_RANKS} ranks it supports"
            ));
        }
        let pad = DeviceBuffer::alloc(device, 8 * MAX_RANKS)
            .and_then(|pad| {
                let s = Stream::new(device)?;
                pad.zero(&s)?;
                s.synchronize()?;
                Ok(pad)
            })
            .map_err(|e| format!("allocating its signal words: {e}"))?;
        pad.export_ipc()
            .map_err(|e| format!("its memory cannot be shared over CUDA IPC: {e}"))?;
        let net = Net::start(rank).map_err(|e| format!("listening for its peers: {e}"))?;
        Ok(Reach { pad, net })
    }

    /// This rank's signal words and messages (the team was decided, so they exist).
    fn reach(&self) -> Result<&Reach, BackendError> {
        self.reach.as_ref().map_err(|why| {
            BackendError::Invalid(format!(
                "rank {}: CUDA IPC transfers on a rank that cannot share memory: {why}",
                self.rank
            ))
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The card of `peer` (fetched once).
    fn card_of(&self, peer: DeviceId) -> Result<Card, BackendError> {
        if let Some(c) = self.lock().cards.get(&peer) {
            return Ok(c.clone());
        }
        let c = self.meeting.card(peer)?;
        self.lock().cards.insert(peer, c.clone());
        Ok(c)
    }

    /// This rank's verdict on reaching `peer`: both can share memory, same host, another
    /// process, its signal words mapped (which needs CUDA IPC and peer access between the two
    /// GPUs).
    fn verdict_on(&self, peer: DeviceId) -> Result<Access, BackendError> {
        if let Err(why) = &self.reach {
            return Ok(Err(format!("rank {}: {why}", self.rank)));
        }
        if peer >= MAX_RANKS {
            return Ok(Err(format!(
                "rank {peer} is past the {MAX_RANKS} ranks CUDA IPC peers support"
            )));
        }
        let card = self.card_of(peer)?;
        let pad_handle = match &card.reach {
            Ok((_, h)) => *h,
            Err(why) => return Ok(Err(format!("rank {peer}: {why}"))),
        };
        if card.host != self.card.host {
            return Ok(Err(format!("rank {peer} runs on another host")));
        }
        if card.process == self.card.process {
            return Ok(Err(format!(
                "ranks {} and {peer} are threads of one process without a peer hub (one launch \
                 of several GPUs in a process meets through its hub)",
                self.rank
            )));
        }
        if self.lock().pads.contains_key(&peer) {
            return Ok(Ok(()));
        }
        match DeviceBuffer::open_ipc(&self.device, &pad_handle, 8 * MAX_RANKS) {
            Ok(pad) if pad.len() >= 8 * MAX_RANKS => {
                self.lock().pads.insert(peer, pad);
                Ok(Ok(()))
            }
            Ok(pad) => Ok(Err(format!(
                "rank {peer}'s signal words are {} bytes (another version?)",
                pad.len()
            ))),
            Err(e) => Ok(Err(format!(
                "rank {} cannot map rank {peer}'s GPU memory over CUDA IPC: {e}",
                self.rank
            ))),
        }
    }

    /// A 4-byte word of `buf` as a flag.
    fn flag(
        &self,
        core: &DeviceCore,
        buf: &DeviceBuffer,
        at: usize,
    ) -> Result<DeviceFlag, BackendError> {
        buf.view(at, 4)
            .and_then(DeviceFlag::at)
            .map_err(core.err("CUDA IPC signal word"))
    }

    /// Raises `word` of `peer`'s signal words to `n` once the current stream of the core
    /// gets to this point (through the core's signal stream).
    fn raise(
        &self,
        core: &DeviceCore,
        stream: &Stream,
        peer: DeviceId,
        word: usize,
        n: u32,
    ) -> Result<(), BackendError> {
        let pad = self.lock().pads.get(&peer).cloned().ok_or_else(|| {
            BackendError::Invalid(format!(
                "rank {}: no CUDA IPC link to rank {peer} (its team was not prepared)",
                self.rank
            ))
        })?;
        let flag = self.flag(core, &pad, word)?;
        if !stream_is(stream, &core.signals) {
            core.signals
                .join(stream)
                .map_err(core.err("cuStreamWaitEvent (signal stream)"))?;
        }
        flag.signal(&core.signals, n)
            .map_err(core.err("cuStreamWriteValue32 (peer signal)"))
    }

    /// Sends `msg` to `peer`; a broken connection is the peer's failure.
    fn send(&self, peer: DeviceId, msg: &Msg) -> Result<(), BackendError> {
        self.reach()?
            .net
            .send(peer, msg)
            .map_err(|why| BackendError::Aborted {
                failed_rank: peer,
                reason: format!("rank {peer} is unreachable from rank {}: {why}", self.rank),
            })
    }

    /// Waits for what `take` finds in the inbox from `peer`.
    fn wait<T>(
        &self,
        core: &DeviceCore,
        peer: DeviceId,
        what: impl FnOnce() -> String,
        take: impl FnMut(&mut net::Inbox) -> Option<T>,
    ) -> Result<T, BackendError> {
        let deadline = Instant::now() + core.timeout;
        let abort = || core.aborted();
        self.reach()?
            .net
            .wait(peer, deadline, &abort, take)
            .map_err(|e| self.wait_error(core, peer, what, e))
    }

    /// What `take` finds in the inbox from `peer` now, if anything (errors as [`Self::wait`]
    /// where the message can no longer come).
    fn poll<T>(
        &self,
        core: &DeviceCore,
        peer: DeviceId,
        what: impl FnOnce() -> String,
        take: impl FnMut(&mut net::Inbox) -> Option<T>,
    ) -> Result<Option<T>, BackendError> {
        let abort = || core.aborted();
        self.reach()?
            .net
            .poll(peer, &abort, take)
            .map_err(|e| self.wait_error(core, peer, what, e))
    }

    /// The error of a wait for `what` from `peer` that ended without it.
    fn wait_error(
        &self,
        core: &DeviceCore,
        peer: DeviceId,
        what: impl FnOnce() -> String,
        e: WaitError,
    ) -> BackendError {
        match e {
            WaitError::Timeout => core.timeout_error(peer, what()),
            WaitError::Aborted(e) => e,
            WaitError::Ended(Ended::Finished) => BackendError::Invalid(format!(
                "rank {}: rank {peer} finished its run without sending {}",
                self.rank,
                what()
            )),
            WaitError::Ended(Ended::Lost(why)) => lost(self.rank, peer, &why),
        }
    }

    /// Accepts the offer `msg` of transfer `key` (checking that it is the sender's next
    /// transfer to this rank), maps its region and makes `stream` wait until its data is
    /// ready.
    fn accept(
        &self,
        core: &DeviceCore,
        key: &Key,
        msg: OfferMsg,
        waited: Duration,
        stream: &Stream,
        what: &str,
    ) -> Result<DeviceBuffer, BackendError> {
        let from = key.from;
        {
            let mut s = self.lock();
            s.waits.offer(waited);
            let expected = s.received.get(&from).copied().unwrap_or(0).wrapping_add(1);
            if msg.n != expected {
                return Err(BackendError::Invalid(format!(
                    "rank {}: {what} #{} instance {}: rank {from} numbers it as its transfer {} \
                     here, this rank expected {expected} (do the ranks run the same program?)",
                    self.rank, key.label, key.seq, msg.n
                )));
            }
            s.received.insert(from, msg.n);
            s.taken.insert(key.clone(), msg.n);
        }
        let bytes = usize::try_from(msg.allocation).map_err(|_| {
            BackendError::Invalid(format!(
                "rank {}: {what}: rank {from} offers an allocation of {} bytes",
                self.rank, msg.allocation
            ))
        })?;
        let whole = self.mapped(core, from, &msg.handle, bytes)?;
        let region = usize::try_from(msg.offset)
            .ok()
            .zip(usize::try_from(msg.len).ok())
            .and_then(|(o, l)| whole.view(o, l).ok())
            .ok_or_else(|| {
                BackendError::Invalid(format!(
                    "rank {}: {what}: rank {from} offers bytes [{}, +{}) of an allocation of {}",
                    self.rank,
                    msg.offset,
                    msg.len,
                    whole.len()
                ))
            })?;
        self.flag(core, &self.reach()?.pad, ready_word(from))?
            .wait(stream, msg.n)
            .map_err(core.err("cuStreamWaitValue32 (peer data ready)"))?;
        Ok(region)
    }

    /// The mapping of `peer`'s allocation `handle` (opened once).
    fn mapped(
        &self,
        core: &DeviceCore,
        peer: DeviceId,
        handle: &meshflow_kernels::IpcHandle,
        bytes: usize,
    ) -> Result<DeviceBuffer, BackendError> {
        if let Some(b) = self.lock().maps.get(&peer).and_then(|m| m.get(handle)) {
            return Ok(b.clone());
        }
        let buf = DeviceBuffer::open_ipc(&self.device, handle, bytes)
            .map_err(core.err(&format!("cuIpcOpenMemHandle (memory of rank {peer})")))?;
        let mut s = self.lock();
        let maps = s.maps.entry(peer).or_default();
        maps.insert(*handle, buf.clone());
        if maps.len() == MANY_MAPPINGS {
            tracing::warn!(
                rank = self.rank,
                peer,
                "{MANY_MAPPINGS} allocations of rank {peer} are mapped over CUDA IPC (they \
                 are kept until the run's backend is dropped)"
            );
        }
        Ok(buf)
    }
}

/// Whether two handles are the same stream.
fn stream_is(a: &Stream, b: &Stream) -> bool {
    a.id() == b.id()
}

/// The error of a peer lost mid-run.
fn lost(rank: DeviceId, peer: DeviceId, why: &str) -> BackendError {
    BackendError::Aborted {
        failed_rank: peer,
        reason: format!(
            "rank {peer} stopped (its process exited or failed; seen by rank {rank}: {why})"
        ),
    }
}

impl PeerLink for IpcLink {
    fn name(&self) -> &'static str {
        "CUDA IPC"
    }

    fn decide(
        &self,
        core: &DeviceCore,
        teams: &[&[DeviceId]],
    ) -> Result<Vec<Access>, BackendError> {
        let mut fresh: Vec<&[DeviceId]> = Vec::new();
        for members in teams {
            if !self.lock().decisions.contains_key(*members) && !fresh.contains(members) {
                fresh.push(members);
            }
        }
        // Every verdict is published before any is read, so that members that share several
        // teams never wait for each other in a cycle.
        for members in &fresh {
            let mut mine = Ok(());
            for &m in members.iter().filter(|&&m| m != self.rank) {
                if let Err(why) = self.verdict_on(m)? {
                    mine = Err(why);
                    break;
                }
            }
            self.meeting.publish_verdict(members, &mine)?;
        }
        for members in &fresh {
            let mut decision = Ok(());
            for &m in members.iter() {
                let v = self.meeting.verdict(members, m)?;
                if decision.is_ok() {
                    decision = v;
                }
            }
            if decision.is_ok() {
                let net = &self.reach()?.net;
                for &m in members.iter().filter(|&&m| m != self.rank) {
                    let port = match self.card_of(m)?.reach {
                        Ok((port, _)) => port,
                        Err(why) => return Err(BackendError::Invalid(why)),
                    };
                    net.connect(m, port, core.timeout)
                        .map_err(|why| BackendError::Aborted {
                            failed_rank: m,
                            reason: why,
                        })?;
                }
            } else if let Err(why) = &decision {
                tracing::info!(
                    rank = self.rank,
                    team = %members_key(members),
                    "CUDA IPC between the team's ranks is not possible: {why}"
                );
            }
            self.lock().decisions.insert(members.to_vec(), decision);
        }
        let s = self.lock();
        Ok(teams
            .iter()
            .map(|m| s.decisions.get(*m).cloned().unwrap_or(Ok(())))
            .collect())
    }

    fn prepare_copies(&self, _core: &DeviceCore, members: &[DeviceId]) -> Result<(), BackendError> {
        match self.lock().decisions.get(members) {
            Some(Ok(())) => Ok(()),
            Some(Err(why)) => Err(BackendError::Invalid(format!(
                "rank {}: the copy engine was selected for team {members:?}, whose ranks \
                 cannot share memory over CUDA IPC: {why}",
                self.rank
            ))),
            None => Err(BackendError::Invalid(format!(
                "rank {}: the copy engine was selected for team {members:?} before its ranks \
                 met",
                self.rank
            ))),
        }
    }

    fn shareable(
        &self,
        core: &mut DeviceCore,
        src: DeviceBuffer,
    ) -> Result<DeviceBuffer, BackendError> {
        if src
            .ipc_capable()
            .map_err(core.err("cuPointerGetAttribute"))?
        {
            return Ok(src);
        }
        let staged = core.temp(src.len())?;
        staged
            .copy_from(core.stream(), &src)
            .map_err(core.err("staging a send region for CUDA IPC"))?;
        Ok(staged)
    }

    fn offer(&self, core: &DeviceCore, key: &Key, src: &DeviceBuffer) -> Result<(), BackendError> {
        let export = src
            .export_ipc()
            .map_err(core.err("cuIpcGetMemHandle (send region)"))?;
        let n = {
            let mut s = self.lock();
            let n = s.sent.entry(key.to).or_insert(0);
            *n = n.wrapping_add(1);
            let n = *n;
            s.offered.insert(key.clone(), n);
            n
        };
        self.raise(core, core.stream(), key.to, ready_word(self.rank), n)?;
        self.send(
            key.to,
            &Msg::Offer {
                key: key.clone(),
                offer: OfferMsg {
                    n,
                    handle: export.handle,
                    allocation: export.allocation_bytes as u64,
                    offset: export.offset as u64,
                    len: src.len() as u64,
                },
            },
        )
    }

    fn take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        what: &str,
    ) -> Result<DeviceBuffer, BackendError> {
        let started = Instant::now();
        let msg = self.wait(
            core,
            key.from,
            || format!("{what} #{} instance {} data", key.label, key.seq),
            |inbox| inbox.offers.remove(key),
        )?;
        self.accept(core, key, msg, started.elapsed(), stream, what)
    }

    fn try_take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        what: &str,
    ) -> Result<Option<DeviceBuffer>, BackendError> {
        let found = self.poll(
            core,
            key.from,
            || format!("{what} #{} instance {} data", key.label, key.seq),
            |inbox| inbox.offers.remove(key),
        )?;
        match found {
            Some(msg) => self
                .accept(core, key, msg, Duration::ZERO, stream, what)
                .map(Some),
            None => Ok(None),
        }
    }

    fn read_done(&self, core: &DeviceCore, key: &Key, stream: &Stream) -> Result<(), BackendError> {
        let n = self.lock().taken.remove(key).ok_or_else(|| {
            BackendError::Invalid(format!(
                "rank {}: a read of {key:?} reported without taking it",
                self.rank
            ))
        })?;
        self.raise(core, stream, key.from, done_word(self.rank), n)?;
        self.send(
            key.from,
            &Msg::Done {
                key: key.clone(),
                n,
            },
        )
    }

    fn reads_done(
        &self,
        core: &DeviceCore,
        keys: &[Key],
        what: &str,
    ) -> Result<Vec<Event>, BackendError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        for key in keys {
            let n = self.lock().offered.remove(key).ok_or_else(|| {
                BackendError::Invalid(format!(
                    "rank {}: the completion of {key:?} collected without an offer",
                    self.rank
                ))
            })?;
            let started = Instant::now();
            let got = self.wait(
                core,
                key.to,
                || {
                    format!(
                        "{what} #{} instance {}: the receiver's copy",
                        key.label, key.seq
                    )
                },
                |inbox| inbox.dones.remove(key),
            )?;
            self.lock().waits.completion(started.elapsed());
            if got != n {
                return Err(BackendError::Invalid(format!(
                    "rank {}: {what}: rank {} reports reading transfer {got}, not {n}",
                    self.rank, key.to
                )));
            }
            self.flag(core, &self.reach()?.pad, done_word(key.to))?
                .wait(&core.peer_reads, n)
                .map_err(core.err("cuStreamWaitValue32 (peer read done)"))?;
        }
        let done = core
            .peer_reads
            .record_event()
            .map_err(core.err("cuEventRecord"))?;
        Ok(vec![done])
    }

    fn nvlink_engine(
        &self,
        core: &DeviceCore,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<NvlinkMoe, BackendError> {
        let rank = core.rank;
        let e = |call: &'static str| move |err| dev_err(rank, call, err);
        let mut engine = NvlinkMoe::new_ipc_with_wire(&core.device, shape, wire, team.my_index)
            .map_err(e("creating the NVLink MoE transport"))?;
        let mine = engine
            .export_handles()
            .map_err(e("exporting the NVLink MoE buffers"))?;
        let n = {
            let mut s = self.lock();
            let n = s.exchanges.entry(team.members.clone()).or_insert(0);
            *n += 1;
            *n
        };
        // A member that stopped before publishing its buffers fails this wait at once (its
        // connection, made when the team was decided, ended), not at the rendezvous timeout.
        let net = &self.reach()?.net;
        let gone = |peer: DeviceId| match net.ended(peer) {
            Some(Ended::Lost(why)) => Some(BackendError::Aborted {
                failed_rank: peer,
                reason: format!(
                    "rank {peer} stopped (its process exited or failed; seen by rank {rank} \
                     while it set up the NVLink MoE buffers of moe_dispatch: {why})"
                ),
            }),
            Some(Ended::Finished) => Some(BackendError::Invalid(format!(
                "rank {rank}: moe_dispatch: rank {peer} finished its run without publishing \
                 its NVLink MoE buffers"
            ))),
            None => core.aborted(),
        };
        let all = self.meeting.all_gather(
            &format!("moe/{n}"),
            &team.members,
            team.my_index,
            &mine,
            &gone,
        )?;
        engine
            .import_handles(&all)
            .map_err(e("mapping the peers' NVLink MoE buffers"))?;
        // A peer lost from now on ends the engine's device waits at once (raised by the
        // reader thread that sees its connection end).
        net.watch(engine.abort_word());
        Ok(engine)
    }

    fn drain_waits(&self) -> PeerWaits {
        std::mem::take(&mut self.lock().waits)
    }

    fn failure(&self, age: Duration) -> Option<BackendError> {
        let (peer, why) = self.reach.as_ref().ok()?.net.lost(age)?;
        Some(lost(self.rank, peer, &why))
    }

    fn abandon(&self) {
        let Ok(reach) = &self.reach else {
            return;
        };
        let (received, sent) = {
            let s = self.lock();
            (s.received.clone(), s.sent.clone())
        };
        let release = || -> Result<(), meshflow_kernels::KernelError> {
            let s = Stream::new(&self.device)?;
            for (p, n) in received {
                DeviceFlag::at(reach.pad.view(ready_word(p), 4)?)?.signal(&s, n)?;
            }
            for (p, n) in sent {
                DeviceFlag::at(reach.pad.view(done_word(p), 4)?)?.signal(&s, n)?;
            }
            s.synchronize()
        };
        if let Err(e) = release() {
            tracing::warn!(rank = self.rank, "releasing the CUDA IPC waits failed: {e}");
        }
    }
}

impl std::fmt::Debug for IpcLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcLink")
            .field("rank", &self.rank)
            .field("reach", &self.card.reach.as_ref().map(|r| r.0))
            .finish()
    }
}
