//! How CUDA IPC peers meet at the run's rendezvous ([`Meeting`]): every rank publishes a
//! [`Card`] once (its process, host, listening port and the IPC handle of its signal words);
//! per team, every member publishes its verdict (whether it reached every other member's
//! memory, or why not) and reads the others', so that all members take the same decision; the
//! NVLink MoE engines exchange their handles the same way.
//!
//! Keys live under `meshflow/ipc/<namespace>/<generation>/`, where the generation counts the
//! links this process made for the rank in that namespace: the ranks of one run make their
//! links in the same order (one backend each), as they create their NCCL communicators.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;
use meshflow_kernels::{IpcHandle, IPC_HANDLE_BYTES};

use super::super::peers::Access;
use crate::runtime::backend::BackendError;
use crate::runtime::rendezvous::{Rendezvous, RendezvousError};

const CARD_MAGIC: &[u8; 8] = b"MFIPCCD1";
/// How long a watched rendezvous wait waits between two looks at whether its peer is gone.
const WATCH_SLICE: Duration = Duration::from_millis(200);

/// What a rank tells its peers about itself, once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Card {
    /// A random number of its process (equal for ranks of one process).
    pub process: u64,
    /// The host's boot id (equal for processes of one host).
    pub host: String,
    /// The loopback port it listens on for messages and the handle of its signal words, or
    /// why it cannot share memory over CUDA IPC at all.
    pub reach: Result<(u16, IpcHandle), String>,
}

impl Card {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CARD_MAGIC.len() + 16 + IPC_HANDLE_BYTES + 64);
        out.extend_from_slice(CARD_MAGIC);
        out.extend_from_slice(&self.process.to_le_bytes());
        let host = self.host.as_bytes();
        out.extend_from_slice(&(host.len().min(u16::MAX as usize) as u16).to_le_bytes());
        out.extend_from_slice(&host[..host.len().min(u16::MAX as usize)]);
        match &self.reach {
            Ok((port, pad)) => {
                out.push(0);
                out.extend_from_slice(&port.to_le_bytes());
                out.extend_from_slice(&pad.to_bytes());
            }
            Err(why) => {
                out.push(1);
                out.extend_from_slice(why.as_bytes());
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Card, String> {
        let bad = || "it is not a meshflow CUDA IPC card (another version?)".to_string();
        let m = CARD_MAGIC.len();
        if bytes.len() < m + 10 || &bytes[..m] != CARD_MAGIC {
            return Err(bad());
        }
        let mut p = [0u8; 8];
        p.copy_from_slice(&bytes[m..m + 8]);
        let host_len = u16::from_le_bytes([bytes[m + 8], bytes[m + 9]]) as usize;
        let host_end = m + 10 + host_len;
        let host = bytes.get(m + 10..host_end).ok_or_else(bad)?;
        let reach = match bytes.get(host_end..).and_then(|r| r.split_first()) {
            Some((0, rest)) if rest.len() == 2 + IPC_HANDLE_BYTES => {
                let port = u16::from_le_bytes([rest[0], rest[1]]);
                let pad = IpcHandle::from_bytes(&rest[2..]).map_err(|e| e.to_string())?;
                Ok((port, pad))
            }
            Some((1, why)) => Err(String::from_utf8_lossy(why).into_owned()),
            _ => return Err(bad()),
        };
        Ok(Card {
            process: u64::from_le_bytes(p),
            host: String::from_utf8_lossy(host).into_owned(),
            reach,
        })
    }
}

/// A random number that names this process.
pub(super) fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    })
}

/// The boot id of this host (processes of one host share it), or `unknown`.
pub(super) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The next generation of the links of `rank` in `namespace` in this process (from 1).
pub(super) fn next_generation(namespace: &str, rank: DeviceId) -> u64 {
    static GENERATIONS: Mutex<Option<HashMap<(String, DeviceId), u64>>> = Mutex::new(None);
    let mut g = GENERATIONS.lock().unwrap_or_else(|p| p.into_inner());
    let n = g
        .get_or_insert_with(HashMap::new)
        .entry((namespace.to_string(), rank))
        .or_insert(0);
    *n += 1;
    *n
}

/// A team's members as a key part (`0,1,2`).
pub(super) fn members_key(members: &[DeviceId]) -> String {
    let names: Vec<String> = members.iter().map(|m| m.to_string()).collect();
    names.join(",")
}

