//! [`ProxyError`]: what can go wrong in the host proxy and its wires.

use std::time::Duration;

/// Why a proxy operation failed. Every failure a peer can cause (a lost connection, a malformed
/// write, a missing device) is a value of this type, never a panic.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The connection to a peer broke (its process exited or was killed, or the link failed).
    #[error("lost rank {peer}: {reason}")]
    PeerLost {
        /// The peer rank.
        peer: usize,
        /// What the wire saw (end of stream, reset, failed work completion).
        reason: String,
    },
    /// A message or send credit did not arrive in time.
    #[error("timed out after {waited:?} waiting for rank {peer} ({what})")]
    Timeout {
        /// The peer waited for.
        peer: usize,
        /// How long.
        waited: Duration,
        /// What was expected.
        what: String,
    },
    /// The proxy was aborted because a rank failed (locally or on another node).
    #[error("aborted because rank {rank} failed: {reason}")]
    Aborted {
        /// The rank that failed.
        rank: usize,
        /// Its error.
        reason: String,
    },
    /// A peer broke the protocol (a write outside the receive region, a bad header).
    #[error("protocol error with rank {peer}: {message}")]
    Protocol {
        /// The peer.
        peer: usize,
        /// What was wrong.
        message: String,
    },
    /// Setting up the wire failed (address exchange, connection, handshake).
    #[error("proxy setup: {0}")]
    Setup(String),
    /// No RDMA device can be used (no kernel support, no device, device not found).
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// An ibverbs call failed.
    #[error("ibverbs call {call} failed: {message}")]
    Verbs {
        /// The verb (e.g. `ibv_create_qp`).
        call: &'static str,
        /// The OS error or work-completion status.
        message: String,
    },
    /// The arguments do not fit together (unknown peer, sizes, the proxy has stopped).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ProxyError {
    /// The peer this error blames, if it blames one (lost, timed out, protocol, aborted by).
    pub fn peer(&self) -> Option<usize> {
        match self {
            ProxyError::PeerLost { peer, .. }
            | ProxyError::Timeout { peer, .. }
            | ProxyError::Protocol { peer, .. } => Some(*peer),
            ProxyError::Aborted { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}
