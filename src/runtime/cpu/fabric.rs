//! The message fabric between CPU rank threads.
//!
//! Messages are keyed by `(source, destination, team fingerprint, team sequence number)`:
//! every member of a team numbers the communications it enters on that team, so matching
//! operations of a collective get the same key on every member. Sends never block; a receive
//! blocks until its message arrives, the timeout passes, or the run is aborted because some
//! rank failed (checked every few milliseconds).
//!
//! In a multi-process run ([`multinode`](crate::runtime::multinode)) a fabric holds the ranks
//! of one node and a [`RemoteLink`] to the ranks of the other nodes: messages to and from
//! those travel through the link (the host proxy) under the same keys, so every kind of
//! communication works unchanged. Without a link (the default) nothing changes.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::{DeviceId, EntityRef, HostTensorId};

use crate::runtime::backend::BackendError;
use crate::runtime::cpu_ops::MoeRows;
use crate::runtime::data::Storage;

/// A message body.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Tensor elements.
    Data(Storage),
    /// MoE rows with their routing metadata.
    Moe(MoeRows),
}

impl Payload {
    /// Bytes the message body occupies (elements plus MoE row metadata).
    pub fn size_bytes(&self) -> u64 {
        match self {
            Payload::Data(s) => s.size_bytes(),
            Payload::Moe(m) => m.size_bytes(),
        }
    }
}

/// A message key: `(src, dst, team fingerprint, sequence number)`.
pub type MailKey = (DeviceId, DeviceId, u64, u64);

/// The first failure of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The rank that failed.
    pub rank: DeviceId,
    /// Its error, printed.
    pub reason: String,
}

/// The ranks of other nodes, reached through a transport (the host proxy).
pub trait RemoteLink: Send + Sync + fmt::Debug {
    /// True when `rank` lives on another node.
    fn is_remote(&self, rank: DeviceId) -> bool;
    /// Delivers a message whose destination `key.1` is remote (never waits for the receiver).
    fn send(&self, key: MailKey, payload: Payload) -> Result<(), BackendError>;
    /// Receives the message whose source `key.0` is remote.
    fn recv(&self, key: MailKey, timeout: Duration, what: &str) -> Result<Payload, BackendError>;
    /// A local rank failed: tell the other nodes (best effort).
    fn fail(&self, rank: DeviceId, reason: &str);
    /// A failure seen by the link (a lost node, another node's failure notice), if any.
    fn failure(&self) -> Option<Failure>;
}

/// What the sender of a message operates on, so that the receiver can tell when the two
/// ranks are in different operations that happen to share a team position (two equal-size
/// collectives issued in swapped order). Only messages between ranks of one process carry
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operands {
    /// The operation (`all_reduce`, ...).
    pub name: &'static str,
    /// The send buffer: tensor, and element offset of the view (when the rank holds it).
    pub input: Option<(HostTensorId, u64)>,
    /// The receive buffer, likewise.
    pub output: Option<(HostTensorId, u64)>,
}

impl Operands {
    /// Why the sender's operands differ from the receiver's, comparing what both hold.
    pub fn mismatch(&self, mine: &Operands) -> Option<String> {
        if self.name != mine.name {
            return Some(format!("{} vs {}", self.name, mine.name));
        }
        let show = |(t, o): (HostTensorId, u64)| format!("tensor #{} at element {o}", t.index());
        for (role, theirs, ours) in [
            ("send", self.input, mine.input),
            ("receive", self.output, mine.output),
        ] {
            if let (Some(a), Some(b)) = (theirs, ours) {
                if a != b {
                    return Some(format!(
                        "its {role} buffer is {}, this rank's is {}",
                        show(a),
                        show(b)
                    ));
                }
            }
        }
        None
    }
}

/// A message in flight.
#[derive(Debug)]
struct Mail {
    payload: Payload,
    operands: Option<Operands>,
}

/// The messages in flight, and how many each `(source, destination)` pair has in flight.
#[derive(Debug, Default)]
struct Mailbox {
    messages: HashMap<MailKey, Mail>,
    per_pair: HashMap<(DeviceId, DeviceId), usize>,
}

