//! [`TcpWire`]: the proxy's one-sided writes with immediates over TCP. Works everywhere, so the
//! whole proxy path runs on CI and between processes acting as separate nodes.
//!
//! One connection per pair of ranks (the lower rank connects to the higher one's listener).
//! A write is a frame `op: u8 (1), remote_offset: u64, len: u64, imm: u32, bytes` (little
//! endian); a reader thread per connection copies the bytes into our receive region at
//! `remote_offset` and then reports the immediate, so neither the receiving rank nor its proxy
//! thread takes part in moving the bytes, as with RDMA. A connection that ends or breaks is
//! reported as [`Completion::Lost`].

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Completion, HostRegion, Layout, ProxyError, Regions, SetupStore, Wire};

const OP_WRITE: u8 = 1;
const HELLO_MAGIC: u32 = 0x4D46_5443; // "MFTC"
const FRAME: usize = 1 + 8 + 8 + 4;

/// The proxy's TCP wire of one rank.
#[derive(Debug)]
pub struct TcpWire {
    me: usize,
    peers: Vec<usize>,
    regions: Regions,
    writers: Vec<Mutex<TcpStream>>,
    tx: Mutex<Sender<Completion>>,
    rx: Mutex<Receiver<Completion>>,
    closing: Arc<AtomicBool>,
}

fn io_setup(what: &str, e: io::Error) -> ProxyError {
    ProxyError::Setup(format!("{what}: {e}"))
}

fn hello(rank: usize, ring: usize) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&(rank as u64).to_le_bytes());
    b[12..20].copy_from_slice(&(ring as u64).to_le_bytes());
    b
}

/// Parses a hello: `(rank, ring size)`.
fn parse_hello(b: &[u8; 20]) -> Result<(usize, usize), String> {
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if magic != HELLO_MAGIC {
        return Err(format!("not a meshflow proxy (magic {magic:#010x})"));
    }
    let mut r = [0u8; 8];
    r.copy_from_slice(&b[4..12]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&b[12..20]);
    Ok((
        u64::from_le_bytes(r) as usize,
        u64::from_le_bytes(l) as usize,
    ))
}

impl TcpWire {
    /// Connects `layout.me` to every peer of the layout. The rank listens on `host` (an address
    /// the peers can reach; port chosen by the OS), publishes `host:port` under
    /// `{namespace}/tcp/{rank}`, connects to the higher peers and accepts the lower ones, all
    /// within `timeout`.
    pub fn connect(
        layout: &Layout,
        host: &str,
        store: &dyn SetupStore,
        namespace: &str,
        timeout: Duration,
    ) -> Result<TcpWire, ProxyError> {
        let deadline = Instant::now() + timeout;
        let me = layout.me;
        let region = layout.region_len();
        let ring = layout.ring;
        let listener = TcpListener::bind((host, 0)).map_err(|e| io_setup("bind", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| io_setup("listener address", e))?
            .port();
        store.publish(
            &format!("{namespace}/tcp/{me}"),
            format!("{host}:{port}").as_bytes(),
        )?;
        let n = layout.peers.len();
        let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        for (i, &peer) in layout.peers.iter().enumerate().filter(|(_, &p)| p > me) {
            let left = deadline.saturating_duration_since(Instant::now());
            let addr = store.fetch(&format!("{namespace}/tcp/{peer}"), left)?;
            let addr = String::from_utf8_lossy(&addr).into_owned();
            let mut s = connect_retry(&addr, deadline)
                .map_err(|e| io_setup(&format!("connecting to rank {peer} at {addr}"), e))?;
            s.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))
            .and_then(|()| s.write_all(&hello(me, ring)))
            .map_err(|e| io_setup(&format!("hello to rank {peer}"), e))?;
            let mut b = [0u8; 20];
            s.read_exact(&mut b)
                .map_err(|e| io_setup(&format!("hello from rank {peer}"), e))?;
            let (r, len) = parse_hello(&b).map_err(ProxyError::Setup)?;
            check_peer(peer, r, ring, len)?;
            streams[i] = Some(s);
        }
        let lower = layout.peers.iter().filter(|&&p| p < me).count();
        listener
            .set_nonblocking(true)
            .map_err(|e| io_setup("listener", e))?;
        let mut accepted = 0;
        while accepted < lower {
            match listener.accept() {
                Ok((mut s, from)) => {
                    let mut b = [0u8; 20];
                    let r = s
                        .set_nonblocking(false)
                        .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(10))))
                        .and_then(|()| s.read_exact(&mut b));
                    if let Err(e) = r {
                        tracing::debug!("proxy: ignoring connection from {from}: {e}");
                        continue;
                    }
                    let (r, len) = parse_hello(&b).map_err(ProxyError::Setup)?;
                    let i = layout.index_of(r).filter(|_| r < me).ok_or_else(|| {
                        ProxyError::Setup(format!("rank {r} connected but is not a lower peer"))
                    })?;
                    check_peer(r, r, ring, len)?;
                    if streams[i].is_some() {
                        return Err(ProxyError::Setup(format!("rank {r} connected twice")));
                    }
                    s.write_all(&hello(me, ring))
                        .map_err(|e| io_setup(&format!("hello to rank {r}"), e))?;
                    streams[i] = Some(s);
                    accepted += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = layout
                            .peers
                            .iter()
                            .zip(&streams)
                            .filter(|(&p, s)| p < me && s.is_none())
                            .map(|(&p, _)| p)
                            .collect();
                        return Err(ProxyError::Setup(format!(
                            "ranks {missing:?} did not connect within {timeout:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(io_setup("accept", e)),
            }
        }
        let (tx, rx) = mpsc::channel();
        let regions = Regions::new(region);
        let closing = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::with_capacity(n);
        for (i, s) in streams.into_iter().enumerate() {
            let peer = layout.peers[i];
            let s = s.ok_or_else(|| ProxyError::Setup(format!("no connection to rank {peer}")))?;
            let setup = |e| io_setup(&format!("connection to rank {peer}"), e);
            s.set_nodelay(true).map_err(setup)?;
            s.set_read_timeout(None).map_err(setup)?;
            s.set_write_timeout(Some(Duration::from_secs(60)))
                .map_err(setup)?;
            let reader = s.try_clone().map_err(setup)?;
            let (tx, recv, closing) = (tx.clone(), regions.recv().clone(), closing.clone());
            std::thread::Builder::new()
                .name(format!("meshflow-proxy-tcp-{me}-{peer}"))
                .spawn(move || read_frames(reader, peer, &recv, &tx, &closing))
                .map_err(|e| io_setup("reader thread", e))?;
            writers.push(Mutex::new(s));
        }
        Ok(TcpWire {
            me,
            peers: layout.peers.clone(),
            regions,
            writers,
            tx: Mutex::new(tx),
            rx: Mutex::new(rx),
            closing,
        })
    }
}

