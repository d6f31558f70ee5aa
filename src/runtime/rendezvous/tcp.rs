//! [`TcpRendezvous`]: a key/value store with barriers served by rank 0 over TCP.
//!
//! Wire format (little endian), one request and one response at a time per connection:
//! request `op: u8, key_len: u32, key, payload`, where the payload is `len: u64, bytes` for
//! `SET` and `ABORT`, `timeout_ms: u64` for `GET`, and `parties: u64, timeout_ms: u64` for
//! `BARRIER`, `rank: u64` for `HELLO` and nothing for `GOODBYE`; response `status: u8 (0 ok,
//! 1 timeout, 2 aborted, 3 error, 4 lost), len: u64, bytes` (the value of a `GET`, a message,
//! or for `lost` the lost rank as `u64` followed by how it was seen).
//!
//! A client that says `HELLO` with its rank is watched: when its connection ends without a
//! `GOODBYE` (its process exited or was killed), the server records the rank as lost, and
//! every wait that can no longer complete fails at once with [`RendezvousError::Lost`]. While
//! a watched client waits, the server looks at its connection every [`WATCH_SLICE`], so a
//! client that dies in the middle of a wait is noticed too.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::local::Store;
use super::{Rendezvous, RendezvousError, TorchrunEnv};

const SET: u8 = 1;
const GET: u8 = 2;
const BARRIER: u8 = 3;
const ABORT: u8 = 4;
const HELLO: u8 = 5;
const GOODBYE: u8 = 6;

const OK: u8 = 0;
const TIMEOUT: u8 = 1;
const ABORTED: u8 = 2;
const ERROR: u8 = 3;
const LOST: u8 = 4;

/// How often the server looks at the connection of a watched client that waits.
const WATCH_SLICE: Duration = Duration::from_millis(100);

/// How a watched rank's loss is described when its connection closed without a goodbye.
const CLOSED_WITHOUT_GOODBYE: &str = "its process exited or failed; seen by the rendezvous \
                                      store: its connection closed without a goodbye";

/// Largest key accepted by the server.
const MAX_KEY: u32 = 64 * 1024;
/// Largest value accepted by the server (outputs of a test program travel through it).
const MAX_VALUE: u64 = 4 << 30;

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read, len: u64, limit: u64) -> io::Result<Vec<u8>> {
    if len > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds the limit of {limit}"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn write_response(w: &mut impl Write, status: u8, body: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(9 + body.len());
    msg.push(status);
    msg.extend_from_slice(&(body.len() as u64).to_le_bytes());
    msg.extend_from_slice(body);
    w.write_all(&msg)?;
    w.flush()
}

/// What the server knows of one client connection.
#[derive(Debug, Default)]
struct Client {
    /// The rank it said `HELLO` with (then it is watched).
    rank: Option<usize>,
    /// Whether it said `GOODBYE`.
    left: bool,
}

/// Whether the peer of `conn` closed it (or it broke); data waiting to be read means it is
/// alive.
fn closed(conn: &TcpStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let gone = match conn.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    };
    conn.set_nonblocking(false).is_err() || gone
}

/// Runs the wait `once` (given how long it may wait) for up to `timeout`: in one go for an
/// unwatched client, in slices of [`WATCH_SLICE`] for a watched one, looking at its connection
/// between them; `Err` when that connection closed.
fn wait_watching<T>(
    conn: &TcpStream,
    watched: bool,
    timeout: Duration,
    mut once: impl FnMut(Duration) -> Result<T, RendezvousError>,
) -> io::Result<Result<T, RendezvousError>> {
    if !watched {
        return Ok(once(timeout));
    }
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match once(left.min(WATCH_SLICE)) {
            Err(RendezvousError::Timeout { what, .. }) if left <= WATCH_SLICE => {
                return Ok(Err(RendezvousError::Timeout {
                    what,
                    waited: timeout,
                }))
            }
            Err(RendezvousError::Timeout { .. }) => {}
            done => return Ok(done),
        }
        if closed(conn) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the client closed its connection while it waited",
            ));
        }
    }
}

/// Serves one client connection until it closes; a watched client that leaves without a
/// goodbye is recorded as lost.
fn serve(conn: TcpStream, store: Arc<Store>) -> io::Result<()> {
    let mut client = Client::default();
    let served = serve_requests(conn, &store, &mut client);
    if let (Some(rank), false) = (client.rank, client.left) {
        tracing::warn!(rank, "rendezvous: rank {rank} left without a goodbye");
        store.lose(rank, CLOSED_WITHOUT_GOODBYE);
    }
    served
}

