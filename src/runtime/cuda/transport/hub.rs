//! [`PeerHub`]: the meeting point of the in-process ranks of one launch (one thread per GPU).
//! It knows which GPU each rank runs on, decides once per team whether its GPUs reach each
//! other's memory (so that every member selects the same transport), carries the offers and
//! completions of copy-engine transfers, and hands out the NVLink MoE engines of a team (made
//! together by the first member that needs them). [`HubLink`] is a rank's [`PeerLink`] through
//! the hub.
//!
//! Every host wait on the hub watches the run's abort signal and the timeout.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::moe::{MoeShape, MoeWire, NvlinkMoe};
use meshflow_kernels::{Device, DeviceBuffer, Event, Stream};

use super::peers::{Access, Key, PeerLink, PeerWaits};
use crate::runtime::backend::{BackendError, TeamInfo};
use crate::runtime::cuda::core::{dev_err, DeviceCore};

/// A sender's data, ready once `ready` has completed.
struct Offer {
    src: DeviceBuffer,
    ready: Event,
}

/// The NVLink MoE engines of one team and shape: made by the first member, taken by each.
struct Engines {
    members: Vec<DeviceId>,
    shape: MoeShape,
    wire: MoeWire,
    ranks: Vec<Option<NvlinkMoe>>,
}

