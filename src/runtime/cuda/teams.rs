//! NCCL communicators per team: created once (through the rendezvous) and cached for the
//! process, so that later programs and repeated runs on the same devices reuse them.
//! [`Communicators`] holds a rank's communicators of the teams of its program (the NCCL,
//! host-proxy and MoE-over-NCCL transports use them).
//!
//! A team is its member list in team order (NCCL rank = team index), whatever the host IR
//! wrote: `slice(m, DIDx)`, a `flattened(m, DIDy, DIDx)` sub-mesh over several mesh axes (one
//! communicator for what would be consecutive collectives per axis), `mesh(m)` or
//! `devices(..)`. Two team expressions with the same members share one communicator.
//!
//! Creation protocol for a team (members in team order): member 0 makes a unique id and
//! publishes it under `nccl/<members>/<generation>`; every member fetches it, all meet at a
//! barrier (so nobody enters the blocking `ncclCommInitRank` unless everyone is there), then
//! each joins the communicator. A rank creates its missing teams in the global order of their
//! member lists, so ranks that share several teams cannot wait on each other in a cycle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use meshflow_ir::{Arena, DeviceId, EntityRef};
use meshflow_kernels::nccl::{self, Comm, NcclLib, UniqueId};
use meshflow_kernels::{DType, Device, DeviceBuffer};

use super::core::{dev_err, DeviceCore};
use crate::runtime::backend::{BackendError, TeamId, TeamInfo};
use crate::runtime::rendezvous::Rendezvous;

/// What a cached communicator is for: a rendezvous namespace, a device and a team.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct TeamKey {
    pub namespace: String,
    pub ordinal: usize,
    pub members: Vec<DeviceId>,
}

#[derive(Default)]
struct Cache {
    comms: Vec<(TeamKey, Comm)>,
    generations: HashMap<TeamKey, u64>,
}

fn cache() -> MutexGuard<'static, Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE
        .get_or_init(|| Mutex::new(Cache::default()))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Takes the cached communicator of `key`, if any: the oldest one checked in.
///
/// Members of a team pair their communicators by order: each takes its own oldest one of the
/// team, and every member checked in the same cliques in the same order (the same programs'
/// backends, dropped in the same order). So the order of one key's entries must depend on
/// that rank's own check-ins and check-outs only. Ranks that are threads of one process share
/// this cache; removing with `swap_remove` let one rank's check-out move another rank's newest
/// entry in front of its oldest, and the two ranks then took communicators of different
/// cliques: their first collective waited for each other forever.
pub(crate) fn checkout(key: &TeamKey) -> Option<Comm> {
    take_oldest(&mut cache().comms, key)
}

/// Removes and returns the oldest entry of `key` in `entries`, keeping the others' order.
fn take_oldest<K: PartialEq, V>(entries: &mut Vec<(K, V)>, key: &K) -> Option<V> {
    let i = entries.iter().position(|(k, _)| k == key)?;
    Some(entries.remove(i).1)
}

/// Puts a healthy communicator back for later runs.
pub(crate) fn checkin(key: TeamKey, comm: Comm) {
    cache().comms.push((key, comm));
}

/// Aborts and forgets every cached communicator (after a failed run, whose ranks may disagree
/// about which communicators are healthy). Call it only while no run is in progress.
pub fn clear_communicator_cache() {
    let comms = std::mem::take(&mut cache().comms);
    let n = comms.len();
    drop(comms);
    if n > 0 {
        tracing::debug!("aborted {n} cached NCCL communicators");
    }
}

fn device_error(rank: DeviceId, call: &str, message: impl ToString) -> BackendError {
    BackendError::Device {
        rank,
        call: call.to_owned(),
        message: message.to_string(),
    }
}