impl Mailbox {
    fn contains_key(&self, key: &MailKey) -> bool {
        self.messages.contains_key(key)
    }

    fn insert(&mut self, key: MailKey, payload: Payload, operands: Option<Operands>) {
        let mail = Mail { payload, operands };
        if self.messages.insert(key, mail).is_none() {
            *self.per_pair.entry((key.0, key.1)).or_insert(0) += 1;
        }
    }

    fn remove(&mut self, key: &MailKey) -> Option<Mail> {
        let p = self.messages.remove(key)?;
        if let Some(n) = self.per_pair.get_mut(&(key.0, key.1)) {
            *n -= 1;
            if *n == 0 {
                self.per_pair.remove(&(key.0, key.1));
            }
        }
        Some(p)
    }

    fn pending(&self, src: DeviceId, dst: DeviceId) -> usize {
        self.per_pair.get(&(src, dst)).copied().unwrap_or(0)
    }

    fn keys(&self) -> impl Iterator<Item = &MailKey> {
        self.messages.keys()
    }

    fn values(&self) -> impl Iterator<Item = &Payload> {
        self.messages.values().map(|m| &m.payload)
    }

    fn len(&self) -> usize {
        self.messages.len()
    }

    fn clear(&mut self) {
        self.messages.clear();
        self.messages.shrink_to_fit();
        self.per_pair.clear();
        self.per_pair.shrink_to_fit();
    }
}

/// Shared mailboxes, an abort flag and the first failure of a run.
#[derive(Debug, Default)]
pub struct Fabric {
    mail: Mutex<Mailbox>,
    arrived: Condvar,
    abort: AtomicBool,
    failure: Mutex<Option<Failure>>,
    /// Which rank each blocked rank is receiving from, to blame the right rank on a timeout.
    waiting: Mutex<HashMap<DeviceId, DeviceId>>,
    /// The ranks of other nodes (multi-process runs).
    remote: Option<Arc<dyn RemoteLink>>,
}