#[derive(Default)]
struct HubState {
    devices: HashMap<DeviceId, Device>,
    offers: HashMap<Key, Offer>,
    dones: HashMap<Key, Event>,
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
    fn wait_for<T>(
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

    fn put_offer(&self, key: Key, offer: Offer) {
        self.lock().offers.insert(key, offer);
        self.changed.notify_all();
    }

    fn put_done(&self, key: Key, done: Event) {
        self.lock().dones.insert(key, done);
        self.changed.notify_all();
    }

    /// The GPUs of `members` (waiting until every member has registered) and whether every
    /// pair of them has peer access (decided once per team, for every member).
    pub(crate) fn peer_access(
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

    /// This rank's NVLink MoE engine of the team `members` (this rank is member `my_index`),
    /// `shape` and `wire`: the first member to ask makes every member's engine with `make` (on
    /// their GPUs, connected to each other), the others wait for theirs.
    #[allow(clippy::too_many_arguments)]
    fn nvlink_engine(
        &self,
        members: &[DeviceId],
        my_index: usize,
        shape: &MoeShape,
        wire: MoeWire,
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
                .any(|e| e.members == members && e.shape == *shape && e.wire == wire);
            if !known {
                // Claim the team: the others wait for the engines below.
                s.engines.push(Engines {
                    members: members.to_vec(),
                    shape: *shape,
                    wire,
                    ranks: Vec::new(),
                });
            }
            !known
        };
        if first {
            let made = make(&devices);
            let mut s = self.lock();
            let slot = s.engines.iter_mut().find(|e| {
                e.members == members && e.shape == *shape && e.wire == wire && e.ranks.is_empty()
            });
            match (made, slot) {
                (Ok(ranks), Some(slot)) => slot.ranks = ranks.into_iter().map(Some).collect(),
                (Err(e), _) => {
                    s.engines
                        .retain(|x| !(x.members == members && x.shape == *shape && x.wire == wire));
                    self.changed.notify_all();
                    return Err(e);
                }
                (Ok(_), None) => {}
            }
            self.changed.notify_all();
        }
        let deadline = Instant::now() + timeout;
        self.wait_for(deadline, abort, |s| {
            let i = s.engines.iter().position(|e| {
                e.members == members && e.shape == *shape && e.wire == wire && !e.ranks.is_empty()
            })?;
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

/// A rank's [`PeerLink`] through the launch's [`PeerHub`]: offers are the sender's buffer and
/// an event on its stream, completions events on the receiver's.
pub(crate) struct HubLink {
    hub: Arc<PeerHub>,
    waits: Mutex<PeerWaits>,
}

impl HubLink {
    /// The link of a rank that registered with `hub`.
    pub fn new(hub: Arc<PeerHub>) -> HubLink {
        HubLink {
            hub,
            waits: Mutex::new(PeerWaits::default()),
        }
    }

    /// Makes `stream` wait until the data of `offer` is ready; returns its region.
    fn ready_on(
        core: &DeviceCore,
        offer: Offer,
        stream: &Stream,
    ) -> Result<DeviceBuffer, BackendError> {
        stream
            .wait(&offer.ready)
            .map_err(core.err("cuStreamWaitEvent (peer data ready)"))?;
        Ok(offer.src)
    }

    fn waits(&self) -> MutexGuard<'_, PeerWaits> {
        self.waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits (host) for the slot of `key` in `map` of the hub.
    fn wait_slot<T>(
        &self,
        core: &DeviceCore,
        peer: DeviceId,
        what: impl FnOnce() -> String,
        mut take: impl FnMut(&mut HubState) -> Option<T>,
    ) -> Result<T, BackendError> {
        let deadline = Instant::now() + core.timeout;
        let abort = || core.aborted();
        self.hub
            .wait_for(deadline, &abort, |s| take(s))
            .map_err(|e| e.unwrap_or_else(|| core.timeout_error(peer, what())))
    }
}

impl PeerLink for HubLink {
    fn name(&self) -> &'static str {
        "in-process"
    }

    fn decide(
        &self,
        core: &DeviceCore,
        teams: &[&[DeviceId]],
    ) -> Result<Vec<Access>, BackendError> {
        let abort = || core.aborted();
        teams
            .iter()
            .map(|members| {
                let (ok, _) = self.hub.peer_access(members, core.timeout, &abort)?;
                Ok(if ok {
                    Ok(())
                } else {
                    Err("some pair of the team's GPUs has no peer access".to_string())
                })
            })
            .collect()
    }

    fn prepare_copies(&self, core: &DeviceCore, members: &[DeviceId]) -> Result<(), BackendError> {
        let abort = || core.aborted();
        let (_, devices) = self.hub.peer_access(members, core.timeout, &abort)?;
        for d in &devices {
            core.device
                .enable_peer_access(d)
                .map_err(core.err("cuCtxEnablePeerAccess"))?;
        }
        Ok(())
    }

    fn shareable(
        &self,
        _core: &mut DeviceCore,
        src: DeviceBuffer,
    ) -> Result<DeviceBuffer, BackendError> {
        Ok(src)
    }

    fn offer(&self, core: &DeviceCore, key: &Key, src: &DeviceBuffer) -> Result<(), BackendError> {
        let ready = core
            .stream()
            .record_event()
            .map_err(core.err("cuEventRecord"))?;
        self.hub.put_offer(
            key.clone(),
            Offer {
                src: src.clone(),
                ready,
            },
        );
        Ok(())
    }

    fn take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        what: &str,
    ) -> Result<DeviceBuffer, BackendError> {
        let started = Instant::now();
        let offer = self.wait_slot(
            core,
            key.from,
            || format!("{what} #{} instance {} data", key.label, key.seq),
            |s| s.offers.remove(key),
        )?;
        self.waits().offer(started.elapsed());
        HubLink::ready_on(core, offer, stream)
    }

    fn try_take(
        &self,
        core: &DeviceCore,
        key: &Key,
        stream: &Stream,
        _what: &str,
    ) -> Result<Option<DeviceBuffer>, BackendError> {
        let found = self.hub.lock().offers.remove(key);
        let Some(offer) = found else {
            return match core.aborted() {
                Some(e) => Err(e),
                None => Ok(None),
            };
        };
        self.waits().offer(Duration::ZERO);
        HubLink::ready_on(core, offer, stream).map(Some)
    }

    fn read_done(&self, core: &DeviceCore, key: &Key, stream: &Stream) -> Result<(), BackendError> {
        let done = stream.record_event().map_err(core.err("cuEventRecord"))?;
        self.hub.put_done(key.clone(), done);
        Ok(())
    }

    fn reads_done(
        &self,
        core: &DeviceCore,
        keys: &[Key],
        what: &str,
    ) -> Result<Vec<Event>, BackendError> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let started = Instant::now();
            let done = self.wait_slot(
                core,
                key.to,
                || {
                    format!(
                        "{what} #{} instance {}: the receiver's copy",
                        key.label, key.seq
                    )
                },
                |s| s.dones.remove(key),
            )?;
            self.waits().completion(started.elapsed());
            core.peer_reads
                .wait(&done)
                .map_err(core.err("cuStreamWaitEvent (peer read done)"))?;
            out.push(done);
        }
        Ok(out)
    }

    fn drain_waits(&self) -> PeerWaits {
        std::mem::take(&mut *self.waits())
    }

    fn nvlink_engine(
        &self,
        core: &DeviceCore,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<NvlinkMoe, BackendError> {
        let rank = core.rank;
        let abort = || core.aborted();
        self.hub.nvlink_engine(
            &team.members,
            team.my_index,
            shape,
            wire,
            core.timeout,
            &abort,
            |devices| {
                NvlinkMoe::team_with_wire(devices, shape, wire)
                    .map_err(|e| dev_err(rank, "creating the NVLink MoE transport", e))
            },
        )
    }
}