/// The rendezvous keys of one rank's link (see the module docs).
#[derive(Debug)]
pub(super) struct Meeting {
    rdv: Arc<dyn Rendezvous>,
    base: String,
    rank: DeviceId,
    timeout: Duration,
}

impl Meeting {
    pub fn new(
        rdv: Arc<dyn Rendezvous>,
        rank: DeviceId,
        generation: u64,
        timeout: Duration,
    ) -> Meeting {
        let base = format!("meshflow/ipc/{}/{generation}", rdv.namespace());
        Meeting {
            rdv,
            base,
            rank,
            timeout,
        }
    }

    fn error(&self, peer: DeviceId, what: &str, e: RendezvousError) -> BackendError {
        match e {
            RendezvousError::Aborted(reason) => BackendError::Aborted {
                failed_rank: peer,
                reason,
            },
            RendezvousError::Lost { rank, reason } => BackendError::Aborted {
                failed_rank: rank,
                reason: format!("rank {rank} stopped ({reason})"),
            },
            RendezvousError::Timeout { waited, .. } => BackendError::Timeout {
                peer,
                waited,
                what: format!("{what} (CUDA IPC set-up at the rendezvous)"),
            },
            e => BackendError::Invalid(format!("rank {}: CUDA IPC set-up: {what}: {e}", self.rank)),
        }
    }

    fn publish(&self, key: &str, value: &[u8], what: &str) -> Result<(), BackendError> {
        self.rdv
            .publish(&format!("{}/{key}", self.base), value)
            .map_err(|e| self.error(self.rank, what, e))
    }

    fn fetch(&self, key: &str, peer: DeviceId, what: &str) -> Result<Vec<u8>, BackendError> {
        self.rdv
            .fetch(&format!("{}/{key}", self.base), self.timeout)
            .map_err(|e| self.error(peer, what, e))
    }

    /// Publishes this rank's card.
    pub fn publish_card(&self, card: &Card) -> Result<(), BackendError> {
        self.publish(&format!("card/{}", self.rank), &card.encode(), "its card")
    }

    /// The card of `peer` (waiting for it).
    pub fn card(&self, peer: DeviceId) -> Result<Card, BackendError> {
        let what = format!("the CUDA IPC card of rank {peer}");
        let bytes = self.fetch(&format!("card/{peer}"), peer, &what)?;
        Card::decode(&bytes)
            .map_err(|why| BackendError::Invalid(format!("rank {}: {what}: {why}", self.rank)))
    }

    /// Publishes this rank's verdict on the team `members`.
    pub fn publish_verdict(&self, members: &[DeviceId], v: &Access) -> Result<(), BackendError> {
        let bytes = match v {
            Ok(()) => vec![0],
            Err(why) => std::iter::once(1).chain(why.bytes()).collect(),
        };
        let key = format!("verdict/{}/{}", members_key(members), self.rank);
        self.publish(&key, &bytes, "its verdict")
    }

    /// The verdict of `peer` on the team `members` (waiting for it).
    pub fn verdict(&self, members: &[DeviceId], peer: DeviceId) -> Result<Access, BackendError> {
        let key = format!("verdict/{}/{peer}", members_key(members));
        let what = format!("rank {peer}'s CUDA IPC verdict on team {members:?}");
        let bytes = self.fetch(&key, peer, &what)?;
        match bytes.split_first() {
            Some((0, [])) => Ok(Ok(())),
            Some((1, why)) => Ok(Err(String::from_utf8_lossy(why).into_owned())),
            _ => Err(BackendError::Invalid(format!(
                "rank {}: {what} is malformed",
                self.rank
            ))),
        }
    }

    /// Every member's `mine` for `tag` (this rank is `members[my_index]`), in member order.
    /// While it waits for a member `m`, `gone(m)` is asked a few times a second: an error
    /// (the member is known to have stopped) ends the wait at once.
    pub fn all_gather(
        &self,
        tag: &str,
        members: &[DeviceId],
        my_index: usize,
        mine: &[u8],
        gone: &dyn Fn(DeviceId) -> Option<BackendError>,
    ) -> Result<Vec<Vec<u8>>, BackendError> {
        let key = |i: usize| format!("{tag}/{}/{i}", members_key(members));
        self.publish(&key(my_index), mine, tag)?;
        members
            .iter()
            .enumerate()
            .map(|(i, &m)| {
                if i == my_index {
                    Ok(mine.to_vec())
                } else {
                    self.fetch_watching(&key(i), m, &format!("rank {m}'s {tag}"), gone)
                }
            })
            .collect()
    }

