//! Deadlock detection: simulate every rank with blocking semantics.
//!
//! Each rank issues *ops* in order: a single communication, or a whole coalescing group (NCCL
//! grouped semantics: the group's communications are posted together and complete together).
//! An op completes when every counterpart of every communication in it is at its matching
//! op: all team members for a collective (MoE dispatch and combine included), the send and
//! receive peers for a collective permute, the matched peer for `send_recv`. Ops whose
//! counterparts wait on ops that cannot complete cannot complete either (a fixed point).
//! When no rank can progress and some have not finished, the ranks are deadlocked; this
//! catches collectives on overlapping teams issued in inconsistent orders.

//!
//! The simulation is event-driven and linear in the number of events: a collective is one
//! *meeting* vertex shared by its members (not a need from every member to every other, which
//! is quadratic in the team size), and only ranks that just advanced are re-examined.

use std::collections::HashMap;

use meshflow_ir::DeviceId;

use super::error::{CheckError, Site, StuckRank};
use super::events::{EventKind, Instances, TeamId};
use super::p2p::Matches;
use super::sequence::Aligned;

/// What an op needs to be current elsewhere before it can complete.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Need {
    /// Rank `.0` at its op `.1` (a permute or point-to-point counterpart).
    Peer(DeviceId, usize),
    /// Every member of a team collective at its op (index into the meetings).
    Meeting(usize),
}

/// One rank's op: its events and what it needs, in the order the events list them.
struct Op {
    first_event: usize,
    len: usize,
    needs: Vec<Need>,
}

/// The members of one team collective instance: `(rank, op)`, in team order.
struct Meeting {
    members: Vec<(DeviceId, usize)>,
}

struct Graph {
    ops: Vec<Vec<Op>>,
    meetings: Vec<Meeting>,
}

fn group_ops(inst: &Instances) -> (Vec<Vec<Op>>, Vec<Vec<usize>>) {
    // Group consecutive events of the same coalescing group.
    let mut op_of: Vec<Vec<usize>> = Vec::with_capacity(inst.world_size);
    let mut ops: Vec<Vec<Op>> = Vec::with_capacity(inst.world_size);
    for events in &inst.events {
        let mut of = Vec::with_capacity(events.len());
        let mut rank_ops: Vec<Op> = Vec::new();
        for (i, e) in events.iter().enumerate() {
            let joins =
                i > 0 && e.group.is_some() && events.get(i - 1).is_some_and(|p| p.group == e.group);
            match rank_ops.last_mut() {
                Some(op) if joins => op.len += 1,
                _ => rank_ops.push(Op {
                    first_event: i,
                    len: 1,
                    needs: Vec::new(),
                }),
            }
            of.push(rank_ops.len() - 1);
        }
        op_of.push(of);
        ops.push(rank_ops);
    }
    (ops, op_of)
}

fn build_graph(inst: &Instances, aligned: &Aligned, matches: &Matches) -> Graph {
    let (mut ops, op_of) = group_ops(inst);
    let mut meetings: Vec<Meeting> = Vec::new();
    let mut meeting_of: HashMap<(TeamId, usize), usize> = HashMap::new();
    for (rank, events) in inst.events.iter().enumerate() {
        for (i, e) in events.iter().enumerate() {
            let position = aligned.position[rank][i];
            let at = |q: DeviceId| {
                position
                    .and_then(|k| aligned.event_at(q, e.team, k))
                    .map(|j| (q, op_of[q][j]))
            };
            let op = op_of[rank][i];
            let mut push = |need: Need| ops[rank][op].needs.push(need);
            match e.kind {
                EventKind::CollectivePermute => [e.send_peer, e.recv_peer]
                    .into_iter()
                    .flatten()
                    .filter_map(at)
                    .filter(|&(q, _)| q != rank)
                    .for_each(|(q, j)| push(Need::Peer(q, j))),
                k if k.is_team_collective() => {
                    if let Some(k) = position {
                        let m = *meeting_of.entry((e.team, k)).or_insert_with(|| {
                            meetings.push(Meeting {
                                members: inst.team(e.team).iter().copied().filter_map(at).collect(),
                            });
                            meetings.len() - 1
                        });
                        push(Need::Meeting(m));
                    }
                }
                _ => matches[rank][i]
                    .filter(|&(q, _)| q != rank)
                    .into_iter()
                    .for_each(|(q, j)| push(Need::Peer(q, op_of[q][j]))),
            }
        }
    }
    // Drop repeated needs (a coalescing group lists many), keeping the first occurrence.
    for op in ops.iter_mut().flatten() {
        let mut seen = std::collections::HashSet::with_capacity(op.needs.len());
        op.needs.retain(|n| seen.insert(*n));
    }
    Graph { ops, meetings }
}

