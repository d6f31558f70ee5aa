//! [`StagedRoute`]: device memory to and from ranks of other nodes through a [`Proxy`], staged
//! in pinned host memory and ordered on the rank's streams (feature `cuda`).
//!
//! Sending enqueues a copy of the bytes into a pinned staging buffer on the rank's stream and
//! records an event; the route's send thread waits for the event and hands the buffer to the
//! proxy, which writes it one-sidedly into the receiver's ring with immediates. Receiving
//! enqueues, on the rank's stream, a wait for the route's flag (`cuStreamWaitValue32` on pinned
//! host memory) and a copy out of a pinned buffer; the route's receive thread waits for the
//! proxy to have counted every chunk of the message, copies it into that buffer and raises the
//! flag. The rank's thread never waits for a peer: the device does, in stream order. Every
//! member of a team calls the route's operations in the same order, which numbers the messages
//! ([`StagedRoute::next_tag`]).
//!
//! A failure (a lost peer, an abort, a timeout) is recorded and the flag is raised past every
//! message so that no stream stays blocked; [`StagedRoute::failure`] reports it (the data of
//! the failed transfers is undefined).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Proxy, ProxyError, Tag, Topology};
use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::event::Event;
use crate::pinned::{PinnedBuffer, FLAG_RELEASE};
use crate::stream::Stream;

/// Says whether a wait should stop early: the rank of the run that failed and why, or `None`.
pub type CancelCheck = Arc<dyn Fn() -> Option<(usize, String)> + Send + Sync>;

/// How long one receive waits before checking for cancellation again.
const RECV_SLICE: Duration = Duration::from_millis(50);
/// How long dropping a route waits for the device to finish with its staging buffers.
const DRAIN: Duration = Duration::from_secs(5);

/// Why a staging thread failed.
#[derive(Clone, Debug)]
enum Failure {
    Proxy(ProxyError),
    Cuda(String),
}

/// State shared by the route and its threads.
struct Shared {
    proxy: Arc<Proxy>,
    timeout: Duration,
    cancel: Option<CancelCheck>,
    failure: Mutex<Option<Failure>>,
    stop: AtomicBool,
    /// Staging buffers not in use.
    pool: Mutex<Vec<Arc<PinnedBuffer>>>,
    /// The flag the device waits on: the number of messages received into their buffers.
    flag: PinnedBuffer,
}

impl Shared {
    fn fail(&self, f: Failure) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            tracing::debug!(rank = self.proxy.rank(), "staged route failed: {f:?}");
            *slot = Some(f);
        }
        drop(slot);
        // Release every stream waiting for a message (their data is undefined now).
        self.flag.release_all();
    }

    fn give_back(&self, buf: Arc<PinnedBuffer>) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

struct SendJob {
    ready: Event,
    buf: Arc<PinnedBuffer>,
    len: usize,
    peer: usize,
    tag: Tag,
}

struct RecvJob {
    buf: Arc<PinnedBuffer>,
    len: usize,
    peer: usize,
    tag: Tag,
    seq: u32,
}

/// One rank's route to the members of a team that are on other nodes.
pub struct StagedRoute {
    shared: Arc<Shared>,
    device: Device,
    /// The rank of every team member (index in the team -> global rank).
    members: Vec<usize>,
    /// Per team member: on another node than this rank.
    remote: Vec<bool>,
    domain: u64,
    seq: u64,
    received: u32,
    send_tx: Option<Sender<SendJob>>,
    recv_tx: Option<Sender<RecvJob>>,
    threads: Vec<JoinHandle<()>>,
    /// Receive buffers the device may still be copying out of, with the event after the copy.
    in_use: Vec<(Event, Arc<PinnedBuffer>)>,
}

impl std::fmt::Debug for StagedRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedRoute")
            .field("rank", &self.shared.proxy.rank())
            .field("members", &self.members)
            .field("remote", &self.remote)
            .field("seq", &self.seq)
            .finish()
    }
}

/// A message domain for a team: the same on every member, different for other teams and for
/// `purpose` (e.g. permutes and MoE rows of one team).
fn domain_of(members: &[usize], purpose: u64) -> u64 {
    // FNV-1a over the purpose and the member ranks.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in std::iter::once(purpose).chain(members.iter().map(|&m| m as u64)) {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    // Never the reserved abort tag's domain.
    h & (u64::MAX >> 1)
}

/// Waits for `ev` (the device's copy into a staging buffer): `Ok(false)` when the route is
/// closing or the wait timed out first (the device may still write the buffer).
fn wait_copied(shared: &Shared, ev: &Event) -> std::result::Result<bool, Failure> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if ev.is_complete().map_err(|e| Failure::Cuda(e.to_string()))? {
            return Ok(true);
        }
        if shared.stop.load(Ordering::Acquire) || start.elapsed() > shared.timeout {
            return Ok(false);
        }
        spins += 1;
        if spins < 1000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

