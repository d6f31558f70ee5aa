//! The [`Wire`] trait (one-sided writes with immediates between the registered [`Regions`] of
//! the ranks), the [`SetupStore`] a wire exchanges its connection info through, and
//! [`MemoryStore`], an in-process store for tests.
//!
//! A wire is not a transport: it is the link the host proxy writes over. The host proxy
//! (with its wire) is what the GPU runtime calls the host-proxy transport.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{HostRegion, ProxyError};

/// Something a wire reports to the proxy thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A peer's one-sided write into our receive region has landed, with its immediate.
    Received {
        /// The writing peer.
        peer: usize,
        /// The immediate.
        imm: u32,
        /// Bytes written.
        len: usize,
    },
    /// One of our writes to `peer` has completed (the source may be reused).
    Sent {
        /// The peer written to.
        peer: usize,
    },
    /// The link to `peer` is gone; no completion of it follows.
    Lost {
        /// The peer.
        peer: usize,
        /// What the wire saw.
        reason: String,
    },
    /// Nothing happened: the poll was woken (new staged work) or timed out.
    Wake,
}

/// The two registered regions of one rank's wire, in host memory: the send region the rank
/// stages into (the source of its writes) and the receive region its peers write into.
#[derive(Debug)]
pub struct Regions {
    send: Arc<HostRegion>,
    recv: Arc<HostRegion>,
}

impl Regions {
    /// Two zeroed regions of `len` bytes each (at least one).
    pub fn new(len: usize) -> Regions {
        Regions {
            send: Arc::new(HostRegion::new(len.max(1))),
            recv: Arc::new(HostRegion::new(len.max(1))),
        }
    }

    /// The send region.
    pub fn send(&self) -> &Arc<HostRegion> {
        &self.send
    }

    /// The receive region.
    pub fn recv(&self) -> &Arc<HostRegion> {
        &self.recv
    }
}

/// A link carrying one-sided writes with 32-bit immediates between the registered regions of
/// the ranks (the send region of the writer, the receive region of the target). Writes to one
/// peer complete in order (RC queue pairs, TCP streams).
pub trait Wire: Send + Sync + fmt::Debug {
    /// The wire's name (`tcp`, `ibverbs`).
    fn name(&self) -> &'static str;
    /// This rank's registered regions.
    fn regions(&self) -> &Regions;
    /// Copies `bytes` into our send region at `offset` (staging).
    fn stage(&self, offset: usize, bytes: &[u8]) -> Result<(), ProxyError> {
        self.regions().send.write(offset, bytes)
    }
    /// Copies bytes of our send region at `offset` into `out`.
    fn read_staged(&self, offset: usize, out: &mut [u8]) -> Result<(), ProxyError> {
        self.regions().send.read(offset, out)
    }
    /// Copies bytes of our receive region at `offset` into `out`.
    fn read_received(&self, offset: usize, out: &mut [u8]) -> Result<(), ProxyError> {
        self.regions().recv.read(offset, out)
    }
    /// Posts a one-sided write of `len` bytes of our send region at `local_offset` into `peer`'s
    /// receive region at `remote_offset`, delivering `imm` to the peer once the bytes are there.
    fn post_write(
        &self,
        peer: usize,
        local_offset: usize,
        remote_offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<(), ProxyError>;
    /// Appends completions to `out`, waiting up to `wait` for the first one (or a wake-up).
    fn poll(&self, out: &mut Vec<Completion>, wait: Duration) -> Result<(), ProxyError>;
    /// Wakes a [`poll`](Self::poll) in progress (new staged work).
    fn wake(&self);
    /// Waits until every posted write has left this rank (the sources may be reused).
    fn flush(&self, timeout: Duration) -> Result<(), ProxyError>;
}

/// A key/value store the ranks exchange connection info through (the runtime's rendezvous).
pub trait SetupStore: Send + Sync {
    /// Sets `key`.
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), ProxyError>;
    /// Gets `key`, waiting up to `timeout` for some rank to publish it.
    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, ProxyError>;
}

/// A [`SetupStore`] shared by threads of one process (tests, single-process runs).
#[derive(Debug, Default)]
pub struct MemoryStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }
}

impl SetupStore for MemoryStore {
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), ProxyError> {
        let mut v = self.values.lock().unwrap_or_else(|e| e.into_inner());
        v.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, ProxyError> {
        let start = Instant::now();
        let mut v = self.values.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(x) = v.get(key) {
                return Ok(x.clone());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(ProxyError::Setup(format!(
                    "key `{key}` was not published within {timeout:?}"
                )));
            }
            v = self
                .changed
                .wait_timeout(v, timeout - waited)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}
