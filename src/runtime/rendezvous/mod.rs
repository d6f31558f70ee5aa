//! Rendezvous: how the ranks of a run exchange small values (NCCL unique ids, outputs) and meet
//! at barriers before they can talk over NCCL.
//!
//! - [`LocalRendezvous`]: ranks are threads of one process (one thread per GPU).
//! - [`TcpRendezvous`]: ranks are processes, possibly on several hosts; rank 0 serves a
//!   key/value store on `MASTER_ADDR:MASTER_PORT` and every rank (rank 0 included) is a client.
//! - [`TorchrunEnv`]: the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT`) that say which rank a process is and where the store lives.
//!
//! Every blocking operation takes a timeout, so a rank that never arrives is reported as an
//! error naming the key, never a hang. A rank whose process dies is noticed sooner: its
//! connection to the TCP store closes without a goodbye, and every wait that can no longer
//! complete fails at once with [`RendezvousError::Lost`] naming it.

mod env;
mod local;
mod tcp;
mod wire;

use std::fmt;
use std::time::Duration;

pub use env::TorchrunEnv;
pub use local::LocalRendezvous;
pub use tcp::TcpRendezvous;
pub use wire::{decode_tensors, encode_tensors, WireError};

/// Why a rendezvous operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// A value or a barrier did not complete in time.
    #[error("rendezvous timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// The key or barrier waited for.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// The store could not be reached or the connection broke.
    #[error("rendezvous store at {address}: {message}")]
    Io {
        /// `host:port` of the store.
        address: String,
        /// The OS error or protocol problem.
        message: String,
    },
    /// A torchrun variable is missing or malformed.
    #[error("environment variable {name}: {message}")]
    Env {
        /// The variable.
        name: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The rendezvous was aborted because a rank failed.
    #[error("rendezvous aborted: {0}")]
    Aborted(String),
    /// A rank is gone: its connection to the store ended without a goodbye (its process
    /// exited or was killed), or the store itself went away with the rank serving it. Only a
    /// wait that cannot complete any more fails with it.
    #[error("rank {rank} stopped ({reason})")]
    Lost {
        /// The rank that is gone.
        rank: usize,
        /// How it was noticed.
        reason: String,
    },
}

/// A key/value store with barriers shared by the ranks of one run.
pub trait Rendezvous: Send + Sync + fmt::Debug {
    /// A name that identifies the store (used to key caches of objects created through it).
    fn namespace(&self) -> &str;
    /// Sets `key` to `value` (a later publish of the same key replaces it).
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError>;
    /// Returns the value of `key`, waiting up to `timeout` for some rank to publish it.
    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError>;
    /// Waits until `parties` callers (this one included) have reached barrier `name`. Each
    /// barrier name is used once.
    fn barrier(&self, name: &str, parties: usize, timeout: Duration)
        -> Result<(), RendezvousError>;
    /// A [`barrier`](Self::barrier) whose parties leave as close together in time as the store
    /// can make them: the start of a timed run, where a rank that starts its device work late
    /// skews every phase that waits for peers (see `docs/architecture.md`, "Timed runs").
    /// The default is [`barrier`](Self::barrier); the in-process store spins briefly instead
    /// of sleeping, so its waiters leave within about a microsecond of the last arrival.
    fn timing_barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.barrier(name, parties, timeout)
    }
    /// Fails every current and future wait of every rank with [`RendezvousError::Aborted`]
    /// (best effort: a store that cannot be reached is only logged).
    fn abort(&self, reason: &str);

    /// Whether the ranks meeting here may live in several processes (the default). A store
    /// only threads of one process can share says `false`: its ranks then never look for
    /// peers in other processes (CUDA IPC).
    fn spans_processes(&self) -> bool {
        true
    }
}