fn send_loop(shared: Arc<Shared>, jobs: Receiver<SendJob>) {
    for job in jobs {
        let copied = match wait_copied(&shared, &job.ready) {
            Ok(c) => c,
            Err(f) => {
                shared.fail(f);
                false
            }
        };
        if !copied {
            // The device may still write this buffer: never reuse it (leaked).
            if !shared.stop.load(Ordering::Acquire) {
                shared.fail(Failure::Proxy(ProxyError::Timeout {
                    peer: job.peer,
                    waited: shared.timeout,
                    what: "the device to stage a message for the proxy".into(),
                }));
            }
            std::mem::forget(job.buf);
            continue;
        }
        let failed = shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if !failed {
            let sent = job
                .buf
                .read(job.len)
                .map_err(|e| Failure::Cuda(e.to_string()))
                .and_then(|bytes| {
                    shared
                        .proxy
                        .send(job.peer, job.tag, &bytes, shared.timeout)
                        .map_err(Failure::Proxy)
                });
            if let Err(f) = sent {
                shared.fail(f);
            }
        }
        shared.give_back(job.buf);
    }
}

fn wait_message(
    shared: &Shared,
    peer: usize,
    tag: Tag,
) -> std::result::Result<Vec<u8>, ProxyError> {
    let start = Instant::now();
    loop {
        let left = shared.timeout.saturating_sub(start.elapsed());
        match shared.proxy.recv(peer, tag, RECV_SLICE.min(left)) {
            Ok(v) => return Ok(v),
            Err(ProxyError::Timeout { .. }) if start.elapsed() < shared.timeout => {}
            Err(ProxyError::Timeout { .. }) => {
                return Err(ProxyError::Timeout {
                    peer,
                    waited: start.elapsed(),
                    what: format!("message {tag:?} through the proxy"),
                })
            }
            Err(e) => return Err(e),
        }
        if shared.stop.load(Ordering::Acquire) {
            return Err(ProxyError::Aborted {
                rank: shared.proxy.rank(),
                reason: "the route was closed".into(),
            });
        }
        if let Some((rank, reason)) = shared.cancel.as_ref().and_then(|c| c()) {
            return Err(ProxyError::Aborted { rank, reason });
        }
    }
}

fn recv_loop(shared: Arc<Shared>, jobs: Receiver<RecvJob>) {
    for job in jobs {
        let failed = shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if failed {
            continue;
        }
        let got = wait_message(&shared, job.peer, job.tag)
            .map_err(Failure::Proxy)
            .and_then(|bytes| {
                if bytes.len() != job.len {
                    return Err(Failure::Proxy(ProxyError::Protocol {
                        peer: job.peer,
                        message: format!(
                            "sent {} bytes under tag {:?}, rank {} expects {}",
                            bytes.len(),
                            job.tag,
                            shared.proxy.rank(),
                            job.len
                        ),
                    }));
                }
                job.buf
                    .write(&bytes)
                    .map_err(|e| Failure::Cuda(e.to_string()))
            });
        match got {
            Ok(()) => shared.flag.raise(job.seq),
            Err(f) => shared.fail(f),
        }
    }
}