/// How often a blocked receive re-checks the abort flag.
const POLL: Duration = Duration::from_millis(10);

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Fabric {
        Fabric::default()
    }

    /// A fabric for the ranks of one node that reaches the other nodes through `link`.
    pub fn with_remote(link: Arc<dyn RemoteLink>) -> Fabric {
        Fabric {
            remote: Some(link),
            ..Fabric::default()
        }
    }

    /// The link to other nodes, if any.
    pub fn remote(&self) -> Option<&Arc<dyn RemoteLink>> {
        self.remote.as_ref()
    }

    /// The remote link when `rank` is on another node.
    fn remote_for(&self, rank: DeviceId) -> Option<&Arc<dyn RemoteLink>> {
        self.remote.as_ref().filter(|l| l.is_remote(rank))
    }

    /// Turns a failure the link has seen into this fabric's failure.
    fn check_remote(&self) {
        if let Some(f) = self.remote.as_ref().and_then(|l| l.failure()) {
            self.fail(f.rank, f.reason);
        }
    }

    fn lock_mail(&self) -> MutexGuard<'_, Mailbox> {
        // A panicking rank never holds this lock while panicking (no user code runs under
        // it), so a poisoned lock still holds consistent data.
        self.mail.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Delivers a message (never blocks). A second message under the same key is an error.
    pub fn send(&self, key: MailKey, payload: Payload) -> Result<(), BackendError> {
        self.send_bounded(key, payload, usize::MAX, Duration::MAX, "")
    }

    /// Delivers a message once the destination holds fewer than `limit` messages from this
    /// source that it has not taken yet (backpressure, like the bounded buffers of NCCL or the
    /// host proxy's credits): a rank whose peers only receive from it, run step after step,
    /// cannot run ahead without bound while its messages pile up. Waits up to `timeout`
    /// (then blames the destination) and stops when the run is aborted.
    pub fn send_bounded(
        &self,
        key: MailKey,
        payload: Payload,
        limit: usize,
        timeout: Duration,
        what: &str,
    ) -> Result<(), BackendError> {
        self.send_checked(key, payload, None, limit, timeout, what)
    }

    /// [`Fabric::send_bounded`], with the sender's operands for [`Fabric::recv_checked`].
    pub fn send_checked(
        &self,
        key: MailKey,
        payload: Payload,
        operands: Option<Operands>,
        limit: usize,
        timeout: Duration,
        what: &str,
    ) -> Result<(), BackendError> {
        if let Some(link) = self.remote_for(key.1) {
            return link.send(key, payload).inspect_err(|_| self.check_remote());
        }
        let (me, peer) = (key.0, key.1);
        let start = Instant::now();
        let mut mail = self.lock_mail();
        if mail.pending(me, peer) >= limit.max(1) {
            self.set_waiting(me, Some(peer));
            while mail.pending(me, peer) >= limit.max(1) {
                if self.aborted() {
                    drop(mail);
                    self.set_waiting(me, None);
                    return Err(self.abort_error());
                }
                let waited = start.elapsed();
                if waited >= timeout {
                    drop(mail);
                    // Keeps its wait-for entry, as a receive that times out does.
                    let (culprit, chain) = self.blame(me, peer);
                    return Err(BackendError::Timeout {
                        peer: culprit,
                        waited,
                        what: format!(
                            "rank {peer} to take the {limit} messages already sent to it \
                             before sending {what}{chain}"
                        ),
                    });
                }
                mail = self
                    .arrived
                    .wait_timeout(mail, POLL.min(timeout - waited))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            self.set_waiting(me, None);
        }
        if mail.contains_key(&key) {
            return Err(BackendError::Invalid(format!(
                "rank {} sent two messages to rank {} for the same team operation (sequence {})",
                key.0, key.1, key.3
            )));
        }
        mail.insert(key, payload, operands);
        drop(mail);
        self.arrived.notify_all();
        Ok(())
    }

    /// Takes the message under `key`, waiting up to `timeout`.
    pub fn recv(
        &self,
        key: MailKey,
        timeout: Duration,
        what: &str,
    ) -> Result<Payload, BackendError> {
        self.recv_checked(key, timeout, what, None)
    }

    /// [`Fabric::recv`]; when both sides gave their operands and they differ, an error
    /// naming the difference instead of data from another operation.
    pub fn recv_checked(
        &self,
        key: MailKey,
        timeout: Duration,
        what: &str,
        mine: Option<&Operands>,
    ) -> Result<Payload, BackendError> {
        let mail = self.recv_mail(key, timeout, what)?;
        if let (Some(theirs), Some(mine)) = (&mail.operands, mine) {
            if let Some(why) = theirs.mismatch(mine) {
                return Err(BackendError::Invalid(format!(
                    "rank {} is in a different operation at this position of the team's \
                     sequence ({why}): the members issue their collectives in different orders",
                    key.0
                )));
            }
        }
        Ok(mail.payload)
    }

    fn recv_mail(&self, key: MailKey, timeout: Duration, what: &str) -> Result<Mail, BackendError> {
        if let Some(link) = self.remote_for(key.0) {
            return link
                .recv(key, timeout, what)
                .map(|payload| Mail {
                    payload,
                    operands: None,
                })
                .inspect_err(|_| self.check_remote());
        }
        let start = Instant::now();
        let (me, peer) = (key.1, key.0);
        self.set_waiting(me, Some(peer));
        let mut mail = self.lock_mail();
        loop {
            if let Some(p) = mail.remove(&key) {
                drop(mail);
                // A sender may be waiting for room (`send_bounded`).
                self.arrived.notify_all();
                self.set_waiting(me, None);
                return Ok(p);
            }
            if self.remote.is_some() {
                drop(mail);
                self.check_remote();
                mail = self.lock_mail();
                if let Some(p) = mail.remove(&key) {
                    drop(mail);
                    self.arrived.notify_all();
                    self.set_waiting(me, None);
                    return Ok(p);
                }
            }
            if self.aborted() {
                drop(mail);
                self.set_waiting(me, None);
                return Err(self.abort_error());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                drop(mail);
                let (culprit, chain) = self.blame(me, peer);
                // This rank keeps its wait-for entry: its thread records the failure (naming
                // the culprit) only after this returns, and a rank that waits for this one and
                // times out in between must still follow the chain through it to the culprit,
                // not blame this rank for no longer being in a receive.
                return Err(BackendError::Timeout {
                    peer: culprit,
                    waited,
                    what: format!("{what}{chain}"),
                });
            }
            let slice = POLL.min(timeout - waited);
            mail = self
                .arrived
                .wait_timeout(mail, slice)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Records which rank `me` is blocked on (`None`: not blocked).
    fn set_waiting(&self, me: DeviceId, peer: Option<DeviceId>) {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        match peer {
            Some(p) => w.insert(me, p),
            None => w.remove(&me),
        };
    }

    /// Follows the wait-for chain from `peer` (whom `me` waits for) to the rank that is not
    /// itself waiting in a receive: that rank stalled (or is stuck outside communication).
    /// Returns it and a description of the chain; a cycle is reported as a deadlock.
    fn blame(&self, me: DeviceId, peer: DeviceId) -> (DeviceId, String) {
        let w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let mut chain = vec![me, peer];
        let mut at = peer;
        while let Some(&next) = w.get(&at) {
            if chain.contains(&next) {
                let cycle: Vec<String> = chain.iter().map(|r| format!("rank {r}")).collect();
                return (
                    peer,
                    format!(
                        "; deadlock: {} waits for rank {next}",
                        cycle.join(" waits for ")
                    ),
                );
            }
            chain.push(next);
            at = next;
        }
        if at == peer {
            return (peer, String::new());
        }
        let path: Vec<String> = chain[1..].iter().map(|r| format!("rank {r}")).collect();
        (
            at,
            format!(
                "; {} waits for rank {at}, which is not in a communication (stalled)",
                path[..path.len() - 1].join(" waits for ")
            ),
        )
    }

    /// True once some rank failed (on this node, or reported by the remote link).
    pub fn aborted(&self) -> bool {
        if self.remote.is_some() && !self.abort.load(Ordering::Acquire) {
            self.check_remote();
        }
        self.abort.load(Ordering::Acquire)
    }

    /// The error a rank returns when it stops because of another rank's failure.
    pub fn abort_error(&self) -> BackendError {
        match self.failure() {
            Some(f) => BackendError::Aborted {
                failed_rank: f.rank,
                reason: f.reason,
            },
            None => BackendError::Invalid("the run was aborted".into()),
        }
    }

    /// Records a failure (the first one wins) and wakes every blocked rank.
    pub fn fail(&self, rank: DeviceId, reason: String) {
        let first = {
            let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            let first = f.is_none();
            if first {
                *f = Some(Failure {
                    rank,
                    reason: reason.clone(),
                });
            }
            first
        };
        if let Some(link) = self.remote.as_ref() {
            // A failure of one of this node's ranks is news to the other nodes.
            if first && !link.is_remote(rank) {
                link.fail(rank, &reason);
            }
        }
        self.abort.store(true, Ordering::Release);
        let _guard = self.lock_mail();
        self.arrived.notify_all();
    }

    /// The first failure, if any.
    pub fn failure(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Keys of messages sent but never received.
    pub fn undelivered(&self) -> Vec<MailKey> {
        let mut keys: Vec<MailKey> = self.lock_mail().keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Messages sent but not (yet) received, and their bytes.
    pub fn in_flight(&self) -> super::BufferStats {
        let mail = self.lock_mail();
        super::BufferStats {
            buffers: mail.len(),
            bytes: mail.values().map(Payload::size_bytes).sum(),
        }
    }

    /// Drops every message sent but never received (after a failed run) and returns what was
    /// dropped.
    pub fn discard_undelivered(&self) -> super::BufferStats {
        let mut mail = self.lock_mail();
        let dropped = super::BufferStats {
            buffers: mail.len(),
            bytes: mail.values().map(Payload::size_bytes).sum(),
        };
        mail.clear();
        dropped
    }

    /// Sleeps in short slices until the run is aborted or `limit` passes (fault injection).
    #[cfg(feature = "fault-injection")]
    pub fn stall(&self, limit: Duration) {
        let start = Instant::now();
        while !self.aborted() && start.elapsed() < limit {
            std::thread::sleep(POLL);
        }
    }
}

/// A fingerprint of a team's member list (FNV-1a), the same on every member.
pub fn team_fingerprint(members: &[DeviceId]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &d in members {
        for b in (d as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::data::Storage;

    fn msg() -> Payload {
        Payload::Data(Storage::F32(vec![1.0; 4]))
    }

    /// Regression (resource checks): sends never blocked, so a rank that only sends (a
    /// pipeline's first stage, run step after step) ran ahead of its receiver and its messages
    /// piled up without bound. A send now waits while `limit` messages are in flight to the
    /// same destination, and times out naming the destination.
    #[test]
    fn sends_wait_for_room_and_time_out_naming_the_receiver() {
        let fabric = Fabric::new();
        let timeout = Duration::from_millis(50);
        for seq in 0..2 {
            fabric
                .send_bounded((0, 1, 7, seq), msg(), 2, timeout, "send_recv")
                .unwrap();
        }
        assert_eq!(fabric.in_flight().buffers, 2);
        let err = fabric
            .send_bounded((0, 1, 7, 2), msg(), 2, timeout, "send_recv")
            .unwrap_err();
        match &err {
            BackendError::Timeout { peer, what, .. } => {
                assert_eq!(*peer, 1);
                assert!(what.contains("rank 1 to take the 2 messages"), "{what}");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        // Other destinations are not held up, and room frees up as the receiver takes.
        fabric
            .send_bounded((0, 2, 7, 0), msg(), 2, timeout, "send_recv")
            .unwrap();
        fabric.recv((0, 1, 7, 0), timeout, "send_recv").unwrap();
        fabric
            .send_bounded((0, 1, 7, 2), msg(), 2, timeout, "send_recv")
            .unwrap();
        assert_eq!(fabric.in_flight().buffers, 3);
        assert_eq!(fabric.discard_undelivered().buffers, 3);
        assert!(fabric.in_flight().is_empty());
    }

    /// Regression (a flaky fault test): rank 2 stalls, rank 1 times out waiting for it, and
    /// rank 3, waiting for rank 1, times out before rank 1's thread has recorded the failure.
    /// Rank 1 used to drop out of the wait-for chain as it gave up, so rank 3 blamed rank 1.
    #[test]
    fn a_rank_that_timed_out_still_leads_the_chain_to_the_stalled_rank() {
        let fabric = Fabric::new();
        let timeout = Duration::from_millis(20);
        let culprit = |e: BackendError| match e {
            BackendError::Timeout { peer, what, .. } => (peer, what),
            other => panic!("expected a timeout, got {other}"),
        };
        let (first, _) = culprit(fabric.recv((2, 1, 7, 0), timeout, "recv").unwrap_err());
        assert_eq!(first, 2);
        let (second, what) = culprit(fabric.recv((1, 3, 7, 0), timeout, "recv").unwrap_err());
        assert_eq!(second, 2, "{what}");
        assert!(what.contains("rank 1 waits for rank 2"), "{what}");
    }

    #[test]
    fn a_blocked_send_stops_when_the_run_is_aborted() {
        let fabric = std::sync::Arc::new(Fabric::new());
        fabric
            .send_bounded((0, 1, 7, 0), msg(), 1, Duration::from_secs(5), "x")
            .unwrap();
        let f = fabric.clone();
        let failer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            f.fail(1, "rank 1 failed".into());
        });
        let start = Instant::now();
        let err = fabric
            .send_bounded((0, 1, 7, 1), msg(), 1, Duration::from_secs(5), "x")
            .unwrap_err();
        failer.join().unwrap();
        assert!(
            matches!(err, BackendError::Aborted { failed_rank: 1, .. }),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