/// Creates this rank's communicator of a team.
pub(crate) fn create(
    rank: DeviceId,
    lib: &Arc<NcclLib>,
    device: &Device,
    rendezvous: Option<&dyn Rendezvous>,
    key: &TeamKey,
    my_index: usize,
    timeout: Duration,
) -> Result<Comm, BackendError> {
    let members = &key.members;
    let d = members.len();
    let generation = {
        let mut c = cache();
        let g = c.generations.entry(key.clone()).or_insert(0);
        *g += 1;
        *g
    };
    let what = format!("communicator of team {members:?}");
    let id = if d == 1 {
        UniqueId::new(lib).map_err(|e| device_error(rank, "ncclGetUniqueId", e))?
    } else {
        let rdv = rendezvous.ok_or_else(|| {
            BackendError::Invalid(format!(
                "rank {rank}: the {what} needs a rendezvous with the other members"
            ))
        })?;
        let names: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        let base = format!("nccl/{}/{}/{generation}", key.namespace, names.join(","));
        let rdv_err = |e: crate::runtime::rendezvous::RendezvousError| match e {
            crate::runtime::rendezvous::RendezvousError::Aborted(reason) => BackendError::Aborted {
                failed_rank: members.first().copied().unwrap_or(rank),
                reason,
            },
            crate::runtime::rendezvous::RendezvousError::Lost { rank: lost, reason } => {
                BackendError::Aborted {
                    failed_rank: lost,
                    reason: format!("rank {lost} stopped ({reason})"),
                }
            }
            e => BackendError::Invalid(format!("rank {rank}: creating the {what}: {e}")),
        };
        let id = if my_index == 0 {
            let id = UniqueId::new(lib).map_err(|e| device_error(rank, "ncclGetUniqueId", e))?;
            rdv.publish(&base, &id.to_bytes()).map_err(rdv_err)?;
            id
        } else {
            let bytes = rdv.fetch(&base, timeout).map_err(rdv_err)?;
            UniqueId::from_slice(&bytes).map_err(|e| device_error(rank, "ncclUniqueId", e))?
        };
        rdv.barrier(&format!("{base}/ready"), d, timeout)
            .map_err(rdv_err)?;
        id
    };
    tracing::debug!(rank, ?members, generation, "ncclCommInitRank");
    Comm::init_rank(lib, device, d, &id, my_index)
        .map_err(|e| device_error(rank, &format!("ncclCommInitRank ({what})"), e))
}

/// A rank's NCCL communicators: one per team of the prepared program (from the cache, the
/// caller, or created through the rendezvous), and the library.
#[derive(Default)]
pub(crate) struct Communicators {
    lib: Option<Arc<NcclLib>>,
    held: Vec<(TeamKey, Comm)>,
    /// Per team of the prepared program, its index in `held`.
    by_team: Vec<usize>,
}

impl std::fmt::Debug for Communicators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicators")
            .field("teams", &self.held.len())
            .finish()
    }
}

impl Communicators {
    /// The NCCL library (loaded on first use).
    pub fn lib(&mut self, rank: DeviceId) -> Result<Arc<NcclLib>, BackendError> {
        if let Some(l) = &self.lib {
            return Ok(l.clone());
        }
        let l = NcclLib::load().map_err(|e| dev_err(rank, "loading NCCL", e))?;
        self.lib = Some(l.clone());
        Ok(l)
    }

    /// The library, once loaded (by [`Communicators::prepare`] or [`Communicators::adopt`]).
    pub fn loaded(&self) -> Result<&Arc<NcclLib>, BackendError> {
        self.lib
            .as_ref()
            .ok_or_else(|| BackendError::Invalid("no NCCL library loaded".into()))
    }

    /// The key of a team's communicator on this rank.
    pub fn key(core: &DeviceCore, members: &[DeviceId]) -> TeamKey {
        TeamKey {
            namespace: core.namespace(),
            ordinal: core.device.ordinal(),
            members: members.to_vec(),
        }
    }

