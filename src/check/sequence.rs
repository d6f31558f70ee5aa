//! Team sequences: every member of a team issues the same collectives on it, in the same
//! order, with the same kind, root, count and dtype; collective permutes pair up.

use std::collections::{BTreeMap, HashMap};

use meshflow_ir::DeviceId;

use super::error::{CheckError, Site};
use super::events::{CommEvent, EventKind, Instances, TeamId};

/// Per rank and team, the indices (into the rank's events) of its team collectives, and per
/// event its position in that sequence.
pub(crate) struct Aligned {
    /// `seqs[rank][team]` = event indices, in issue order.
    pub seqs: Vec<HashMap<TeamId, Vec<usize>>>,
    /// `position[rank][event]` = its index in `seqs[rank][team]` (team collectives only).
    pub position: Vec<Vec<Option<usize>>>,
}

impl Aligned {
    /// The event of `rank` at position `k` of `team`'s sequence.
    pub fn event_at(&self, rank: DeviceId, team: TeamId, k: usize) -> Option<usize> {
        self.seqs.get(rank)?.get(&team)?.get(k).copied()
    }
}

/// Groups every rank's team collectives by team.
pub(crate) fn align(inst: &Instances) -> Aligned {
    let mut seqs = Vec::with_capacity(inst.world_size);
    let mut position = Vec::with_capacity(inst.world_size);
    for events in &inst.events {
        let mut by_team: HashMap<TeamId, Vec<usize>> = HashMap::new();
        let mut pos = vec![None; events.len()];
        for (i, e) in events.iter().enumerate() {
            if e.kind.is_team_collective() {
                let seq = by_team.entry(e.team).or_default();
                if let Some(p) = pos.get_mut(i) {
                    *p = Some(seq.len());
                }
                seq.push(i);
            }
        }
        seqs.push(by_team);
        position.push(pos);
    }
    Aligned { seqs, position }
}

fn site(inst: &Instances, e: &CommEvent) -> Site {
    Site {
        inst: inst.inst(e).clone(),
        at: e.iteration.clone(),
    }
}

/// What differs between two members' collectives at the same position, if anything.
fn difference(inst: &Instances, a: &CommEvent, b: &CommEvent) -> Option<String> {
    if a.kind != b.kind {
        return Some(format!("kind {} vs {}", a.kind, b.kind));
    }
    if a.root_index != b.root_index {
        let show = |r: Option<i64>| r.map_or("?".to_string(), |r| r.to_string());
        return Some(format!(
            "root {} vs {}",
            show(a.root_index),
            show(b.root_index)
        ));
    }
    if let (Some(x), Some(y)) = (a.dtype, b.dtype) {
        if x != y {
            return Some(format!("dtype {x} vs {y}"));
        }
    }
    if let (Some(x), Some(y)) = (a.count, b.count) {
        if x != y {
            return Some(format!("size {x} vs {y} elements"));
        }
    }
    operands(inst, a, b)
}

/// Whether two members operate on different data: for a collective, every member sends
/// from and receives into the same tensor and slice (two equal-size collectives issued in
/// swapped order would otherwise combine one tensor with another); for a collective
/// permute, `send_recv` or MoE op, the same tensors (each member's slice is its own). The
/// CPU backend checks the same at run time (`Operands` of its fabric).
fn operands(inst: &Instances, a: &CommEvent, b: &CommEvent) -> Option<String> {
    let by_slice =
        matches!(a.kind, EventKind::Collective(k) if k != meshflow_ir::CommKind::SendRecv);
    let sides = [
        ("send", a.send, b.send, &a.send_slice, &b.send_slice),
        ("receive", a.recv, b.recv, &a.recv_slice, &b.recv_slice),
    ];
    for (role, x, y, sx, sy) in sides {
        let (Some(x), Some(y)) = (x, y) else {
            continue;
        };
        let differ =
            x.tensor != y.tensor || (by_slice && matches!((sx, sy), (Some(p), Some(q)) if p != q));
        if !differ {
            continue;
        }
        let show = |s: &Option<super::events::Slice>, t: meshflow_ir::HostTensorId| match s {
            Some(s) if by_slice => inst.slice_text(s),
            _ => inst.slice_text(&super::events::Slice::whole(t)),
        };
        return Some(format!(
            "{role} buffer {} vs {}: the members would combine different data",
            show(sx, x.tensor),
            show(sy, y.tensor)
        ));
    }
    None
}

