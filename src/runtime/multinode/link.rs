//! [`ProxyLink`]: the CPU fabric's [`RemoteLink`] over the host proxies of one node's ranks.
//!
//! A message from local rank `a` to remote rank `b` under fabric key `(a, b, team, seq)` is sent
//! by `a`'s proxy to `b` under tag `(team, seq)`: staged, written one-sidedly into `b`'s receive
//! ring with an immediate, counted and reassembled by `b`'s proxy, which raises the flag `b`
//! waits on. The CPU semantics (keys, team sequence numbers) are unchanged.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use meshflow_ir::DeviceId;
use meshflow_kernels::proxy::{Proxy, ProxyError, SetupStore, Topology};

use super::codec::{decode_payload, encode_payload};
use crate::runtime::backend::BackendError;
use crate::runtime::cpu::fabric::{Failure, MailKey, RemoteLink};
use crate::runtime::cpu::Payload;
use crate::runtime::rendezvous::{Rendezvous, RendezvousError};

/// The remote side of one node's fabric: the proxies of its ranks.
#[derive(Debug)]
pub struct ProxyLink {
    topology: Topology,
    node: usize,
    proxies: BTreeMap<DeviceId, Proxy>,
    send_timeout: Duration,
}

impl ProxyLink {
    /// The link of `node` with the proxies of its ranks (ranks with no remote peer have none).
    /// A sender waits at most `send_timeout` for ring space.
    pub fn new(
        topology: Topology,
        node: usize,
        proxies: BTreeMap<DeviceId, Proxy>,
        send_timeout: Duration,
    ) -> ProxyLink {
        ProxyLink {
            topology,
            node,
            proxies,
            send_timeout,
        }
    }

    /// The proxies, by rank.
    pub fn proxies(&self) -> &BTreeMap<DeviceId, Proxy> {
        &self.proxies
    }

    fn proxy(&self, rank: DeviceId) -> Result<&Proxy, BackendError> {
        self.proxies.get(&rank).ok_or_else(|| {
            BackendError::Invalid(format!(
                "rank {rank} has no proxy on node {} (it is not a rank of this node)",
                self.node
            ))
        })
    }
}

/// A proxy error as the backend error the evaluator reports; `what` names the communication.
fn backend_error(e: ProxyError, what: &str, topology: &Topology) -> BackendError {
    match e {
        ProxyError::Timeout {
            peer,
            waited,
            what: w,
        } => BackendError::Timeout {
            peer,
            waited,
            what: format!("{what} (through the proxy: {w})"),
        },
        ProxyError::PeerLost { peer, reason } => BackendError::Aborted {
            failed_rank: peer,
            reason: lost(peer, &reason, topology),
        },
        ProxyError::Aborted { rank, reason } => BackendError::Aborted {
            failed_rank: rank,
            reason,
        },
        other => BackendError::Invalid(format!("{what}: proxy: {other}")),
    }
}

fn lost(peer: DeviceId, reason: &str, topology: &Topology) -> String {
    match topology.node_of(peer) {
        Some(n) => format!("rank {peer} (node {n}) was lost: {reason}"),
        None => format!("rank {peer} was lost: {reason}"),
    }
}

fn failure_of(e: ProxyError, me: DeviceId, topology: &Topology) -> Failure {
    match e {
        ProxyError::PeerLost { peer, reason } => Failure {
            rank: peer,
            reason: lost(peer, &reason, topology),
        },
        ProxyError::Aborted { rank, reason } => Failure { rank, reason },
        other => Failure {
            rank: other.peer().unwrap_or(me),
            reason: other.to_string(),
        },
    }
}

impl ProxyLink {
    /// A failed node sends a failure notice on one connection and then closes all of them, and
    /// connections are not ordered with each other: a connection may close here before the
    /// notice has arrived on another. When a peer is lost, wait briefly for a notice and
    /// report it instead, so the error names the rank that failed and why.
    fn prefer_notice(&self, e: ProxyError) -> ProxyError {
        if !matches!(e, ProxyError::PeerLost { .. }) {
            return e;
        }
        let deadline = std::time::Instant::now() + NOTICE_GRACE;
        loop {
            let notice = self.proxies.values().find_map(|p| match p.failure() {
                Some(n @ ProxyError::Aborted { .. }) => Some(n),
                _ => None,
            });
            if let Some(n) = notice {
                return n;
            }
            if std::time::Instant::now() >= deadline {
                return e;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// How long a lost peer's error waits for that node's failure notice (generous: on a loaded
/// machine the notice can arrive well after the closed connection).
const NOTICE_GRACE: Duration = Duration::from_secs(2);

impl RemoteLink for ProxyLink {
    fn is_remote(&self, rank: DeviceId) -> bool {
        self.topology.node_of(rank).is_some_and(|n| n != self.node)
    }

    fn send(&self, key: MailKey, payload: Payload) -> Result<(), BackendError> {
        let bytes = encode_payload(&payload);
        self.proxy(key.0)?
            .send(key.1, (key.2, key.3), &bytes, self.send_timeout)
            .map_err(|e| {
                let e = self.prefer_notice(e);
                backend_error(e, &format!("sending to rank {}", key.1), &self.topology)
            })
    }

    fn recv(&self, key: MailKey, timeout: Duration, what: &str) -> Result<Payload, BackendError> {
        let bytes = self
            .proxy(key.1)?
            .recv(key.0, (key.2, key.3), timeout)
            .map_err(|e| backend_error(self.prefer_notice(e), what, &self.topology))?;
        decode_payload(&bytes).map_err(|e| {
            BackendError::Invalid(format!(
                "{what}: malformed message from rank {}: {e}",
                key.0
            ))
        })
    }

    fn fail(&self, rank: DeviceId, reason: &str) {
        let mut notified = false;
        for p in self.proxies.values() {
            if notified {
                p.abort(rank, reason);
            } else {
                // One proxy reaches every remote rank.
                p.notify_failure(rank, reason);
                notified = true;
            }
        }
    }

    fn failure(&self) -> Option<Failure> {
        // A failure notice (naming the rank that failed and why) beats a lost connection.
        let all: Vec<(DeviceId, ProxyError)> = self
            .proxies
            .iter()
            .filter_map(|(&r, p)| p.failure().map(|e| (r, e)))
            .collect();
        let pick = all
            .iter()
            .position(|(_, e)| matches!(e, ProxyError::Aborted { .. }))
            .or(if all.is_empty() { None } else { Some(0) })?;
        let (r, e) = all.into_iter().nth(pick)?;
        Some(failure_of(e, r, &self.topology))
    }
}

/// A [`Rendezvous`] as the proxy's [`SetupStore`].
#[derive(Debug)]
pub struct RendezvousStore(pub Arc<dyn Rendezvous>);

fn setup_error(e: RendezvousError) -> ProxyError {
    ProxyError::Setup(e.to_string())
}

impl SetupStore for RendezvousStore {
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), ProxyError> {
        self.0.publish(key, value).map_err(setup_error)
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, ProxyError> {
        self.0.fetch(key, timeout).map_err(setup_error)
    }
}