    /// Serves the team `members` (global ranks in team order) with the caller's communicator
    /// `comm` (replacing a held one), after checking it is this rank's of that team, on its
    /// GPU.
    pub fn adopt(
        &mut self,
        core: &DeviceCore,
        members: Vec<DeviceId>,
        comm: Comm,
    ) -> Result<(), BackendError> {
        let rank = core.rank;
        let invalid = |m: String| BackendError::Invalid(format!("rank {rank}: {m}"));
        let my_index = members.iter().position(|&m| m == rank).ok_or_else(|| {
            invalid(format!(
                "a communicator is given for team {members:?}, without this rank"
            ))
        })?;
        if comm.size() != members.len() || comm.rank() != my_index {
            return Err(invalid(format!(
                "the communicator given for team {members:?} has rank {} of {}, not {my_index} \
                 of {}",
                comm.rank(),
                comm.size(),
                members.len()
            )));
        }
        if !comm.device().same_as(&core.device) {
            return Err(invalid(format!(
                "the communicator given for team {members:?} is on GPU {}, not {}",
                comm.device().ordinal(),
                core.device.ordinal()
            )));
        }
        let key = Communicators::key(core, &members);
        self.lib.get_or_insert_with(|| comm.lib().clone());
        self.held.retain(|(k, _)| *k != key);
        self.held.push((key, comm));
        Ok(())
    }

    /// Makes sure every team of a program has a communicator: cached ones are taken, missing
    /// ones created (in the global order of their member lists, so that ranks sharing several
    /// teams cannot wait on each other in a cycle) and their point-to-point channels connected.
    pub fn prepare(
        &mut self,
        core: &DeviceCore,
        teams: &Arena<TeamId, TeamInfo>,
    ) -> Result<(), BackendError> {
        self.by_team.clear();
        if teams.is_empty() {
            return Ok(());
        }
        let lib = self.lib(core.rank)?;
        let mut missing: Vec<(TeamKey, usize)> = Vec::new();
        for t in teams.values() {
            let key = Communicators::key(core, &t.members);
            if self.held.iter().any(|(k, _)| *k == key) || missing.iter().any(|(k, _)| *k == key) {
                continue;
            }
            match checkout(&key) {
                Some(c) => self.held.push((key, c)),
                None => missing.push((key, t.my_index)),
            }
        }
        missing.sort_by(|a, b| a.0.members.cmp(&b.0.members));
        for (key, my_index) in missing {
            if let Some(e) = core.aborted() {
                return Err(e);
            }
            let comm = self.create(core, &lib, &key, my_index)?;
            self.held.push((key, comm));
            self.preconnect(core, &lib, self.held.len() - 1)?;
        }
        for t in teams.values() {
            let key = Communicators::key(core, &t.members);
            let i = self
                .held
                .iter()
                .position(|(k, _)| *k == key)
                .ok_or_else(|| BackendError::Invalid(format!("no communicator for {key:?}")))?;
            let slot = t.id.index();
            if self.by_team.len() <= slot {
                self.by_team.resize(slot + 1, usize::MAX);
            }
            self.by_team[slot] = i;
        }
        Ok(())
    }

    /// Creates this rank's communicator of `key` through the core's rendezvous.
    pub fn create(
        &self,
        core: &DeviceCore,
        lib: &Arc<NcclLib>,
        key: &TeamKey,
        my_index: usize,
    ) -> Result<Comm, BackendError> {
        create(
            core.rank,
            lib,
            &core.device,
            core.rendezvous.as_deref(),
            key,
            my_index,
            core.timeout,
        )
    }

    /// Connects NCCL's point-to-point channels between this rank and every other member of
    /// `held[i]` now, right after its creation, while every member is known to be here: a
    /// one-byte send and receive with each peer in one group, waited for like a program's end.
    /// NCCL otherwise connects a pair inside the first `ncclGroupEnd` of a send/recv between
    /// them, which blocks the host thread until the peer posts its side, and never returns if
    /// the peer has failed by then (no abort can reach a thread inside NCCL).
    fn preconnect(
        &mut self,
        core: &DeviceCore,
        lib: &Arc<NcclLib>,
        i: usize,
    ) -> Result<(), BackendError> {
        let Some((_, comm)) = self.held.get(i) else {
            return Ok(());
        };
        let (n, me) = (comm.size(), comm.rank());
        if n < 2 {
            return Ok(());
        }
        let bytes = DeviceBuffer::alloc(&core.device, 2 * n).map_err(core.err("cuMemAlloc"))?;
        let s = core.streams[0].clone();
        nccl::group(lib, || {
            for p in (0..n).filter(|&p| p != me) {
                comm.send(&bytes.view(p, 1)?, DType::U8, p, &s)?;
                comm.recv(&bytes.view(n + p, 1)?, DType::U8, p, &s)?;
            }
            Ok(())
        })
        .map_err(core.err("NCCL point-to-point connection"))?;
        let done = s.record_event().map_err(core.err("cuEventRecord"))?;
        match core.wait_device(&done, || self.async_error(core.rank)) {
            Ok(()) => Ok(()),
            Err(f) => {
                if f.abort {
                    self.abort_all(core.rank);
                }
                Err(f.error)
            }
        }
    }

