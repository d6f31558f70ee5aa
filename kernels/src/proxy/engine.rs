//! [`Proxy`]: one rank's host proxy. The rank stages chunks in its send region and raises a
//! per-peer flag; the proxy thread watches the flags, posts one-sided writes with immediates
//! into the peers' receive rings, handles incoming immediates (reassembles messages, counts
//! chunks per message, raises the message's flag), and returns ring space to the senders with
//! credit writes. See [`layout`](super::layout) for the bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::layout::{chunk_imm, chunk_offset, Header, Layout, Tag, ABORT_TAG, HEADER, IMM_CREDIT};
use super::{Completion, ProxyError, Wire};

/// How long an idle proxy thread waits in one poll.
const IDLE_POLL: Duration = Duration::from_millis(2);
/// How often a blocked sender or receiver re-checks for failures.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Counters of one proxy (what travelled through the protocol).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// One-sided writes of chunks posted.
    pub chunk_writes: u64,
    /// Chunk immediates received.
    pub chunk_immediates: u64,
    /// Credit writes posted.
    pub credit_writes: u64,
    /// Messages completely received (every chunk counted).
    pub messages_received: u64,
    /// Payload bytes written to peers.
    pub bytes_written: u64,
}

#[derive(Debug, Default)]
struct Counters {
    chunk_writes: AtomicU64,
    chunk_immediates: AtomicU64,
    credit_writes: AtomicU64,
    messages_received: AtomicU64,
    bytes_written: AtomicU64,
}

#[derive(Debug, Default)]
struct Mail {
    ready: HashMap<(usize, Tag), Vec<u8>>,
    failure: Option<ProxyError>,
}

#[derive(Debug)]
struct Shared {
    layout: Layout,
    wire: Arc<dyn Wire>,
    /// Sender side, per peer: the next free absolute ring position (held while staging).
    cursors: Vec<Mutex<u64>>,
    /// The flags: staged up to this position (raised by the sender, watched by the proxy).
    staged: Vec<AtomicU64>,
    /// Posted up to this position (proxy thread).
    posted: Vec<AtomicU64>,
    /// Credits: the peer has released its ring up to this position.
    released_by_peer: Vec<AtomicU64>,
    credit: Mutex<()>,
    credit_cv: Condvar,
    mail: Mutex<Mail>,
    mail_cv: Condvar,
    failed: AtomicBool,
    stop: AtomicBool,
    counters: Counters,
}

impl Shared {
    fn lock_mail(&self) -> MutexGuard<'_, Mail> {
        // Only map operations run under the lock; it is never poisoned with broken data.
        self.mail.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the first failure and wakes every waiter.
    fn fail(&self, error: ProxyError) {
        {
            let mut m = self.lock_mail();
            if m.failure.is_none() {
                tracing::debug!(rank = self.layout.me, "proxy failure: {error}");
                m.failure = Some(error);
            }
        }
        self.failed.store(true, Ordering::Release);
        self.mail_cv.notify_all();
        let _g = self.credit.lock().unwrap_or_else(|e| e.into_inner());
        self.credit_cv.notify_all();
    }

    fn failure(&self) -> Option<ProxyError> {
        self.lock_mail().failure.clone()
    }

    fn index(&self, peer: usize) -> Result<usize, ProxyError> {
        self.layout.index_of(peer).ok_or_else(|| {
            ProxyError::InvalidArgument(format!(
                "rank {peer} is not a proxy peer of rank {} (peers: {:?})",
                self.layout.me, self.layout.peers
            ))
        })
    }
}

