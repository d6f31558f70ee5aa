//! [`TcpRendezvous`]: a key/value store with barriers served by rank 0 over TCP.
//!
//! Wire format (little endian), one request and one response at a time per connection:
//! request `op: u8, key_len: u32, key, payload`, where the payload is `len: u64, bytes` for
//! `SET` and `ABORT`, `timeout_ms: u64` for `GET`, and `parties: u64, timeout_ms: u64` for
//! `BARRIER`; response `status: u8 (0 ok, 1 timeout, 2 aborted, 3 error), len: u64, bytes`
//! (the value of a `GET`, or a message).

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

const OK: u8 = 0;
const TIMEOUT: u8 = 1;
const ABORTED: u8 = 2;
const ERROR: u8 = 3;

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

/// Serves one client connection until it closes.
fn serve(mut conn: TcpStream, store: Arc<Store>) -> io::Result<()> {
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
                store.fetch(&key, timeout)
            }
            BARRIER => {
                let parties = read_u64(&mut conn)? as usize;
                let timeout = Duration::from_millis(read_u64(&mut conn)?);
                store.barrier(&key, parties, timeout).map(|()| Vec::new())
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
    _server: Option<Server>,
}

impl TcpRendezvous {
    /// Starts the store (on rank 0) and connects to it, retrying for up to `connect_timeout`
    /// while the store is not up yet.
    pub fn connect(
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
        let io_err = |e: io::Error| RendezvousError::Io {
            address: self.address.clone(),
            message: format!("{what}: {e}"),
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
            _ => Err(RendezvousError::Io {
                address: self.address.clone(),
                message: format!("{what}: {}", String::from_utf8_lossy(&body)),
            }),
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
}