fn serve_requests(mut conn: TcpStream, store: &Store, client: &mut Client) -> io::Result<()> {
    conn.set_nodelay(true)?;
    loop {
        let op = match read_u8(&mut conn) {
            Ok(op) => op,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let key_len = read_u32(&mut conn)?;
        let key = read_bytes(&mut conn, u64::from(key_len), u64::from(MAX_KEY))?;
        let key = String::from_utf8_lossy(&key).into_owned();
        let result = match op {
            SET => {
                let len = read_u64(&mut conn)?;
                let value = read_bytes(&mut conn, len, MAX_VALUE)?;
                store.publish(&key, &value).map(|()| Vec::new())
            }
            GET => {
                let timeout = Duration::from_millis(read_u64(&mut conn)?);
                wait_watching(&conn, client.rank.is_some(), timeout, |t| {
                    store.fetch(&key, t)
                })?
            }
            BARRIER => {
                let parties = read_u64(&mut conn)? as usize;
                let timeout = Duration::from_millis(read_u64(&mut conn)?);
                store.arrive(&key);
                wait_watching(&conn, client.rank.is_some(), timeout, |t| {
                    store.await_barrier(&key, parties, t)
                })?
                .map(|()| Vec::new())
            }
            HELLO => {
                client.rank = Some(read_u64(&mut conn)? as usize);
                Ok(Vec::new())
            }
            GOODBYE => {
                client.left = true;
                Ok(Vec::new())
            }
            ABORT => {
                let len = read_u64(&mut conn)?;
                let reason = read_bytes(&mut conn, len, u64::from(MAX_KEY))?;
                store.abort(&String::from_utf8_lossy(&reason));
                Ok(Vec::new())
            }
            other => {
                write_response(&mut conn, ERROR, format!("unknown op {other}").as_bytes())?;
                return Ok(());
            }
        };
        match result {
            Ok(v) => write_response(&mut conn, OK, &v)?,
            Err(RendezvousError::Timeout { .. }) => write_response(&mut conn, TIMEOUT, &[])?,
            Err(RendezvousError::Aborted(r)) => write_response(&mut conn, ABORTED, r.as_bytes())?,
            Err(RendezvousError::Lost { rank, reason }) => {
                let mut body = (rank as u64).to_le_bytes().to_vec();
                body.extend_from_slice(reason.as_bytes());
                write_response(&mut conn, LOST, &body)?
            }
            Err(e) => write_response(&mut conn, ERROR, e.to_string().as_bytes())?,
        }
    }
}

/// The store server of rank 0: accepts connections until dropped.
#[derive(Debug)]
struct Server {
    stop: Arc<AtomicBool>,
}

impl Server {
    fn start(port: u16) -> io::Result<Server> {
        let listener = TcpListener::bind(("0.0.0.0", port))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let store = Arc::new(Store::default());
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("meshflow-rendezvous".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, peer)) => {
                            let store = store.clone();
                            let spawned = conn.set_nonblocking(false).and_then(|()| {
                                std::thread::Builder::new()
                                    .name("meshflow-rendezvous-conn".into())
                                    .spawn(move || {
                                        if let Err(e) = serve(conn, store) {
                                            tracing::debug!("rendezvous client {peer}: {e}");
                                        }
                                    })
                                    .map(drop)
                            });
                            if let Err(e) = spawned {
                                tracing::warn!("rendezvous: cannot serve {peer}: {e}");
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => {
                            tracing::warn!("rendezvous accept failed: {e}");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })?;
        Ok(Server { stop })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A rendezvous over TCP: rank 0 serves the store on `MASTER_ADDR:MASTER_PORT`, every rank
/// (rank 0 too) talks to it as a client.
#[derive(Debug)]
pub struct TcpRendezvous {
    conn: Mutex<TcpStream>,
    address: String,
    namespace: String,
    /// This client's rank when it is watched (it said `HELLO`; it says `GOODBYE` when dropped).
    watched: Option<usize>,
    _server: Option<Server>,
}

impl TcpRendezvous {
    /// Starts the store (on rank 0) and connects to it, retrying for up to `connect_timeout`
    /// while the store is not up yet. The connection is watched: if this process ends without
    /// dropping the rendezvous (it exited or was killed), the waits of the other ranks that
    /// can no longer complete fail at once naming `env.rank`; if the store goes away, this
    /// rank's waits fail naming rank 0, which serves it.
    pub fn connect(
        env: &TorchrunEnv,
        connect_timeout: Duration,
    ) -> Result<TcpRendezvous, RendezvousError> {
        let mut rdv = TcpRendezvous::connect_unwatched(env, connect_timeout)?;
        rdv.request(
            HELLO,
            "",
            &(env.rank as u64).to_le_bytes(),
            Duration::ZERO,
            "hello",
        )?;
        rdv.watched = Some(env.rank);
        Ok(rdv)
    }

    /// [`connect`](Self::connect) without the watching: for callers whose parties are not
    /// ranks (the node processes of a CPU run, which their supervisor watches instead).
    pub fn connect_unwatched(
        env: &TorchrunEnv,
        connect_timeout: Duration,
    ) -> Result<TcpRendezvous, RendezvousError> {
        let address = format!("{}:{}", env.master_addr, env.master_port);
        let io_err = |e: io::Error| RendezvousError::Io {
            address: address.clone(),
            message: e.to_string(),
        };
        let server = if env.rank == 0 {
            Some(Server::start(env.master_port).map_err(io_err)?)
        } else {
            None
        };
        let target = if env.rank == 0 {
            format!("127.0.0.1:{}", env.master_port)
        } else {
            address.clone()
        };
        let deadline = Instant::now() + connect_timeout;
        let conn = loop {
            let attempt = target
                .to_socket_addrs()
                .and_then(|mut addrs| {
                    addrs.next().ok_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "address resolves to nothing")
                    })
                })
                .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
            match attempt {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("rendezvous: connecting to {target}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    return Err(RendezvousError::Io {
                        address,
                        message: format!("could not connect within {connect_timeout:?}: {e}"),
                    })
                }
            }
        };
        conn.set_nodelay(true).map_err(io_err)?;
        Ok(TcpRendezvous {
            conn: Mutex::new(conn),
            namespace: format!("tcp://{address}/{}", env.world_size),
            address,
            watched: None,
            _server: server,
        })
    }

    fn send_abort(&self, reason: &str) -> Result<(), RendezvousError> {
        let mut payload = (reason.len() as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        self.request(ABORT, "abort", &payload, Duration::from_secs(10), "abort")
            .map(drop)
    }

    fn request(
        &self,
        op: u8,
        key: &str,
        payload: &[u8],
        wait: Duration,
        what: &str,
    ) -> Result<Vec<u8>, RendezvousError> {
        let io_err = |e: io::Error| match self.watched {
            // The store closed the connection: rank 0, which serves it, is gone.
            Some(rank) if rank != 0 && store_gone(&e) => RendezvousError::Lost {
                rank: 0,
                reason: format!(
                    "its process exited or failed; seen by rank {rank}: the rendezvous store \
                     it serves at {} closed the connection during {what}",
                    self.address
                ),
            },
            _ => RendezvousError::Io {
                address: self.address.clone(),
                message: format!("{what}: {e}"),
            },
        };
        let mut msg = Vec::with_capacity(5 + key.len() + payload.len());
        msg.push(op);
        msg.extend_from_slice(&(key.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(payload);
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.set_read_timeout(Some(wait + Duration::from_secs(10)))
            .map_err(io_err)?;
        conn.write_all(&msg).map_err(io_err)?;
        conn.flush().map_err(io_err)?;
        let status = read_u8(&mut *conn).map_err(io_err)?;
        let len = read_u64(&mut *conn).map_err(io_err)?;
        let body = read_bytes(&mut *conn, len, MAX_VALUE).map_err(io_err)?;
        match status {
            OK => Ok(body),
            TIMEOUT => Err(RendezvousError::Timeout {
                what: what.to_owned(),
                waited: wait,
            }),
            ABORTED => Err(RendezvousError::Aborted(
                String::from_utf8_lossy(&body).into_owned(),
            )),
            LOST if body.len() >= 8 => {
                let (rank, reason) = body.split_at(8);
                let mut b = [0u8; 8];
                b.copy_from_slice(rank);
                Err(RendezvousError::Lost {
                    rank: u64::from_le_bytes(b) as usize,
                    reason: String::from_utf8_lossy(reason).into_owned(),
                })
            }
            _ => Err(RendezvousError::Io {
                address: self.address.clone(),
                message: format!("{what}: {}", String::from_utf8_lossy(&body)),
            }),
        }
    }
}

/// Whether `e` says that the other end closed or reset the connection.
fn store_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

impl Drop for TcpRendezvous {
    /// A watched client says goodbye, so that the server does not take its leaving for a loss.
    fn drop(&mut self) {
        if self.watched.is_some() {
            if let Err(e) = self.request(GOODBYE, "", &[], Duration::ZERO, "goodbye") {
                tracing::debug!("rendezvous goodbye: {e}");
            }
        }
    }
}

fn millis(d: Duration) -> [u8; 8] {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .to_le_bytes()
}

impl Rendezvous for TcpRendezvous {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let mut payload = (value.len() as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(value);
        self.request(
            SET,
            key,
            &payload,
            Duration::from_secs(30),
            &format!("key `{key}`"),
        )
        .map(drop)
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.request(GET, key, &millis(timeout), timeout, &format!("key `{key}`"))
    }

    fn barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        let mut payload = (parties as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(&millis(timeout));
        let what = format!("barrier `{name}` ({parties} parties)");
        self.request(BARRIER, name, &payload, timeout, &what)
            .map(drop)
    }

    fn abort(&self, reason: &str) {
        if let Err(e) = self.send_abort(reason) {
            tracing::warn!("could not abort the rendezvous: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, port: u16) -> TorchrunEnv {
        TorchrunEnv {
            rank,
            world_size: 3,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    #[test]
    fn three_ranks_exchange_values_and_meet() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let t = Duration::from_secs(10);
        let r0 = TcpRendezvous::connect(&env(0, port), t).unwrap();
        std::thread::scope(|s| {
            for rank in 1..3 {
                s.spawn(move || {
                    let r = TcpRendezvous::connect(&env(rank, port), t).unwrap();
                    r.publish(&format!("v{rank}"), &[rank as u8; 3]).unwrap();
                    assert_eq!(r.fetch("root", t).unwrap(), b"hello");
                    r.barrier("end", 3, t).unwrap();
                });
            }
            r0.publish("root", b"hello").unwrap();
            assert_eq!(r0.fetch("v1", t).unwrap(), vec![1; 3]);
            assert_eq!(r0.fetch("v2", t).unwrap(), vec![2; 3]);
            r0.barrier("end", 3, t).unwrap();
        });
        let err = r0.fetch("never", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
        r0.abort("rank 2 failed");
        let err = r0.barrier("after", 2, t).unwrap_err();
        assert_eq!(err, RendezvousError::Aborted("rank 2 failed".into()));
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap()
    }

    /// Closes `r`'s connection without the goodbye of its drop, as a process that exits does.
    fn vanish(r: TcpRendezvous) {
        let conn = r.conn.lock().unwrap().try_clone().unwrap();
        conn.shutdown(std::net::Shutdown::Both).unwrap();
        std::mem::forget(r);
    }

    // The waits below are given a minute: they end long before it, or the test hangs.
    const LONG: Duration = Duration::from_secs(60);

    #[test]
    fn a_rank_that_leaves_without_a_goodbye_fails_the_waits_it_would_end() {
        let port = free_port();
        let r0 = TcpRendezvous::connect(&env(0, port), LONG).unwrap();
        let r1 = TcpRendezvous::connect(&env(1, port), LONG).unwrap();
        r1.publish("from1", b"x").unwrap();
        r1.barrier("met", 1, LONG).unwrap();
        vanish(r1);
        let err = r0.barrier("start", 2, LONG).unwrap_err();
        let RendezvousError::Lost { rank: 1, reason } = &err else {
            panic!("{err}");
        };
        assert!(reason.contains("without a goodbye"), "{err}");
        // What it left behind is still there; only waits that cannot complete fail.
        assert_eq!(r0.fetch("from1", LONG).unwrap(), b"x");
        r0.barrier("met", 2, LONG).unwrap();
        let err = r0.fetch("never", LONG).unwrap_err();
        assert!(
            matches!(err, RendezvousError::Lost { rank: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_watched_wait_ends_when_its_client_closes_the_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, _) = listener.accept().unwrap();
        drop(client);
        let store = Store::default();
        let waited = wait_watching(&server_side, true, LONG, |t| store.fetch("never", t));
        assert!(waited.is_err(), "{waited:?}");
    }

    #[test]
    fn a_rank_that_says_goodbye_is_not_lost() {
        let port = free_port();
        let r0 = TcpRendezvous::connect(&env(0, port), LONG).unwrap();
        let r1 = TcpRendezvous::connect(&env(1, port), LONG).unwrap();
        drop(r1);
        let err = r0.fetch("never", Duration::from_millis(300)).unwrap_err();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
    }

    #[test]
    fn a_rank_whose_store_went_away_names_rank_0() {
        // A store that answers the hello, then goes away as rank 0's process would.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            assert_eq!(read_u8(&mut conn).unwrap(), HELLO);
            let key_len = read_u32(&mut conn).unwrap();
            read_bytes(&mut conn, u64::from(key_len), 0).unwrap();
            assert_eq!(read_u64(&mut conn).unwrap(), 1);
            write_response(&mut conn, OK, &[]).unwrap();
        });
        let r1 = TcpRendezvous::connect(&env(1, port), LONG).unwrap();
        server.join().unwrap();
        let err = r1.barrier("start", 2, LONG).unwrap_err();
        let RendezvousError::Lost { rank: 0, reason } = &err else {
            panic!("{err}");
        };
        assert!(reason.contains("closed the connection"), "{err}");
    }
}
