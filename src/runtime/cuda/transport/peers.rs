//! [`PeerLink`]: how the ranks of a team reach each other's GPU memory, the one interface the
//! copy-engine and NVLink MoE transports use. Two implementations:
//!
//! - [`HubLink`](super::hub::HubLink): ranks that are threads of one process meet in the
//!   launch's [`PeerHub`](super::PeerHub) and hand each other buffers and CUDA events;
//! - [`IpcLink`](super::ipc::IpcLink): ranks in separate processes of one host share memory
//!   over CUDA IPC (handles exchanged at the rendezvous), order their streams with signal words
//!   in each other's memory, and send offers and completions over TCP between them.
//!
//! A copy-engine transfer (one instance of a labelled communication between two ranks) goes:
//! the sender [`offer`](PeerLink::offer)s a region; the receiver
//! [`take`](PeerLink::take)s it (its stream then waits until the data is ready; with
//! [`try_take`](PeerLink::try_take) only if the offer is there already), copies it, and
//! reports [`read_done`](PeerLink::read_done) once its stream gets past the copy; the sender
//! collects [`reads_done`](PeerLink::reads_done), events on its own GPU that later writes of the
//! sent memory wait for. Every host wait watches the run's abort signal and the timeout, and
//! every device wait is for work a peer has already enqueued (so a host call that synchronizes
//! the context can never wait for a later host call).

use std::time::Duration;

use meshflow_ir::DeviceId;
use meshflow_kernels::moe::{MoeShape, MoeWire, NvlinkMoe};
use meshflow_kernels::{DeviceBuffer, Event, Stream};

use crate::runtime::backend::{BackendError, TeamInfo};
use crate::runtime::cuda::core::DeviceCore;

/// One instance of a labelled transfer between two ranks: what an offer and its completion
/// are filed under.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// The communication label.
    pub label: usize,
    /// The instance of the label (counted by every member of its team alike).
    pub seq: u64,
    /// The sender.
    pub from: DeviceId,
    /// The receiver.
    pub to: DeviceId,
}

/// Host time a rank's posting thread spent waiting for its peers in copy-engine transfers: the
/// waits for a peer's offer ([`PeerLink::take`]; a [`PeerLink::try_take`] that found it counts
/// as a wait of no time) and for the receivers' reports of their reads
/// ([`PeerLink::reads_done`]). A deferred pull's wait is counted where it is finished
/// (`deferred.rs`). A diagnostic, logged per run (target `meshflow::peer_waits`): the device
/// idles while a wait delays the launch of work it has nothing else to do before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PeerWaits {
    /// Waits for offers.
    pub offers: u64,
    /// Their total time.
    pub offers_time: Duration,
    /// Waits for completions (one per receiver).
    pub completions: u64,
    /// Their total time.
    pub completions_time: Duration,
    /// The longest single wait.
    pub longest: Duration,
}

impl PeerWaits {
    /// Counts a wait for an offer that took `d`.
    pub fn offer(&mut self, d: Duration) {
        self.offers += 1;
        self.offers_time += d;
        self.longest = self.longest.max(d);
    }

    /// Counts a wait for a completion that took `d`.
    pub fn completion(&mut self, d: Duration) {
        self.completions += 1;
        self.completions_time += d;
        self.longest = self.longest.max(d);
    }
}

/// Whether a team's ranks reach each other's memory: `Ok`, or why not (the same on every
/// member of the team).
pub(crate) type Access = Result<(), String>;

/// How the ranks of a team reach each other's GPU memory (see the module docs).
pub(crate) trait PeerLink: Send + Sync {
    /// How the ranks meet, for messages (`in-process` or `CUDA IPC`).
    fn name(&self) -> &'static str;

    /// For each team (its members, global ranks in team order; this rank is one of them):
    /// whether its GPUs reach each other's memory. Decided once per team, identically on every
    /// member (every member of a team calls this for it, in any order of teams).
    fn decide(&self, core: &DeviceCore, teams: &[&[DeviceId]])
        -> Result<Vec<Access>, BackendError>;

    /// Makes copy-engine transfers between this rank and the other `members` possible (a team
    /// [`decide`](Self::decide) accepted; called once per team the copy engine carries).
    fn prepare_copies(&self, core: &DeviceCore, members: &[DeviceId]) -> Result<(), BackendError>;

    /// The region to offer for `src`: `src` itself, or, when peers cannot read it where it is,
    /// a copy of it in a temporary of the core (enqueued on the current stream and left in
    /// `core.scratch`, so that the caller retires it after the peers' reads).
    fn shareable(
        &self,
        core: &mut DeviceCore,
        src: DeviceBuffer,
    ) -> Result<DeviceBuffer, BackendError>;

    /// Offers `src` (from [`shareable`](Self::shareable)) for transfer `key` (this rank is
    /// `key.from`), its data ready at the current end of the current stream.
    fn offer(&self, core: &DeviceCore, key: &Key, src: &DeviceBuffer) -> Result<(), BackendError>;

    /// Takes the offer of `key` (this rank is `key.to`; the host waits for the sender's post)
    /// and makes `stream` wait until its data is ready; returns the offered region, readable
    /// from this GPU. `what` names the communication in errors.
    fn take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        what: &str,
    ) -> Result<DeviceBuffer, BackendError>;

    /// [`take`](Self::take) without waiting: `Ok(None)` (and nothing done) when the sender's
    /// offer has not arrived yet; the errors of `take` when it can tell already that the offer
    /// will never come (a lost or finished peer, an aborted run).
    fn try_take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        what: &str,
    ) -> Result<Option<DeviceBuffer>, BackendError>;

    /// Tells the sender of `key` that this rank is done reading its region once `stream`
    /// (which copied it) gets to this point.
    fn read_done(&self, core: &DeviceCore, key: &Key, stream: &Stream) -> Result<(), BackendError>;

    /// Waits (host) until the receivers of `keys` (transfers this rank offered) have posted
    /// their reads; returns events of this GPU that complete once those reads have, and makes
    /// the core's peer-read stream wait for them.
    fn reads_done(
        &self,
        core: &DeviceCore,
        keys: &[Key],
        what: &str,
    ) -> Result<Vec<Event>, BackendError>;

    /// This rank's NVLink MoE engine of `team` for `shape` and `wire`, connected to the other
    /// members' (every member asks for it at the same point of its program).
    fn nvlink_engine(
        &self,
        core: &DeviceCore,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<NvlinkMoe, BackendError>;

    /// A peer known to be gone for at least `age`, as the error to report. Polled while the
    /// host waits for the device with a grace period (a peer that finished its part and whose
    /// process left early is no failure unless this rank's device still waits for it), and
    /// asked without one to name the cause of an error.
    fn failure(&self, age: Duration) -> Option<BackendError> {
        let _ = age;
        None
    }

    /// After a failure: lets device work waiting for peers that will never signal go on (its
    /// results are garbage), so that the device drains.
    fn abandon(&self) {}

    /// The host waits for peers counted since the last call (and starts counting afresh).
    fn drain_waits(&self) -> PeerWaits {
        PeerWaits::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_add_up_and_keep_the_longest() {
        let mut w = PeerWaits::default();
        w.offer(Duration::from_micros(30));
        w.offer(Duration::from_micros(5));
        w.completion(Duration::from_micros(12));
        assert_eq!((w.offers, w.completions), (2, 1));
        assert_eq!(w.offers_time, Duration::from_micros(35));
        assert_eq!(w.completions_time, Duration::from_micros(12));
        assert_eq!(w.longest, Duration::from_micros(30));
    }
}