/// One rank's host proxy over a [`Wire`]: started once, used by the rank's thread to send and
/// receive tagged messages to and from ranks of other nodes, stopped on drop.
#[derive(Debug)]
pub struct Proxy {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Starts the proxy thread of `layout.me` on `wire` (whose regions have the layout's
    /// [`region_len`](Layout::region_len)).
    pub fn start(layout: Layout, wire: Arc<dyn Wire>) -> Result<Proxy, ProxyError> {
        let n = layout.peers.len();
        let atomics = || (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        let shared = Arc::new(Shared {
            cursors: (0..n).map(|_| Mutex::new(0)).collect(),
            staged: atomics(),
            posted: atomics(),
            released_by_peer: atomics(),
            credit: Mutex::new(()),
            credit_cv: Condvar::new(),
            mail: Mutex::new(Mail::default()),
            mail_cv: Condvar::new(),
            failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            layout,
            wire,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("meshflow-proxy-{}", shared.layout.me))
            .spawn(move || ProxyThread::new(s).run())
            .map_err(|e| ProxyError::Setup(format!("cannot start the proxy thread: {e}")))?;
        Ok(Proxy {
            shared,
            thread: Some(thread),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.layout.me
    }

    /// The proxy peers (ranks on other nodes), ascending.
    pub fn peers(&self) -> &[usize] {
        &self.shared.layout.peers
    }

    /// The wire's name.
    pub fn wire_name(&self) -> &'static str {
        self.shared.wire.name()
    }

    /// Sends `bytes` to `peer` under `tag`: stages the chunks in the send ring and raises the
    /// flag. Never waits for the receiver's rank, only for ring space (credits), up to
    /// `timeout`.
    pub fn send(
        &self,
        peer: usize,
        tag: Tag,
        bytes: &[u8],
        timeout: Duration,
    ) -> Result<(), ProxyError> {
        if tag == ABORT_TAG {
            return Err(ProxyError::InvalidArgument(
                "the abort tag is reserved".into(),
            ));
        }
        if let Some(f) = self.shared.failure() {
            return Err(f);
        }
        let i = self.shared.index(peer)?;
        let cursor = self.shared.cursors[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.stage_message(i, cursor, tag, bytes, Some(timeout))
    }

    /// Stages every chunk of one message for peer index `i` (`timeout: None`: do not wait for
    /// credits, fail at once when the ring is full).
    fn stage_message(
        &self,
        i: usize,
        mut cursor: MutexGuard<'_, u64>,
        tag: Tag,
        bytes: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), ProxyError> {
        let s = &*self.shared;
        let (ring, max) = (s.layout.ring as u64, s.layout.max_chunk_data());
        let count = bytes.len().div_ceil(max).max(1);
        let chunk_count = u32::try_from(count).map_err(|_| {
            ProxyError::InvalidArgument(format!("a message of {} bytes is too large", bytes.len()))
        })?;
        let start_time = Instant::now();
        for (index, data) in (0..count).map(|c| {
            let lo = c * max;
            (c, &bytes[lo..(lo + max).min(bytes.len())])
        }) {
            let reserved_from = *cursor;
            let header = Header {
                pad: false,
                tag,
                msg_len: bytes.len() as u64,
                chunk_index: index as u32,
                chunk_count,
                data_offset: (index * max) as u64,
                data_len: data.len() as u64,
                reserved_from,
            };
            let size = header.footprint() as u64;
            let off = reserved_from % ring;
            let start = if off + size > ring {
                reserved_from + (ring - off)
            } else {
                reserved_from
            };
            let end = start + size;
            self.wait_credit(i, end, start_time, timeout)?;
            let base = s.layout.ring_base(i);
            if start != reserved_from {
                s.wire.stage(base + off as usize, &Header::pad().encode())?;
            }
            let at = base + (start % ring) as usize;
            s.wire.stage(at + HEADER, data)?;
            s.wire.stage(at, &header.encode())?;
            *cursor = end;
            // Raise the flag: everything up to `end` is staged.
            s.staged[i].store(end, Ordering::Release);
            s.wire.wake();
        }
        Ok(())
    }

    /// Waits until the peer has released its ring up to `end - ring`.
    fn wait_credit(
        &self,
        i: usize,
        end: u64,
        start: Instant,
        timeout: Option<Duration>,
    ) -> Result<(), ProxyError> {
        let s = &*self.shared;
        let ring = s.layout.ring as u64;
        let ok = || end.saturating_sub(s.released_by_peer[i].load(Ordering::Acquire)) <= ring;
        let mut guard = s.credit.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if ok() {
                return Ok(());
            }
            if s.failed.load(Ordering::Acquire) && timeout.is_some() {
                drop(guard);
                if let Some(f) = s.failure() {
                    return Err(f);
                }
                guard = s.credit.lock().unwrap_or_else(|e| e.into_inner());
            }
            let waited = start.elapsed();
            let limit = timeout.unwrap_or(Duration::ZERO);
            if waited >= limit {
                return Err(ProxyError::Timeout {
                    peer: s.layout.peers[i],
                    waited,
                    what: "ring space (the peer's proxy returns no credits)".into(),
                });
            }
            guard = s
                .credit_cv
                .wait_timeout(guard, WAIT_SLICE.min(limit - waited))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Receives the message `peer` sent under `tag`, waiting up to `timeout`. A failure of the
    /// proxy (a lost peer, an abort) ends the wait at once.
    pub fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Vec<u8>, ProxyError> {
        let s = &*self.shared;
        s.index(peer)?;
        let start = Instant::now();
        let mut mail = s.lock_mail();
        loop {
            if let Some(v) = mail.ready.remove(&(peer, tag)) {
                return Ok(v);
            }
            if let Some(f) = &mail.failure {
                return Err(f.clone());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(ProxyError::Timeout {
                    peer,
                    waited,
                    what: format!("message {tag:?}"),
                });
            }
            mail = s
                .mail_cv
                .wait_timeout(mail, WAIT_SLICE.min(timeout - waited))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Fails every current and later wait of this proxy with [`ProxyError::Aborted`].
    pub fn abort(&self, rank: usize, reason: &str) {
        self.shared.fail(ProxyError::Aborted {
            rank,
            reason: reason.to_owned(),
        });
    }

    /// Tells every peer that `rank` failed (best effort: a peer whose ring is full or whose
    /// link is gone is skipped), then aborts this proxy. The peers' waits end with
    /// [`ProxyError::Aborted`].
    pub fn notify_failure(&self, rank: usize, reason: &str) {
        let mut payload = (rank as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        // Another thread of this node may be mid-send to a peer (holding its cursor): retry
        // for a bounded time rather than skip the peer, or it would only see the connection
        // close and blame the wrong rank. A holder blocked on ring credits from a dead peer
        // gives up the notice to that peer after the bound.
        let lock_deadline = Instant::now() + Duration::from_millis(250);
        let notice_deadline = Instant::now() + Duration::from_secs(1);
        for i in 0..self.shared.layout.peers.len() {
            let cursor = loop {
                match self.shared.cursors[i].try_lock() {
                    Ok(c) => break Some(c),
                    Err(std::sync::TryLockError::Poisoned(e)) => break Some(e.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() < lock_deadline => {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(std::sync::TryLockError::WouldBlock) => break None,
                }
            };
            let Some(cursor) = cursor else {
                tracing::debug!(
                    rank = self.rank(),
                    "could not notify rank {} of the failure: its send cursor stayed busy",
                    self.shared.layout.peers[i]
                );
                continue;
            };
            // The receiving proxy drains its ring on its own, so a full ring frees up soon:
            // wait for space (within one overall bound, in case that peer is gone too).
            let left = notice_deadline.saturating_duration_since(Instant::now());
            if let Err(e) = self.stage_message(i, cursor, ABORT_TAG, &payload, Some(left)) {
                tracing::debug!(
                    rank = self.rank(),
                    "could not notify rank {} of the failure: {e}",
                    self.shared.layout.peers[i]
                );
            }
        }
        // Let the proxy thread post the notices before the local abort stops anything (this
        // is the failure path: waiting a little longer on a loaded machine costs nothing).
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline && !self.all_posted() {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.abort(rank, reason);
    }

    fn all_posted(&self) -> bool {
        let s = &*self.shared;
        (0..s.layout.peers.len())
            .all(|i| s.posted[i].load(Ordering::Acquire) >= s.staged[i].load(Ordering::Acquire))
    }

    /// Waits until every staged chunk has been posted and has left this rank.
    pub fn flush(&self, timeout: Duration) -> Result<(), ProxyError> {
        let start = Instant::now();
        while !self.all_posted() {
            if let Some(f) = self.shared.failure() {
                return Err(f);
            }
            if start.elapsed() >= timeout {
                return Err(ProxyError::Timeout {
                    peer: self.rank(),
                    waited: start.elapsed(),
                    what: "the proxy thread to post every staged chunk".into(),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        self.shared
            .wire
            .flush(timeout.saturating_sub(start.elapsed()))
    }

    /// Messages that arrived but were never received, as `(peer, tag)`, sorted.
    pub fn undelivered(&self) -> Vec<(usize, Tag)> {
        let mut v: Vec<(usize, Tag)> = self.shared.lock_mail().ready.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The failure that stopped this proxy, if any.
    pub fn failure(&self) -> Option<ProxyError> {
        self.shared.failure()
    }

    /// The counters.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            chunk_writes: get(&c.chunk_writes),
            chunk_immediates: get(&c.chunk_immediates),
            credit_writes: get(&c.credit_writes),
            messages_received: get(&c.messages_received),
            bytes_written: get(&c.bytes_written),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Give the proxy thread a moment to post what is already staged (e.g. a failure
        // notice), so peers see it before the connection closes.
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline && !self.all_posted() {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wire.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!(rank = self.shared.layout.me, "the proxy thread panicked");
            }
        }
    }
}

/// A message being reassembled.
#[derive(Debug)]
struct Partial {
    bytes: Vec<u8>,
    chunk_count: u32,
    seen: u32,
}

/// The proxy thread's own state.
struct ProxyThread {
    s: Arc<Shared>,
    /// Receiver side, per peer: released up to this absolute position.
    released: Vec<u64>,
    /// Chunks processed out of order: start of reservation -> end.
    pending: Vec<BTreeMap<u64, u64>>,
    credit_sent: Vec<u64>,
    lost: Vec<bool>,
    partial: HashMap<(usize, Tag), Partial>,
}

impl ProxyThread {
    fn new(s: Arc<Shared>) -> ProxyThread {
        let n = s.layout.peers.len();
        ProxyThread {
            s,
            released: vec![0; n],
            pending: vec![BTreeMap::new(); n],
            credit_sent: vec![0; n],
            lost: vec![false; n],
            partial: HashMap::new(),
        }
    }

    fn run(mut self) {
        let mut completions = Vec::new();
        while !self.s.stop.load(Ordering::Acquire) {
            let busy = self.post_staged();
            completions.clear();
            let wait = if busy { Duration::ZERO } else { IDLE_POLL };
            if let Err(e) = self.s.wire.poll(&mut completions, wait) {
                self.s.fail(e);
                std::thread::sleep(IDLE_POLL);
            }
            for c in completions.drain(..) {
                if let Err(e) = self.handle(c) {
                    self.s.fail(e);
                }
            }
            self.send_credits();
        }
    }

    /// Posts every staged chunk (the flags raised since the last look). True if any.
    fn post_staged(&mut self) -> bool {
        let mut busy = false;
        for i in 0..self.s.layout.peers.len() {
            if self.lost[i] {
                continue;
            }
            let staged = self.s.staged[i].load(Ordering::Acquire);
            while self.s.posted[i].load(Ordering::Relaxed) < staged {
                busy = true;
                if let Err(e) = self.post_one(i) {
                    self.lose(i, e);
                    break;
                }
            }
        }
        busy
    }

    fn post_one(&mut self, i: usize) -> Result<(), ProxyError> {
        let s = &*self.s;
        let (ring, peer) = (s.layout.ring as u64, s.layout.peers[i]);
        let posted = s.posted[i].load(Ordering::Relaxed);
        let off = (posted % ring) as usize;
        let base = s.layout.ring_base(i);
        let mut hb = [0u8; HEADER];
        s.wire.read_staged(base + off, &mut hb)?;
        let h = Header::decode(&hb).map_err(|message| ProxyError::Protocol {
            peer: s.layout.me,
            message: format!("own staged chunk: {message}"),
        })?;
        if h.pad {
            s.posted[i].store(posted + (ring - off as u64), Ordering::Release);
            return Ok(());
        }
        let remote = s.layout.ring_base(s.layout.slot_at_peer[i]) + off;
        let len = HEADER + h.data_len as usize;
        s.wire
            .post_write(peer, base + off, remote, len, chunk_imm(off))?;
        s.counters.chunk_writes.fetch_add(1, Ordering::Relaxed);
        s.counters
            .bytes_written
            .fetch_add(h.data_len, Ordering::Relaxed);
        s.posted[i].store(posted + h.footprint() as u64, Ordering::Release);
        Ok(())
    }

    fn lose(&mut self, i: usize, e: ProxyError) {
        self.lost[i] = true;
        let peer = self.s.layout.peers[i];
        let e = match e {
            ProxyError::PeerLost { .. } | ProxyError::Protocol { .. } => e,
            other => ProxyError::PeerLost {
                peer,
                reason: other.to_string(),
            },
        };
        self.s.fail(e);
    }

    fn handle(&mut self, c: Completion) -> Result<(), ProxyError> {
        match c {
            Completion::Wake | Completion::Sent { .. } => Ok(()),
            Completion::Lost { peer, reason } => {
                if let Some(i) = self.s.layout.index_of(peer) {
                    self.lose(i, ProxyError::PeerLost { peer, reason });
                }
                Ok(())
            }
            Completion::Received { peer, imm, len } => {
                let i = self.s.index(peer)?;
                match chunk_offset(imm) {
                    Some(off) => self.receive_chunk(i, off, len),
                    None if imm == IMM_CREDIT => {
                        let mut b = [0u8; 8];
                        self.s
                            .wire
                            .read_received(self.s.layout.credit_offset(i), &mut b)?;
                        self.s.released_by_peer[i]
                            .fetch_max(u64::from_le_bytes(b), Ordering::AcqRel);
                        let _g = self.s.credit.lock().unwrap_or_else(|e| e.into_inner());
                        self.s.credit_cv.notify_all();
                        Ok(())
                    }
                    None => Err(ProxyError::Protocol {
                        peer,
                        message: format!("unknown control immediate {imm:#010x}"),
                    }),
                }
            }
        }
    }

    fn receive_chunk(&mut self, i: usize, off: usize, len: usize) -> Result<(), ProxyError> {
        let s = self.s.clone();
        let (ring, peer) = (s.layout.ring, s.layout.peers[i]);
        let bad = |message: String| ProxyError::Protocol { peer, message };
        if off + HEADER > ring {
            return Err(bad(format!(
                "chunk at ring offset {off} past the ring of {ring}"
            )));
        }
        s.counters.chunk_immediates.fetch_add(1, Ordering::Relaxed);
        let base = s.layout.ring_base(i);
        let mut hb = [0u8; HEADER];
        s.wire.read_received(base + off, &mut hb)?;
        let h = Header::decode(&hb).map_err(&bad)?;
        if h.pad || off + h.footprint() > ring || len != HEADER + h.data_len as usize {
            return Err(bad(format!(
                "chunk at ring offset {off} ({len} bytes written) does not fit its header {h:?}"
            )));
        }
        let max = s.layout.max_chunk_data() as u64;
        if h.msg_len > u64::from(h.chunk_count) * max {
            return Err(bad(format!(
                "a {}-byte message cannot travel in {} chunks",
                h.msg_len, h.chunk_count
            )));
        }
        let key = (peer, h.tag);
        let p = self.partial.entry(key).or_insert_with(|| Partial {
            bytes: Vec::new(),
            chunk_count: h.chunk_count,
            seen: 0,
        });
        if p.chunk_count != h.chunk_count || (p.seen > 0 && p.bytes.len() as u64 != h.msg_len) {
            return Err(bad(format!("chunks of message {:?} disagree", h.tag)));
        }
        if p.seen == 0 {
            p.bytes = vec![0; h.msg_len as usize];
        }
        let lo = h.data_offset as usize;
        s.wire.read_received(
            base + off + HEADER,
            &mut p.bytes[lo..lo + h.data_len as usize],
        )?;
        p.seen += 1;
        if p.seen == p.chunk_count {
            if let Some(done) = self.partial.remove(&key) {
                self.deliver(peer, h.tag, done.bytes)?;
            }
        }
        // Release the chunk (and the padding before it).
        let start = if h.reserved_from % ring as u64 == off as u64 {
            h.reserved_from
        } else if off == 0 {
            h.reserved_from.next_multiple_of(ring as u64)
        } else {
            return Err(bad(format!(
                "chunk at ring offset {off} reserved from position {}",
                h.reserved_from
            )));
        };
        self.pending[i].insert(h.reserved_from, start + h.footprint() as u64);
        while let Some(end) = self.pending[i].remove(&self.released[i]) {
            self.released[i] = end;
        }
        Ok(())
    }

    fn deliver(&mut self, peer: usize, tag: Tag, bytes: Vec<u8>) -> Result<(), ProxyError> {
        let s = &*self.s;
        if tag == ABORT_TAG {
            let rank = bytes
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map_or(peer, |b: [u8; 8]| u64::from_le_bytes(b) as usize);
            let reason = String::from_utf8_lossy(bytes.get(8..).unwrap_or_default()).into_owned();
            s.fail(ProxyError::Aborted { rank, reason });
            return Ok(());
        }
        let mut mail = s.lock_mail();
        if mail.ready.insert((peer, tag), bytes).is_some() {
            return Err(ProxyError::Protocol {
                peer,
                message: format!("two messages under tag {tag:?}"),
            });
        }
        drop(mail);
        s.counters.messages_received.fetch_add(1, Ordering::Relaxed);
        // Raise the message's flag.
        s.mail_cv.notify_all();
        Ok(())
    }

    /// Returns released ring space to the senders.
    fn send_credits(&mut self) {
        for i in 0..self.s.layout.peers.len() {
            if self.lost[i] || self.released[i] == self.credit_sent[i] {
                continue;
            }
            let s = self.s.clone();
            let word = s.layout.credit_offset(i);
            let remote = s.layout.remote_credit_offset(i);
            let r = s
                .wire
                .stage(word, &self.released[i].to_le_bytes())
                .and_then(|()| {
                    s.wire
                        .post_write(s.layout.peers[i], word, remote, 8, IMM_CREDIT)
                });
            match r {
                Ok(()) => {
                    self.credit_sent[i] = self.released[i];
                    s.counters.credit_writes.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => self.lose(i, e),
            }
        }
    }
}
