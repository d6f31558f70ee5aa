//! The host messages between CUDA IPC peers ([`Net`]): every rank listens on the loopback
//! interface (the peers share the host), connects once to each peer it transfers with, and
//! sends it offers and completions; a reader thread per incoming connection files them in the
//! rank's inbox, where the posting thread waits for them. A reader polls its connection for a
//! while after each frame ([`READ_SPIN`]) instead of sleeping in the kernel at once, so that
//! the next message of a run reaches the inbox without a thread wake-up.
//!
//! Frames (little endian): `len: u32` then `len` bytes: `kind: u8` and its fields:
//! `HELLO from: u64` (first on every connection), `OFFER label, seq, from, to: u64, n: u32,
//! handle: [u8; 64], allocation, offset, len: u64`, `DONE label, seq, from, to: u64, n: u32`,
//! `BYE` (the
//! sender is done with this connection; an end without it means the peer's process stopped).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::{AbortWord, IpcHandle, IPC_HANDLE_BYTES};

use super::super::peers::Key;

const HELLO: u8 = 1;
const OFFER: u8 = 2;
const DONE: u8 = 3;
const BYE: u8 = 4;

/// Largest frame accepted (an offer is about 120 bytes).
const MAX_FRAME: usize = 4096;
/// How often a blocked reader checks whether its link is gone.
const READ_SLICE: Duration = Duration::from_millis(200);
/// After a frame arrives, a reader polls its connection (yielding the thread) this long
/// before it blocks again: the messages of a run come in bursts, and a reader blocked in the
/// kernel wakes tens of microseconds after its frame arrives (longer from a deep idle state of
/// its core), time the posting thread of the receiving rank spends waiting for it.
const READ_SPIN: Duration = Duration::from_millis(10);
/// Host waits spin this many times (yielding the thread) before sleeping.
const SPINS: usize = 2000;

/// An offer received from a peer: the `n`-th transfer from it, in its allocation `handle` (of
/// `allocation` bytes) at `offset`, `len` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct OfferMsg {
    pub n: u32,
    pub handle: IpcHandle,
    pub allocation: u64,
    pub offset: u64,
    pub len: u64,
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Msg {
    Hello { from: DeviceId },
    Offer { key: Key, offer: OfferMsg },
    Done { key: Key, n: u32 },
    Bye,
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_key(out: &mut Vec<u8>, k: &Key) {
    for v in [k.label as u64, k.seq, k.from as u64, k.to as u64] {
        put_u64(out, v);
    }
}

impl Msg {
    /// The frame of this message.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(128);
        match self {
            Msg::Hello { from } => {
                body.push(HELLO);
                put_u64(&mut body, *from as u64);
            }
            Msg::Offer { key, offer } => {
                body.push(OFFER);
                put_key(&mut body, key);
                body.extend_from_slice(&offer.n.to_le_bytes());
                body.extend_from_slice(&offer.handle.to_bytes());
                put_u64(&mut body, offer.allocation);
                put_u64(&mut body, offer.offset);
                put_u64(&mut body, offer.len);
            }
            Msg::Done { key, n } => {
                body.push(DONE);
                put_key(&mut body, key);
                body.extend_from_slice(&n.to_le_bytes());
            }
            Msg::Bye => body.push(BYE),
        }
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        frame
    }

    /// The message of a frame's body (without its length).
    pub fn decode(body: &[u8]) -> Result<Msg, String> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], String> {
            let s = body
                .get(at..at + n)
                .ok_or_else(|| format!("a message of {} bytes ends early", body.len()))?;
            at += n;
            Ok(s)
        };
        let u64_of = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        let u32_of = |b: &[u8]| {
            let mut a = [0u8; 4];
            a.copy_from_slice(b);
            u32::from_le_bytes(a)
        };
        let as_usize =
            |v: u64| usize::try_from(v).map_err(|_| format!("{v} does not fit this host"));
        let kind = take(1)?[0];
        let msg = match kind {
            HELLO => Msg::Hello {
                from: as_usize(u64_of(take(8)?))?,
            },
            OFFER | DONE => {
                let key = Key {
                    label: as_usize(u64_of(take(8)?))?,
                    seq: u64_of(take(8)?),
                    from: as_usize(u64_of(take(8)?))?,
                    to: as_usize(u64_of(take(8)?))?,
                };
                let n = u32_of(take(4)?);
                if kind == DONE {
                    Msg::Done { key, n }
                } else {
                    let handle = IpcHandle::from_bytes(take(IPC_HANDLE_BYTES)?)
                        .map_err(|e| e.to_string())?;
                    let allocation = u64_of(take(8)?);
                    let offset = u64_of(take(8)?);
                    let len = u64_of(take(8)?);
                    Msg::Offer {
                        key,
                        offer: OfferMsg {
                            n,
                            handle,
                            allocation,
                            offset,
                            len,
                        },
                    }
                }
            }
            BYE => Msg::Bye,
            other => return Err(format!("unknown message kind {other}")),
        };
        if at != body.len() {
            return Err(format!(
                "a message of kind {kind} has {} extra bytes",
                body.len() - at
            ));
        }
        Ok(msg)
    }
}

