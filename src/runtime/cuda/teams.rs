//! NCCL communicators per team: created once (through the rendezvous) and cached for the
//! process, so that later programs and repeated runs on the same devices reuse them.
//!
//! Creation protocol for a team (members in team order): member 0 makes a unique id and
//! publishes it under `nccl/<members>/<generation>`; every member fetches it, all meet at a
//! barrier (so nobody enters the blocking `ncclCommInitRank` unless everyone is there), then
//! each joins the communicator. A rank creates its missing teams in the global order of their
//! member lists, so ranks that share several teams cannot wait on each other in a cycle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use meshflow_ir::DeviceId;
use meshflow_kernels::nccl::{Comm, NcclLib, UniqueId};
use meshflow_kernels::Device;

use crate::runtime::backend::BackendError;
use crate::runtime::rendezvous::Rendezvous;

/// What a cached communicator is for: a rendezvous namespace, a device and a team.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct TeamKey {
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

/// Takes the cached communicator of `key`, if any.
pub(super) fn checkout(key: &TeamKey) -> Option<Comm> {
    let mut c = cache();
    let i = c.comms.iter().position(|(k, _)| k == key)?;
    Some(c.comms.swap_remove(i).1)
}

/// Puts a healthy communicator back for later runs.
pub(super) fn checkin(key: TeamKey, comm: Comm) {
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
pub(super) fn create(
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