impl StagedRoute {
    /// The route of `proxy`'s rank within the team `members` (global ranks, in team order) on
    /// `device`, with the nodes of `topology`. `purpose` separates the messages of several
    /// routes of the same team. Each receive waits at most `timeout`; `cancel` ends it early.
    pub fn new(
        proxy: Arc<Proxy>,
        device: &Device,
        topology: &Topology,
        members: Vec<usize>,
        purpose: u64,
        timeout: Duration,
        cancel: Option<CancelCheck>,
    ) -> Result<StagedRoute> {
        let me = proxy.rank();
        if !members.contains(&me) {
            return Err(KernelError::InvalidArgument(format!(
                "rank {me} builds a proxy route for team {members:?}, which it is not in"
            )));
        }
        let remote = members
            .iter()
            .map(|&m| !topology.same_node(me, m))
            .collect();
        let shared = Arc::new(Shared {
            proxy,
            timeout,
            cancel,
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            pool: Mutex::new(Vec::new()),
            flag: PinnedBuffer::new(device, 4)?,
        });
        let (send_tx, send_rx) = channel();
        let (recv_tx, recv_rx) = channel();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| KernelError::InvalidArgument(format!("cannot start a thread: {e}")))
        };
        let (s1, s2) = (shared.clone(), shared.clone());
        let threads = vec![
            spawn(
                format!("meshflow-stage-send-{me}"),
                Box::new(move || send_loop(s1, send_rx)),
            )?,
            spawn(
                format!("meshflow-stage-recv-{me}"),
                Box::new(move || recv_loop(s2, recv_rx)),
            )?,
        ];
        Ok(StagedRoute {
            shared,
            device: device.clone(),
            domain: domain_of(&members, purpose),
            members,
            remote,
            seq: 0,
            received: 0,
            send_tx: Some(send_tx),
            recv_tx: Some(recv_tx),
            threads,
            in_use: Vec::new(),
        })
    }

    /// Whether team member `index` is on another node.
    pub fn is_remote(&self, index: usize) -> bool {
        self.remote.get(index).copied().unwrap_or(false)
    }

    /// Whether any team member is on another node.
    pub fn has_remote(&self) -> bool {
        self.remote.iter().any(|&r| r)
    }

    /// The tag of the team's next exchange (every member calls this once per exchange, in the
    /// same order).
    pub fn next_tag(&mut self) -> Tag {
        self.seq += 1;
        (self.domain, self.seq)
    }

    /// The first failure of a transfer through this route (the data of failed transfers is
    /// undefined; the run that used it must fail).
    pub fn failure(&self) -> Option<KernelError> {
        let f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        Some(match f {
            Failure::Proxy(e) => KernelError::Proxy(e),
            Failure::Cuda(m) => KernelError::InvalidArgument(format!("proxy staging: {m}")),
        })
    }

    fn global(&self, index: usize) -> Result<usize> {
        self.members.get(index).copied().ok_or_else(|| {
            KernelError::InvalidArgument(format!(
                "team member {index} of a team of {}",
                self.members.len()
            ))
        })
    }

    /// A staging buffer of at least `len` bytes: a free one, or a new one.
    fn buffer(&mut self, len: usize) -> Result<Arc<PinnedBuffer>> {
        // Buffers whose copy to the device is done go back to the pool.
        let mut i = 0;
        while i < self.in_use.len() {
            if self.in_use[i].0.is_complete()? {
                let (_, b) = self.in_use.swap_remove(i);
                self.shared.give_back(b);
            } else {
                i += 1;
            }
        }
        let mut pool = self.shared.pool.lock().unwrap_or_else(|e| e.into_inner());
        let fit = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        match fit {
            Some(i) => Ok(pool.swap_remove(i)),
            None => {
                drop(pool);
                Ok(Arc::new(PinnedBuffer::new(
                    &self.device,
                    len.next_power_of_two(),
                )?))
            }
        }
    }

    fn check(&self) -> Result<()> {
        match self.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Sends `parts` (concatenated, in order) to team member `to` under `tag`, after the
    /// earlier work of `stream`: enqueues their copy into a staging buffer on `stream`; the
    /// route's send thread passes it to the proxy once the copy is done. `parts` may be reused
    /// once `stream` has passed this call.
    pub fn send(
        &mut self,
        stream: &Stream,
        to: usize,
        tag: Tag,
        parts: &[&DeviceBuffer],
    ) -> Result<()> {
        self.check()?;
        let peer = self.global(to)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let buf = self.buffer(total)?;
        let mut at = 0;
        for p in parts {
            buf.copy_from_device(stream, at, p)?;
            at += p.len();
        }
        let ready = stream.record_event()?;
        let job = SendJob {
            ready,
            buf,
            len: total,
            peer,
            tag,
        };
        self.send_tx
            .as_ref()
            .and_then(|tx| tx.send(job).ok())
            .ok_or_else(|| KernelError::InvalidArgument("the route's send thread is gone".into()))
    }

    /// Receives the message of team member `from` under `tag` into `parts` (in order; their
    /// lengths must add up to the message's): enqueues on `stream` a wait for the message and
    /// its copy into `parts`. Never blocks the calling thread.
    pub fn recv(
        &mut self,
        stream: &Stream,
        from: usize,
        tag: Tag,
        parts: &[&DeviceBuffer],
    ) -> Result<()> {
        self.check()?;
        let peer = self.global(from)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let buf = self.buffer(total)?;
        if self.received + 1 >= FLAG_RELEASE {
            return Err(KernelError::Unsupported(format!(
                "more than {} messages through one route",
                FLAG_RELEASE - 1
            )));
        }
        self.received += 1;
        let seq = self.received;
        let job = RecvJob {
            buf: buf.clone(),
            len: total,
            peer,
            tag,
            seq,
        };
        self.recv_tx
            .as_ref()
            .and_then(|tx| tx.send(job).ok())
            .ok_or_else(|| {
                KernelError::InvalidArgument("the route's receive thread is gone".into())
            })?;
        self.shared.flag.wait_on(stream, seq)?;
        let mut at = 0;
        for p in parts {
            buf.copy_to_device(stream, at, p)?;
            at += p.len();
        }
        self.in_use.push((stream.record_event()?, buf));
        Ok(())
    }
}

impl Drop for StagedRoute {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.send_tx = None;
        self.recv_tx = None;
        // No stream may stay blocked on a message that will not come now.
        self.shared.flag.release_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::debug!("a staging thread panicked");
            }
        }
        // The device may still copy out of receive buffers: wait (bounded), else leak them
        // rather than free memory in use.
        let deadline = Instant::now() + DRAIN;
        for (ev, buf) in self.in_use.drain(..) {
            let done = loop {
                match ev.is_complete() {
                    Ok(true) => break true,
                    Ok(false) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    _ => break false,
                }
            };
            if !done {
                std::mem::forget(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_differ_by_team_and_purpose_and_never_take_the_abort_tag() {
        let a = domain_of(&[0, 1], 1);
        assert_eq!(a, domain_of(&[0, 1], 1));
        assert_ne!(a, domain_of(&[1, 0], 1));
        assert_ne!(a, domain_of(&[0, 1], 2));
        assert_ne!(a, domain_of(&[0, 1, 2], 1));
        assert_ne!(a, u64::MAX);
    }
}