/// How a peer's connection to this rank ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// It said goodbye first (its link was dropped after its runs).
    Finished,
    /// It ended without a goodbye: the peer's process stopped, or the bytes were not ours.
    Lost(String),
}

/// What the reader threads filed.
#[derive(Default)]
pub(super) struct Inbox {
    pub offers: HashMap<Key, OfferMsg>,
    pub dones: HashMap<Key, u32>,
    /// How each ended connection ended, and when that was seen.
    pub ended: HashMap<DeviceId, (Ended, Instant)>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    changed: Condvar,
    stop: AtomicBool,
    /// Incoming connections (shut down when the link goes, ending their readers).
    incoming: Mutex<Vec<TcpStream>>,
    /// Device abort words raised as soon as a peer is lost (the reader that sees the
    /// connection end raises them: no CUDA call, so a host thread blocked in one is no
    /// obstacle).
    words: Mutex<Vec<AbortWord>>,
}

impl Shared {
    /// Whether some peer was lost.
    fn any_lost(g: &Inbox) -> bool {
        g.ended.values().any(|(e, _)| matches!(e, Ended::Lost(_)))
    }

    /// Raises every watched abort word.
    fn raise_words(&self) {
        for w in self.words.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            w.raise();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why a wait in the inbox ended without its message.
pub(super) enum WaitError {
    /// The peer's connection ended (how).
    Ended(Ended),
    /// The deadline passed.
    Timeout,
    /// The caller's abort check fired.
    Aborted(crate::runtime::backend::BackendError),
}

/// A rank's listener, inbox and connections to its peers (see the module docs).
pub(super) struct Net {
    rank: DeviceId,
    port: u16,
    shared: Arc<Shared>,
    outgoing: Mutex<HashMap<DeviceId, TcpStream>>,
}

impl Net {
    /// Listens on a free loopback port and starts accepting peers.
    pub fn start(rank: DeviceId) -> io::Result<Net> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            incoming: Mutex::new(Vec::new()),
            words: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name(format!("meshflow-ipc-accept-{rank}"))
            .spawn(move || accept_loop(listener, s))?;
        Ok(Net {
            rank,
            port,
            shared,
            outgoing: Mutex::new(HashMap::new()),
        })
    }

    /// The loopback port peers connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connects to `peer` listening on `port` (once; later calls return at once).
    pub fn connect(&self, peer: DeviceId, port: u16, timeout: Duration) -> Result<(), String> {
        let mut out = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        if out.contains_key(&peer) {
            return Ok(());
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let conn = TcpStream::connect_timeout(&addr, timeout)
            .and_then(|mut c| {
                c.set_nodelay(true)?;
                c.write_all(&Msg::Hello { from: self.rank }.encode())?;
                Ok(c)
            })
            .map_err(|e| format!("connecting to rank {peer} on port {port}: {e}"))?;
        out.insert(peer, conn);
        Ok(())
    }

    /// Sends `msg` to `peer` (connected before).
    pub fn send(&self, peer: DeviceId, msg: &Msg) -> Result<(), String> {
        let mut out = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        let conn = out
            .get_mut(&peer)
            .ok_or_else(|| format!("rank {} has no connection to rank {peer}", self.rank))?;
        conn.write_all(&msg.encode())
            .map_err(|e| format!("its connection broke: {e}"))
    }

    /// Waits until `take` finds what it looks for in the inbox, watching the connection of
    /// `peer`, `abort` and `deadline`.
    pub fn wait<T>(
        &self,
        peer: DeviceId,
        deadline: Instant,
        abort: &dyn Fn() -> Option<crate::runtime::backend::BackendError>,
        mut take: impl FnMut(&mut Inbox) -> Option<T>,
    ) -> Result<T, WaitError> {
        for _ in 0..SPINS {
            if let Some(v) = take(&mut self.shared.lock()) {
                return Ok(v);
            }
            std::thread::yield_now();
        }
        let mut g = self.shared.lock();
        loop {
            if let Some(v) = take(&mut g) {
                return Ok(v);
            }
            if let Some((end, _)) = g.ended.get(&peer) {
                return Err(WaitError::Ended(end.clone()));
            }
            if let Some(e) = abort() {
                return Err(WaitError::Aborted(e));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitError::Timeout);
            }
            let slice = (deadline - now).min(Duration::from_millis(5));
            g = self
                .shared
                .changed
                .wait_timeout(g, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// What `take` finds in the inbox now, without waiting: `Ok(None)` when nothing yet and
    /// the connection of `peer` is open and `abort` quiet; else as [`Net::wait`]. Every
    /// message of a connection is filed before its end, so an ended connection means the
    /// message will never come.
    pub fn poll<T>(
        &self,
        peer: DeviceId,
        abort: &dyn Fn() -> Option<crate::runtime::backend::BackendError>,
        mut take: impl FnMut(&mut Inbox) -> Option<T>,
    ) -> Result<Option<T>, WaitError> {
        {
            let mut g = self.shared.lock();
            if let Some(v) = take(&mut g) {
                return Ok(Some(v));
            }
            if let Some((end, _)) = g.ended.get(&peer) {
                return Err(WaitError::Ended(end.clone()));
            }
        }
        match abort() {
            Some(e) => Err(WaitError::Aborted(e)),
            None => Ok(None),
        }
    }

    /// Raises `word` as soon as a peer is lost (at once if one is already).
    pub fn watch(&self, word: AbortWord) {
        let lost = Shared::any_lost(&self.shared.lock());
        if lost {
            word.raise();
        }
        self.shared
            .words
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(word);
        // A loss filed between the check and the push raised the others but not this one.
        if !lost && Shared::any_lost(&self.shared.lock()) {
            self.shared.raise_words();
        }
    }

    /// How `peer`'s connection ended, if it did.
    pub fn ended(&self, peer: DeviceId) -> Option<Ended> {
        self.shared.lock().ended.get(&peer).map(|(e, _)| e.clone())
    }

    /// The first peer whose connection ended without a goodbye at least `age` ago, and why.
    pub fn lost(&self, age: Duration) -> Option<(DeviceId, String)> {
        let g = self.shared.lock();
        let mut lost: Vec<(DeviceId, String)> = g
            .ended
            .iter()
            .filter_map(|(&p, (e, at))| match e {
                Ended::Lost(why) if at.elapsed() >= age => Some((p, why.clone())),
                _ => None,
            })
            .collect();
        lost.sort();
        lost.into_iter().next()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let out = std::mem::take(&mut *self.outgoing.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, mut c) in out {
            let _ = c.write_all(&Msg::Bye.encode());
            let _ = c.shutdown(Shutdown::Both);
        }
        let incoming = std::mem::take(
            &mut *self
                .shared
                .incoming
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for c in incoming {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// Accepts peers until the link goes, one reader thread each.
fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((conn, peer)) => {
                let spawned = conn
                    .set_nonblocking(false)
                    .and_then(|()| conn.set_nodelay(true))
                    .and_then(|()| conn.set_read_timeout(Some(READ_SLICE)))
                    .and_then(|()| conn.try_clone())
                    .and_then(|clone| {
                        shared
                            .incoming
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(clone);
                        let s = shared.clone();
                        std::thread::Builder::new()
                            .name("meshflow-ipc-read".into())
                            .spawn(move || read_loop(conn, s))
                            .map(drop)
                    });
                if let Err(e) = spawned {
                    tracing::warn!("CUDA IPC peer link: cannot serve {peer}: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::debug!("CUDA IPC peer link: accept: {e}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// Reads one connection's frames into the inbox until it ends.
fn read_loop(mut conn: TcpStream, shared: Arc<Shared>) {
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let mut from: Option<DeviceId> = None;
    let mut said_bye = false;
    // While polling (non-blocking reads): when the last frame arrived.
    let mut polling: Option<Instant> = None;
    let end = |from: Option<DeviceId>, how: Ended| {
        if let Some(p) = from {
            let lost = matches!(how, Ended::Lost(_));
            let mut g = shared.lock();
            g.ended.entry(p).or_insert((how, Instant::now()));
            shared.changed.notify_all();
            drop(g);
            if lost {
                shared.raise_words();
            }
        }
    };
    loop {
        match conn.read(&mut chunk) {
            Ok(0) => {
                let how = if said_bye {
                    Ended::Finished
                } else {
                    Ended::Lost("its connection closed without a goodbye".into())
                };
                return end(from, how);
            }
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if polling.is_some() || conn.set_nonblocking(true).is_ok() {
                    polling = Some(Instant::now());
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if shared.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(since) = polling {
                    if since.elapsed() >= READ_SPIN && conn.set_nonblocking(false).is_ok() {
                        // Quiet for a while: block again (with the read timeout).
                        polling = None;
                    } else {
                        std::thread::yield_now();
                    }
                }
                continue;
            }
            Err(e) => {
                if shared.stop.load(Ordering::SeqCst) {
                    return;
                }
                let how = if said_bye {
                    Ended::Finished
                } else {
                    Ended::Lost(format!("its connection failed: {e}"))
                };
                return end(from, how);
            }
        }
        // File every whole frame in the buffer.
        loop {
            if buf.len() < 4 {
                break;
            }
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len > MAX_FRAME {
                return end(
                    from,
                    Ended::Lost(format!(
                        "it sent a frame of {len} bytes (not a meshflow peer?)"
                    )),
                );
            }
            if buf.len() < 4 + len {
                break;
            }
            let msg = Msg::decode(&buf[4..4 + len]);
            buf.drain(..4 + len);
            let msg = match msg {
                Ok(m) => m,
                Err(why) => return end(from, Ended::Lost(format!("bad message: {why}"))),
            };
            let mut g = shared.lock();
            match msg {
                Msg::Hello { from: f } => from = Some(f),
                Msg::Offer { key, offer } => {
                    g.offers.insert(key, offer);
                }
                Msg::Done { key, n } => {
                    g.dones.insert(key, n);
                }
                Msg::Bye => said_bye = true,
            }
            shared.changed.notify_all();
        }
    }
}

/// Peers this rank has seen end, for tests.
#[cfg(test)]
pub(super) fn ended_peers(net: &Net) -> std::collections::HashSet<DeviceId> {
    net.shared.lock().ended.keys().copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(label: usize) -> Key {
        Key {
            label,
            seq: 7,
            from: 1,
            to: 0,
        }
    }

    #[test]
    fn messages_round_trip_through_their_frames() {
        let handle = IpcHandle::from_bytes(&[9u8; IPC_HANDLE_BYTES]).unwrap();
        for m in [
            Msg::Hello { from: 3 },
            Msg::Offer {
                key: key(2),
                offer: OfferMsg {
                    n: 5,
                    handle,
                    allocation: 1 << 34,
                    offset: 4096,
                    len: 1 << 33,
                },
            },
            Msg::Done { key: key(4), n: 9 },
            Msg::Bye,
        ] {
            let frame = m.encode();
            let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
            assert_eq!(len, frame.len() - 4);
            assert_eq!(Msg::decode(&frame[4..]).unwrap(), m);
        }
        assert!(Msg::decode(&[]).is_err());
        assert!(Msg::decode(&[99]).is_err());
        let mut long = Msg::Bye.encode();
        long.push(0);
        assert!(Msg::decode(&long[4..]).is_err());
        let short = Msg::Done { key: key(1), n: 1 }.encode();
        assert!(Msg::decode(&short[4..short.len() - 1]).is_err());
    }

    #[test]
    fn offers_arrive_and_a_peer_that_stops_is_reported() {
        let (a, b) = (Net::start(0).unwrap(), Net::start(1).unwrap());
        b.connect(0, a.port(), Duration::from_secs(5)).unwrap();
        let handle = IpcHandle::from_bytes(&[1u8; IPC_HANDLE_BYTES]).unwrap();
        let offer = OfferMsg {
            n: 1,
            handle,
            allocation: 512,
            offset: 0,
            len: 8,
        };
        b.send(
            0,
            &Msg::Offer {
                key: key(0),
                offer: offer.clone(),
            },
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let got = a
            .wait(1, deadline, &|| None, |s| s.offers.remove(&key(0)))
            .ok()
            .unwrap();
        assert_eq!(got, offer);
        // A poll takes what arrived and does not wait for what has not.
        b.send(
            0,
            &Msg::Offer {
                key: key(1),
                offer: offer.clone(),
            },
        )
        .unwrap();
        a.wait(1, deadline, &|| None, |s| s.offers.get(&key(1)).cloned())
            .ok()
            .unwrap();
        let polled = a.poll(1, &|| None, |s| s.offers.remove(&key(1)));
        assert_eq!(polled.ok().flatten(), Some(offer.clone()));
        let nothing = a.poll(1, &|| None, |s| s.offers.remove(&key(1)));
        assert!(matches!(nothing, Ok(None)));
        let stop = || {
            Some(crate::runtime::backend::BackendError::Invalid(
                "stop".into(),
            ))
        };
        let aborted = a.poll(1, &stop, |s| s.offers.remove(&key(1)));
        assert!(matches!(aborted, Err(WaitError::Aborted(_))));
        // Nothing else comes: a short wait times out.
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(matches!(
            a.wait(1, soon, &|| None, |s| s.dones.remove(&key(0))),
            Err(WaitError::Timeout)
        ));
        assert!(a.lost(Duration::ZERO).is_none());
        // A peer that goes away with a goodbye has finished; its later messages never come.
        drop(b);
        let ended = a.wait(1, deadline, &|| None, |s| s.dones.remove(&key(0)));
        assert!(matches!(ended, Err(WaitError::Ended(Ended::Finished))));
        let polled = a.poll(1, &|| None, |s| s.dones.remove(&key(0)));
        assert!(matches!(polled, Err(WaitError::Ended(Ended::Finished))));
        assert!(a.lost(Duration::ZERO).is_none());
        assert!(ended_peers(&a).contains(&1));
        // A connection that ends without a goodbye is a lost peer.
        let c = Net::start(2).unwrap();
        let mut raw = TcpStream::connect(("127.0.0.1", c.port())).unwrap();
        raw.write_all(&Msg::Hello { from: 5 }.encode()).unwrap();
        drop(raw);
        let ended = c.wait(5, deadline, &|| None, |s| s.offers.remove(&key(0)));
        assert!(matches!(ended, Err(WaitError::Ended(Ended::Lost(_)))));
        assert_eq!(c.lost(Duration::ZERO).map(|l| l.0), Some(5));
        assert!(
            c.lost(Duration::from_secs(3600)).is_none(),
            "not lost that long ago"
        );
    }

    #[test]
    fn frames_arrive_while_the_reader_polls_and_after_it_blocks_again() {
        let (a, b) = (Net::start(0).unwrap(), Net::start(1).unwrap());
        b.connect(0, a.port(), Duration::from_secs(5)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        // A burst (the reader polls after the first frame), then frames after quiet periods
        // longer than the polling window (the reader blocked in between).
        for (i, pause) in [0, 0, 0, 2, 0].into_iter().enumerate() {
            std::thread::sleep(READ_SPIN * pause);
            let k = key(i);
            b.send(
                0,
                &Msg::Done {
                    key: k.clone(),
                    n: i as u32,
                },
            )
            .unwrap();
            let got = a.wait(1, deadline, &|| None, |s| s.dones.remove(&k)).ok();
            assert_eq!(got, Some(i as u32), "frame {i}");
        }
        // A peer that stops while the reader polls is still seen to stop.
        let c = Net::start(2).unwrap();
        let mut raw = TcpStream::connect(("127.0.0.1", c.port())).unwrap();
        raw.write_all(&Msg::Hello { from: 6 }.encode()).unwrap();
        raw.write_all(&Msg::Done { key: key(0), n: 1 }.encode())
            .unwrap();
        let got = c
            .wait(6, deadline, &|| None, |s| s.dones.remove(&key(0)))
            .ok();
        assert_eq!(got, Some(1));
        drop(raw);
        let ended = c.wait(6, deadline, &|| None, |s| s.offers.remove(&key(0)));
        assert!(matches!(ended, Err(WaitError::Ended(Ended::Lost(_)))));
    }
}