/// Checks every team's sequences (first mismatch per team) and the peers of every aligned
/// collective permute.
pub(crate) fn check(inst: &Instances, aligned: &Aligned) -> Vec<CheckError> {
    let mut errors = Vec::new();
    for (t, members) in inst.teams.iter().enumerate() {
        let team = TeamId(t);
        let empty = Vec::new();
        let seq_of = |m: DeviceId| {
            aligned
                .seqs
                .get(m)
                .and_then(|s| s.get(&team))
                .unwrap_or(&empty)
        };
        let len = members.iter().map(|&m| seq_of(m).len()).max().unwrap_or(0);
        'positions: for k in 0..len {
            let Some((rank_a, ev_a)) = members
                .iter()
                .find_map(|&m| seq_of(m).get(k).map(|&i| (m, &inst.events[m][i])))
            else {
                break;
            };
            let mut at_k = Vec::with_capacity(members.len());
            for &rank_b in members {
                let Some(&i) = seq_of(rank_b).get(k) else {
                    errors.push(CheckError::MissingCollective {
                        team: members.clone(),
                        index: k,
                        rank_a,
                        site_a: site(inst, ev_a),
                        rank_b,
                        count_b: seq_of(rank_b).len(),
                    });
                    break 'positions;
                };
                let ev_b = &inst.events[rank_b][i];
                if let Some(difference) = difference(inst, ev_a, ev_b) {
                    errors.push(CheckError::SequenceMismatch {
                        team: members.clone(),
                        index: k,
                        rank_a,
                        site_a: site(inst, ev_a),
                        rank_b,
                        site_b: site(inst, ev_b),
                        difference,
                    });
                    break 'positions;
                }
                at_k.push((rank_b, ev_b));
            }
            if ev_a.kind == EventKind::CollectivePermute {
                check_permute(inst, members, &at_k, &mut errors);
            }
        }
    }
    errors
}

/// Checks one aligned collective permute: send peers form a permutation, each member receives
/// from the member that sends to it, and byte counts agree.
fn check_permute(
    inst: &Instances,
    members: &[DeviceId],
    at_k: &[(DeviceId, &CommEvent)],
    errors: &mut Vec<CheckError>,
) {
    let event_of: HashMap<DeviceId, &CommEvent> = at_k.iter().copied().collect();
    let mut senders: BTreeMap<usize, Vec<DeviceId>> = BTreeMap::new();
    for &(m, e) in at_k {
        let Some(dst) = e.send_peer else { return };
        let slot = members.iter().position(|&x| x == dst).unwrap_or(usize::MAX);
        senders.entry(slot).or_default().push(m);
        if e.recv_peer.is_none() {
            return;
        }
    }
    if let Some((&slot, from)) = senders.iter().find(|(_, from)| from.len() > 1) {
        let first = from.first().and_then(|m| event_of.get(m));
        if let (Some(&target), Some(first)) = (members.get(slot), first) {
            errors.push(CheckError::NotAPermutation {
                site: site(inst, first),
                team: members.to_vec(),
                target,
                senders: from.clone(),
            });
        }
        return;
    }
    for &(m, e) in at_k {
        let (Some(p), Some(peer)) = (e.recv_peer, e.recv_peer.and_then(|p| event_of.get(&p)))
        else {
            continue;
        };
        match peer.send_peer {
            Some(s) if s != m => errors.push(CheckError::PeerMismatch {
                site: site(inst, e),
                rank: m,
                recv_peer: p,
                peer_sends_to: s,
            }),
            _ => {
                let (sent, expected) = (peer.send.map(|b| b.bytes()), e.recv.map(|b| b.bytes()));
                if let (Some(send_bytes), Some(recv_bytes)) = (sent, expected) {
                    if send_bytes != recv_bytes {
                        errors.push(CheckError::SizeMismatch {
                            src: p,
                            dst: m,
                            send_site: site(inst, peer),
                            send_bytes,
                            recv_site: site(inst, e),
                            recv_bytes,
                        });
                    }
                }
            }
        }
    }
}