fn check_peer(want: usize, got: usize, ring: usize, theirs: usize) -> Result<(), ProxyError> {
    if want != got {
        return Err(ProxyError::Setup(format!(
            "expected rank {want} at its address, found rank {got}"
        )));
    }
    if ring != theirs {
        return Err(ProxyError::Setup(format!(
            "rank {got} has rings of {theirs} bytes, this rank {ring} (MESHFLOW_PROXY_RING differs)"
        )));
    }
    Ok(())
}

fn connect_retry(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let attempt = addr
            .to_socket_addrs()
            .and_then(|mut a| {
                a.next()
                    .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
            })
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
        match attempt {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The reader thread of one connection: lands writes in `recv` and reports their immediates.
fn read_frames(
    mut s: TcpStream,
    peer: usize,
    recv: &HostRegion,
    tx: &Sender<Completion>,
    closing: &AtomicBool,
) {
    let reason = loop {
        let mut f = [0u8; FRAME];
        if let Err(e) = s.read_exact(&mut f) {
            break if e.kind() == io::ErrorKind::UnexpectedEof {
                "the connection was closed (its process exited or was killed)".to_string()
            } else {
                format!("the connection broke: {e}")
            };
        }
        let mut o = [0u8; 8];
        o.copy_from_slice(&f[1..9]);
        let mut l = [0u8; 8];
        l.copy_from_slice(&f[9..17]);
        let (off, len) = (u64::from_le_bytes(o), u64::from_le_bytes(l));
        let imm = u32::from_le_bytes([f[17], f[18], f[19], f[20]]);
        if f[0] != OP_WRITE || off.checked_add(len).is_none_or(|e| e > recv.len() as u64) {
            break format!(
                "protocol error: op {} writing bytes {off}+{len} of a {}-byte region",
                f[0],
                recv.len()
            );
        }
        let mut bytes = vec![0u8; len as usize];
        if let Err(e) = s.read_exact(&mut bytes) {
            break format!("the connection broke inside a write: {e}");
        }
        if let Err(e) = recv.write(off as usize, &bytes) {
            break e.to_string();
        }
        let c = Completion::Received {
            peer,
            imm,
            len: len as usize,
        };
        if tx.send(c).is_err() {
            return;
        }
    };
    if !closing.load(Ordering::Acquire) {
        let _ = tx.send(Completion::Lost { peer, reason });
    }
}

impl Wire for TcpWire {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn regions(&self) -> &Regions {
        &self.regions
    }

    fn post_write(
        &self,
        peer: usize,
        local_offset: usize,
        remote_offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<(), ProxyError> {
        let i = self.peers.binary_search(&peer).map_err(|_| {
            ProxyError::InvalidArgument(format!("rank {peer} is not a peer of rank {}", self.me))
        })?;
        let mut frame = Vec::with_capacity(FRAME + len);
        frame.push(OP_WRITE);
        frame.extend_from_slice(&(remote_offset as u64).to_le_bytes());
        frame.extend_from_slice(&(len as u64).to_le_bytes());
        frame.extend_from_slice(&imm.to_le_bytes());
        self.regions
            .send()
            .read_into(local_offset, len, &mut frame)?;
        let mut w = self.writers[i].lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&frame).map_err(|e| ProxyError::PeerLost {
            peer,
            reason: format!("writing to its connection failed: {e}"),
        })
    }

    fn poll(&self, out: &mut Vec<Completion>, wait: Duration) -> Result<(), ProxyError> {
        let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        let first = if wait.is_zero() {
            rx.try_recv().ok()
        } else {
            // Never disconnected: the wire holds a sender.
            rx.recv_timeout(wait).ok()
        };
        if let Some(c) = first {
            out.push(c);
            out.extend(rx.try_iter());
        }
        Ok(())
    }

    fn wake(&self) {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send(Completion::Wake);
    }

    fn flush(&self, _timeout: Duration) -> Result<(), ProxyError> {
        // `post_write` returns once the kernel holds the bytes: they leave on their own.
        Ok(())
    }
}

impl Drop for TcpWire {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        for w in &self.writers {
            let w = w.lock().unwrap_or_else(|e| e.into_inner());
            // Our end is done writing; the reader threads end when the peers close theirs.
            let _ = w.shutdown(Shutdown::Write);
        }
    }
}