    /// [`fetch`](Self::fetch) in slices of [`WATCH_SLICE`], asking `gone(peer)` between them.
    fn fetch_watching(
        &self,
        key: &str,
        peer: DeviceId,
        what: &str,
        gone: &dyn Fn(DeviceId) -> Option<BackendError>,
    ) -> Result<Vec<u8>, BackendError> {
        let full = format!("{}/{key}", self.base);
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(e) = gone(peer) {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rdv.fetch(&full, left.min(WATCH_SLICE)) {
                Ok(v) => return Ok(v),
                Err(RendezvousError::Timeout { .. }) if left > WATCH_SLICE => {}
                Err(RendezvousError::Timeout { what: w, .. }) => {
                    let e = RendezvousError::Timeout {
                        what: w,
                        waited: self.timeout,
                    };
                    return Err(self.error(peer, what, e));
                }
                Err(e) => return Err(self.error(peer, what, e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::rendezvous::LocalRendezvous;

    #[test]
    fn cards_round_trip_and_garbage_is_refused() {
        let card = Card {
            process: process_token(),
            host: host_id(),
            reach: Ok((
                40_123,
                IpcHandle::from_bytes(&[7u8; IPC_HANDLE_BYTES]).unwrap(),
            )),
        };
        assert_eq!(Card::decode(&card.encode()).unwrap(), card);
        let without = Card {
            reach: Err("no IPC here".into()),
            ..card.clone()
        };
        assert_eq!(Card::decode(&without.encode()).unwrap(), without);
        let mut cut = card.encode();
        cut.pop();
        assert!(Card::decode(&cut).is_err());
        assert!(Card::decode(b"MFIPCCD1").is_err());
        assert!(Card::decode(&[0u8; 200]).is_err());
        assert_eq!(process_token(), process_token());
    }

    #[test]
    fn verdicts_and_gathers_meet_through_the_rendezvous() {
        let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("ipc-meet-test"));
        let t = Duration::from_secs(5);
        let a = Meeting::new(rdv.clone(), 0, 1, t);
        let b = Meeting::new(rdv, 1, 1, t);
        a.publish_verdict(&[0, 1], &Ok(())).unwrap();
        b.publish_verdict(&[0, 1], &Err("no peer access".into()))
            .unwrap();
        assert_eq!(a.verdict(&[0, 1], 1).unwrap(), Err("no peer access".into()));
        assert_eq!(b.verdict(&[0, 1], 0).unwrap(), Ok(()));
        let got = std::thread::scope(|s| {
            let h = s.spawn(|| {
                b.all_gather("moe/1", &[0, 1], 1, b"bee", &|_| None)
                    .unwrap()
            });
            let mine = a.all_gather("moe/1", &[0, 1], 0, b"ay", &|_| None).unwrap();
            (mine, h.join().unwrap())
        });
        assert_eq!(got.0, vec![b"ay".to_vec(), b"bee".to_vec()]);
        assert_eq!(got.0, got.1);
        assert!(next_generation("ns-x", 3) < next_generation("ns-x", 3));
        assert_eq!(members_key(&[2, 0, 5]), "2,0,5");
        // A key nobody publishes times out, naming the peer.
        let quick = Meeting::new(
            Arc::new(LocalRendezvous::new("ipc-meet-timeout")),
            0,
            1,
            Duration::from_millis(20),
        );
        let e = quick.card(4).unwrap_err();
        assert!(matches!(e, BackendError::Timeout { peer: 4, .. }), "{e}");
        let e = quick
            .all_gather("moe/2", &[0, 4], 0, b"ay", &|_| None)
            .unwrap_err();
        assert!(matches!(e, BackendError::Timeout { peer: 4, .. }), "{e}");
        // A member known to be gone ends the gather with that error, not at the timeout.
        let patient = Meeting::new(
            Arc::new(LocalRendezvous::new("ipc-meet-gone")),
            0,
            1,
            Duration::from_secs(3600),
        );
        let gone = |p: DeviceId| {
            (p == 1).then(|| BackendError::Aborted {
                failed_rank: 1,
                reason: "rank 1 stopped".into(),
            })
        };
        let e = patient
            .all_gather("moe/1", &[0, 1], 0, b"ay", &gone)
            .unwrap_err();
        assert!(
            matches!(e, BackendError::Aborted { failed_rank: 1, .. }),
            "{e}"
        );
    }
}
