//! [`PeerHub`]: the meeting point of the in-process ranks of one launch (one thread per GPU).
//! It knows which GPU each rank runs on, decides once per team whether its GPUs reach each
//! other's memory (so that every member selects the same transport), carries the offers and
//! completions of copy-engine transfers, and hands out the NVLink MoE engines of a team (made
//! together by the first member that needs them).
//!
//! Every host wait on the hub watches the run's abort signal and the timeout.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::moe::{MoeShape, NvlinkMoe};
use meshflow_kernels::{Device, DeviceBuffer, Event};

use crate::runtime::backend::BackendError;

/// What one offer/done slot of the hub is for: an instance of a labelled transfer between two
/// ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub label: usize,
    pub seq: u64,
    pub from: DeviceId,
    pub to: DeviceId,
}

/// A sender's data, ready once `ready` has completed.
pub(super) struct Offer {
    pub src: DeviceBuffer,
    pub ready: Event,
}

/// The NVLink MoE engines of one team and shape: made by the first member, taken by each.
struct Engines {
    members: Vec<DeviceId>,
    shape: MoeShape,
    ranks: Vec<Option<NvlinkMoe>>,
}

#[derive(Default)]
pub(super) struct HubState {
    devices: HashMap<DeviceId, Device>,
    pub offers: HashMap<Key, Offer>,
    pub dones: HashMap<Key, Event>,
    /// Per team (members): whether every pair of its GPUs has peer access, decided once.
    decisions: HashMap<Vec<DeviceId>, bool>,
    engines: Vec<Engines>,
}

/// The meeting point of the in-process ranks of one launch (see the module docs).
#[derive(Default)]
pub struct PeerHub {
    state: Mutex<HubState>,
    changed: Condvar,
}

impl std::fmt::Debug for PeerHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("PeerHub")
            .field("ranks", &s.devices.len())
            .field("offers", &s.offers.len())
            .field("dones", &s.dones.len())
            .finish()
    }
}

/// Host waits on the hub spin this many times (yielding the thread) before sleeping.
const SPINS: usize = 2000;

impl PeerHub {
    /// An empty hub for one launch.
    pub fn new() -> Arc<PeerHub> {
        Arc::new(PeerHub::default())
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `rank` runs on `device`.
    pub(crate) fn register(&self, rank: DeviceId, device: &Device) {
        self.lock().devices.insert(rank, device.clone());
        self.changed.notify_all();
    }

    /// Waits (host) until `pred` returns `Some`, re-checking on every hub change and every
    /// 5 ms (for aborts), until `deadline`. `Err(None)`: the deadline passed.
    pub(super) fn wait_for<T>(
        &self,
        deadline: Instant,
        abort: &dyn Fn() -> Option<BackendError>,
        mut pred: impl FnMut(&mut HubState) -> Option<T>,
    ) -> Result<T, Option<BackendError>> {
        // Peers usually post within microseconds: spin (yielding) before sleeping.
        for _ in 0..SPINS {
            if let Some(v) = pred(&mut self.lock()) {
                return Ok(v);
            }
            std::thread::yield_now();
        }
        let mut g = self.lock();
        loop {
            if let Some(v) = pred(&mut g) {
                return Ok(v);
            }
            if let Some(e) = abort() {
                return Err(Some(e));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(None);
            }
            let slice = (deadline - now).min(Duration::from_millis(5));
            g = self
                .changed
                .wait_timeout(g, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub(super) fn put_offer(&self, key: Key, offer: Offer) {
        self.lock().offers.insert(key, offer);
        self.changed.notify_all();
    }

    pub(super) fn put_done(&self, key: Key, done: Event) {
        self.lock().dones.insert(key, done);
        self.changed.notify_all();
    }

    /// The GPUs of `members` (waiting until every member has registered) and whether every
    /// pair of them has peer access (decided once per team, for every member).
    pub(super) fn peer_access(
        &self,
        members: &[DeviceId],
        timeout: Duration,
        abort: &dyn Fn() -> Option<BackendError>,
    ) -> Result<(bool, Vec<Device>), BackendError> {
        let deadline = Instant::now() + timeout;
        let devices = self
            .wait_for(deadline, abort, |s| {
                members
                    .iter()
                    .map(|m| s.devices.get(m).cloned())
                    .collect::<Option<Vec<Device>>>()
            })
            .map_err(|e| {
                e.unwrap_or_else(|| BackendError::Timeout {
                    peer: members.first().copied().unwrap_or(0),
                    waited: timeout,
                    what: format!("the members of team {members:?} to start"),
                })
            })?;
        let mut s = self.lock();
        let decided = *s.decisions.entry(members.to_vec()).or_insert_with(|| {
            devices.iter().all(|a| {
                devices
                    .iter()
                    .all(|b| a.can_access_peer(b).unwrap_or(false))
            })
        });
        Ok((decided, devices))
    }

    /// This rank's NVLink MoE engine of the team `members` (this rank is member `my_index`)
    /// and `shape`: the first member to ask makes every member's engine with `make` (on their
    /// GPUs, connected to each other), the others wait for theirs.
    pub(super) fn nvlink_engine(
        &self,
        members: &[DeviceId],
        my_index: usize,
        shape: &MoeShape,
        timeout: Duration,
        abort: &dyn Fn() -> Option<BackendError>,
        make: impl FnOnce(&[Device]) -> Result<Vec<NvlinkMoe>, BackendError>,
    ) -> Result<NvlinkMoe, BackendError> {
        let (_, devices) = self.peer_access(members, timeout, abort)?;
        let first = {
            let mut s = self.lock();
            let known = s
                .engines
                .iter()
                .any(|e| e.members == members && e.shape == *shape);
            if !known {
                // Claim the team: the others wait for the engines below.
                s.engines.push(Engines {
                    members: members.to_vec(),
                    shape: *shape,
                    ranks: Vec::new(),
                });
            }
            !known
        };
        if first {
            let made = make(&devices);
            let mut s = self.lock();
            let slot = s
                .engines
                .iter_mut()
                .find(|e| e.members == members && e.shape == *shape && e.ranks.is_empty());
            match (made, slot) {
                (Ok(ranks), Some(slot)) => slot.ranks = ranks.into_iter().map(Some).collect(),
                (Err(e), _) => {
                    s.engines
                        .retain(|x| !(x.members == members && x.shape == *shape));
                    self.changed.notify_all();
                    return Err(e);
                }
                (Ok(_), None) => {}
            }
            self.changed.notify_all();
        }
        let deadline = Instant::now() + timeout;
        self.wait_for(deadline, abort, |s| {
            let i = s
                .engines
                .iter()
                .position(|e| e.members == members && e.shape == *shape && !e.ranks.is_empty())?;
            let mine = s.engines[i].ranks.get_mut(my_index)?.take();
            if s.engines[i].ranks.iter().all(Option::is_none) {
                // Every member has its engine: a later team of this shape starts afresh.
                s.engines.swap_remove(i);
            }
            mine
        })
        .map_err(|e| {
            e.unwrap_or_else(|| BackendError::Timeout {
                peer: members.first().copied().unwrap_or(0),
                waited: timeout,
                what: format!("the NVLink MoE engines of team {members:?}"),
            })
        })
    }
}
