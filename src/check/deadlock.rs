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

use meshflow_ir::DeviceId;

use super::error::{CheckError, Site, StuckRank};
use super::events::{EventKind, Instances};
use super::p2p::Matches;
use super::sequence::Aligned;

/// One rank's op: its events and the `(rank, op)` pairs it needs to be current elsewhere.
struct Op {
    first_event: usize,
    len: usize,
    needs: Vec<(DeviceId, usize)>,
}

fn build_ops(inst: &Instances, aligned: &Aligned, matches: &Matches) -> Vec<Vec<Op>> {
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
    for (rank, events) in inst.events.iter().enumerate() {
        for (i, e) in events.iter().enumerate() {
            let mut peers: Vec<(DeviceId, usize)> = Vec::new();
            let position = aligned.position[rank][i];
            let at = |q: DeviceId| {
                position
                    .and_then(|k| aligned.event_at(q, e.team, k))
                    .map(|j| (q, j))
            };
            match e.kind {
                EventKind::CollectivePermute => {
                    peers.extend(
                        [e.send_peer, e.recv_peer]
                            .into_iter()
                            .flatten()
                            .filter_map(at),
                    );
                }
                k if k.is_team_collective() => {
                    peers.extend(inst.team(e.team).iter().copied().filter_map(at));
                }
                _ => peers.extend(matches[rank][i]),
            }
            let op = op_of[rank][i];
            for (q, j) in peers {
                if q == rank {
                    continue;
                }
                let need = (q, op_of[q][j]);
                if !ops[rank][op].needs.contains(&need) {
                    ops[rank][op].needs.push(need);
                }
            }
        }
    }
    ops
}

/// Simulates all ranks; returns a [`CheckError::Deadlock`] when they get stuck. Expects the
/// sequences and matches to be consistent (run after the other checks pass).
pub(crate) fn simulate(
    inst: &Instances,
    aligned: &Aligned,
    matches: &Matches,
) -> Option<CheckError> {
    let ops = build_ops(inst, aligned, matches);
    let n = ops.len();
    let mut current = vec![0usize; n];
    let mut ready = vec![false; n];
    loop {
        let mut any_left = false;
        for r in 0..n {
            ready[r] = current[r] < ops[r].len();
            any_left |= ready[r];
        }
        if !any_left {
            return None;
        }
        // Drop ops whose counterparts are not current (or cannot complete) until stable.
        loop {
            let mut changed = false;
            for r in 0..n {
                if ready[r]
                    && !ops[r][current[r]]
                        .needs
                        .iter()
                        .all(|&(q, j)| ready[q] && current[q] == j)
                {
                    ready[r] = false;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        if !ready.iter().any(|&x| x) {
            return Some(deadlock(inst, &ops, &current));
        }
        for r in 0..n {
            if ready[r] {
                current[r] += 1;
            }
        }
    }
}

fn deadlock(inst: &Instances, ops: &[Vec<Op>], current: &[usize]) -> CheckError {
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
        let mut waits_for: Vec<DeviceId> = op
            .needs
            .iter()
            .filter(|&&(q, j)| current[q] != j)
            .map(|&(q, _)| q)
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