/// Simulates all ranks; returns a [`CheckError::Deadlock`] when they get stuck. Expects the
/// sequences and matches to be consistent (run after the other checks pass), so that needs
/// are mutual: when `r`'s op needs `q` at op `j`, `q`'s op `j` needs `r`'s op.
///
/// A set of ops completes together when every rank in it is current at its op and every
/// need of every op in it is a member of the set. Completing one such set never disables
/// another (a rank is current at one op), so the final state does not depend on the order:
/// each time a rank reaches a new op, the set around it is examined once.
pub(crate) fn simulate(
    inst: &Instances,
    aligned: &Aligned,
    matches: &Matches,
) -> Option<CheckError> {
    let graph = build_graph(inst, aligned, matches);
    let (ops, meetings) = (&graph.ops, &graph.meetings);
    let n = ops.len();
    let mut current = vec![0usize; n];
    // Members current at each meeting's op.
    let mut arrived = vec![0usize; meetings.len()];
    let arrive = |r: DeviceId, current: &[usize], arrived: &mut [usize]| {
        if let Some(op) = ops[r].get(current[r]) {
            for need in &op.needs {
                if let Need::Meeting(m) = *need {
                    arrived[m] += 1;
                }
            }
        }
    };
    for r in 0..n {
        arrive(r, &current, &mut arrived);
    }
    let locally_ready = |r: DeviceId, current: &[usize], arrived: &[usize]| {
        ops[r].get(current[r]).is_some_and(|op| {
            op.needs.iter().all(|need| match *need {
                Need::Peer(q, j) => current[q] == j,
                Need::Meeting(m) => arrived[m] == meetings[m].members.len(),
            })
        })
    };
    let mut queue: Vec<DeviceId> = (0..n).rev().collect();
    let mut visited = vec![0u32; n];
    let mut meeting_visited = vec![0u32; meetings.len()];
    let mut stamp = 0u32;
    let mut set: Vec<DeviceId> = Vec::new();
    while let Some(r) = queue.pop() {
        if !locally_ready(r, &current, &arrived) {
            continue;
        }
        // Collect the set of ops around r; give up at the first rank not ready.
        stamp += 1;
        set.clear();
        set.push(r);
        visited[r] = stamp;
        let mut complete = true;
        let mut at = 0;
        while at < set.len() {
            let x = set[at];
            at += 1;
            if !locally_ready(x, &current, &arrived) {
                complete = false;
                break;
            }
            for need in &ops[x][current[x]].needs {
                let mut visit = |q: DeviceId| {
                    if visited[q] != stamp {
                        visited[q] = stamp;
                        set.push(q);
                    }
                };
                match *need {
                    Need::Peer(q, _) => visit(q),
                    Need::Meeting(m) => {
                        if meeting_visited[m] != stamp {
                            meeting_visited[m] = stamp;
                            meetings[m].members.iter().for_each(|&(q, _)| visit(q));
                        }
                    }
                }
            }
        }
        if !complete {
            continue;
        }
        for &x in &set {
            for need in &ops[x][current[x]].needs {
                if let Need::Meeting(m) = *need {
                    arrived[m] -= 1;
                }
            }
            current[x] += 1;
            arrive(x, &current, &mut arrived);
            queue.push(x);
        }
    }
    let stuck = (0..n).any(|r| current[r] < ops[r].len());
    stuck.then(|| deadlock(inst, &graph, &current))
}

fn deadlock(inst: &Instances, graph: &Graph, current: &[usize]) -> CheckError {
    let ops = &graph.ops;
    let mut stuck = Vec::new();
    let mut finished = Vec::new();
    for (rank, rank_ops) in ops.iter().enumerate() {
        let Some(op) = rank_ops.get(current[rank]) else {
            if !rank_ops.is_empty() {
                finished.push(rank);
            }
            continue;
        };
        let e = &inst.events[rank][op.first_event];
        let mut seen = std::collections::HashSet::new();
        let mut waits_for: Vec<DeviceId> = op
            .needs
            .iter()
            .flat_map(|need| match *need {
                Need::Peer(q, j) => vec![(q, j)],
                Need::Meeting(m) => graph.meetings[m].members.clone(),
            })
            .filter(|&(q, j)| q != rank && current[q] != j && seen.insert((q, j)))
            .map(|(q, _)| q)
            .collect();
        waits_for.dedup();
        stuck.push(StuckRank {
            rank,
            site: Site {
                inst: inst.inst(e).clone(),
                at: e.iteration.clone(),
            },
            group_len: op.len,
            waits_for,
        });
    }
    CheckError::Deadlock { stuck, finished }
}