    /// The communicator of `team` in the prepared program.
    pub fn of(&self, rank: DeviceId, team: &TeamInfo) -> Result<&Comm, BackendError> {
        self.by_team
            .get(team.id.index())
            .and_then(|&i| self.held.get(i))
            .map(|(_, c)| c)
            .ok_or_else(|| {
                BackendError::Invalid(format!(
                    "rank {rank}: no communicator for team {:?}",
                    team.members
                ))
            })
    }

    /// The first asynchronous error of a held communicator, if any.
    pub fn async_error(&self, rank: DeviceId) -> Option<BackendError> {
        self.held.iter().find_map(|(key, c)| {
            c.check_async_error().err().map(|e| {
                dev_err(
                    rank,
                    &format!("NCCL communicator of team {:?}", key.members),
                    e,
                )
            })
        })
    }

    /// Aborts every communicator of meshflow's (unblocking device work waiting for a peer);
    /// the caller's are left alone.
    pub fn abort_all(&mut self, rank: DeviceId) {
        self.by_team.clear();
        for (key, c) in self.held.drain(..) {
            if c.is_borrowed() {
                continue;
            }
            if let Err(e) = c.abort() {
                tracing::warn!(rank, ?key.members, "ncclCommAbort failed: {e}");
            }
        }
    }

    /// Hands the healthy communicators back to the cache (the caller's go back to the caller).
    pub fn checkin_all(&mut self) {
        self.by_team.clear();
        for (key, c) in self.held.drain(..) {
            if !c.is_borrowed() {
                checkin(key, c);
            }
        }
    }

    /// The number of held communicators.
    pub fn len(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::take_oldest;

    /// Two ranks (threads of one process) check their communicators of one team in and out of
    /// the shared cache, their operations interleaved in every way of a small schedule: each
    /// rank must take its cliques back in the order it checked them in, so that the members'
    /// check-outs pair the same cliques whatever the other rank did meanwhile.
    #[test]
    fn a_ranks_checkouts_follow_its_own_checkins_whatever_the_other_rank_does() {
        // Rank r's entries: key r, value (r, clique).
        let cliques = 5usize;
        for pattern in 0u32..(1 << (2 * cliques)) {
            let mut entries: Vec<(usize, (usize, usize))> = Vec::new();
            // Check-ins interleaved as the pattern's low bits say.
            let mut next = [0usize; 2];
            for bit in 0..2 * cliques {
                let mut r = ((pattern >> bit) & 1) as usize;
                if next[r] == cliques {
                    r = 1 - r;
                }
                entries.push((r, (r, next[r])));
                next[r] += 1;
            }
            // Check-outs interleaved as its bits in reverse say.
            let mut taken = [Vec::new(), Vec::new()];
            for bit in (0..2 * cliques).rev() {
                let mut r = ((pattern >> bit) & 1) as usize;
                if taken[r].len() == cliques {
                    r = 1 - r;
                }
                let (owner, clique) = take_oldest(&mut entries, &r).expect("an entry of rank r");
                assert_eq!(owner, r);
                taken[r].push(clique);
            }
            let order: Vec<usize> = (0..cliques).collect();
            assert_eq!(taken[0], order, "pattern {pattern:#b}");
            assert_eq!(taken[1], order, "pattern {pattern:#b}");
            assert!(entries.is_empty());
        }
    }
}
