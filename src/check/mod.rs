//! The cross-rank check: a static deadlock and mismatch checker for host programs.
//!
//! A host program is rank-agnostic: every rank runs the same instructions, with its own values
//! of `my(mesh, pt)` and `rank`. [`check_program`] instantiates the program on every rank of a
//! world, unrolling loops, and checks that the communications of all ranks fit together
//! before anything runs:
//!
//! 1. **Instantiation.** Each rank walks the body with its own values, skipping the
//!    communications whose team it is not in ([`meshflow_ir::Team::resolve`]), and records
//!    one [`CommEvent`] per communication it issues: kind, team, root and peers as device
//!    ids, buffers, loop iteration and coalescing group. Roots and peers must evaluate to a
//!    team index in `0..team size`; every member must hold the buffers its part needs (the
//!    contract of each kind is on [`meshflow_ir::CommKind`]), and a rank that holds every
//!    buffer of a communication must be in its team (except for a `send_recv` or a
//!    `collective_permute` over an explicit list of devices: between overlapping meshes other
//!    devices hold both buffers and rightly stay out of a transfer between two others).
//! 2. **Team sequences.** Every member of a team issues the same sequence of collectives on
//!    it (collective permutes and MoE dispatch/combine included): same kind, root, element
//!    count and dtype, position by position. For a collective permute, the send peers of the
//!    members at the same position form a permutation and each member receives from the
//!    member that sends to it, with equal byte counts.
//! 3. **Point to point.** For `send_recv`, per ordered pair `(src, dst)`, the k-th send from
//!    `src` to `dst` matches the k-th receive at `dst` from `src`, with equal byte counts.
//! 4. **Deadlock.** When 1–3 find nothing (a mismatch already means a hang or garbage), every
//!    rank is simulated with blocking semantics: a collective completes when every team
//!    member has reached it, a collective permute when its send and receive peers have, a
//!    `send_recv` when its matched peer has, and a coalescing group completes as a whole when
//!    all of its parts can (NCCL grouped semantics). Collectives on overlapping teams issued
//!    in inconsistent orders are reported with the instruction, iteration and peers every
//!    stuck rank waits for.
//!
//! 5. **Stream order.** On every rank, every access to a buffer is ordered (by stream
//!    order, `synchronize` or `wait`) after the earlier accesses it conflicts with: a
//!    dropped or misplaced `wait`, or a receive buffer reused before its transfer completes,
//!    is a race naming both instructions and the buffer. Happens-before is symbolic in loop
//!    indices: long periodic loops are folded, not unrolled (see `streams`).
//!
//! Independent errors are all collected; the report lists the first per category and
//! instruction (the same mistake on other ranks or iterations is counted, not repeated), at
//! most [`MAX_ERRORS_PER_CATEGORY`](error::MAX_ERRORS_PER_CATEGORY) per category.

#[doc(hidden)]
mod deadlock;
pub mod error;
pub mod events;
mod instantiate;
mod p2p;
mod sequence;
mod streams;
mod teams;

use std::fmt;

use meshflow_ir::{DeviceId, HostProgram};

pub use error::{CheckError, CheckErrors, RaceAccess, Site, StuckRank};
pub use events::{
    Buffer, CommEvent, Cut, EventKind, InstInfo, Instances, Iteration, Slice, TeamId,
};
pub use instantiate::MAX_INSTANCES;
pub use streams::MAX_STEPS;

/// What a successful check covered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckReport {
    /// The number of ranks.
    pub world_size: usize,
    /// Communications issued per rank.
    pub events_per_rank: Vec<usize>,
    /// The teams that communicate (device ids in team order).
    pub teams: Vec<Vec<DeviceId>>,
    /// Per team, the number of collectives every member issues on it.
    pub collectives_per_team: Vec<usize>,
    /// `send_recv` messages matched.
    pub point_to_point: usize,
    /// Coalescing groups issued, summed over ranks.
    pub groups: usize,
}

impl fmt::Display for CheckReport {
    /// One line; the per-rank communication counts are listed up to 8 ranks, summarized
    /// beyond (`2 to 5 per rank`), so a large world does not print thousands of numbers.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let counts = &self.events_per_rank;
        let total: usize = counts.iter().sum();
        let (lo, hi) = (
            counts.iter().min().copied().unwrap_or(0),
            counts.iter().max().copied().unwrap_or(0),
        );
        let per_rank = if lo == hi {
            format!("{lo} per rank")
        } else if counts.len() <= 8 {
            format!("per rank {counts:?}")
        } else {
            format!("{lo} to {hi} per rank")
        };
        write!(
            f,
            "{} ranks, {total} communications ({per_rank}), {} teams, {} point-to-point \
             messages, {} coalesced groups: no mismatch, no deadlock, no race",
            self.world_size,
            self.teams.len(),
            self.point_to_point,
            self.groups
        )
    }
}

/// Instantiates `host` on ranks `0..world_size` and returns every rank's communication
/// events, or the problems found while instantiating (roots or peers out of range, missing
/// buffers, ...).
pub fn instantiate(host: &HostProgram, world_size: usize) -> Result<Instances, CheckErrors> {
    let (instances, errors) = instantiate::instantiate_all(host, world_size)?;
    if errors.is_empty() {
        Ok(instances)
    } else {
        Err(CheckErrors::capped(errors))
    }
}

/// Checks that the communications of `host` fit together on `world_size` ranks: matching
/// team sequences, matching sends and receives, and no deadlock (see the module docs).
pub fn check_program(host: &HostProgram, world_size: usize) -> Result<CheckReport, CheckErrors> {
    let (instances, mut errors) = instantiate::instantiate_all(host, world_size)?;
    let aligned = sequence::align(&instances);
    errors.extend(sequence::check(&instances, &aligned));
    let (matches, p2p_errors) = p2p::match_send_recv(&instances);
    errors.extend(p2p_errors);
    if errors.is_empty() {
        errors.extend(deadlock::simulate(&instances, &aligned, &matches));
    }
    errors.extend(streams::check(host, world_size));
    if !errors.is_empty() {
        return Err(CheckErrors::capped(errors));
    }
    // One pass over the ranks (not one per team: teams x ranks is quadratic in the world).
    let mut collectives_per_team = vec![0usize; instances.teams.len()];
    for (&TeamId(t), seq) in aligned.seqs.iter().flatten() {
        if let Some(n) = collectives_per_team.get_mut(t) {
            *n = (*n).max(seq.len());
        }
    }
    let groups = instances
        .events
        .iter()
        .map(|events| {
            let mut ids: Vec<u32> = events.iter().filter_map(|e| e.group).collect();
            ids.dedup();
            ids.len()
        })
        .sum();
    let point_to_point = matches
        .iter()
        .zip(&instances.events)
        .map(|(m, events)| {
            m.iter()
                .zip(events)
                .filter(|(m, e)| {
                    m.is_some()
                        && e.send_peer.is_some()
                        && e.kind == EventKind::Collective(meshflow_ir::CommKind::SendRecv)
                })
                .count()
        })
        .sum();
    tracing::debug!(program = %host.name, world_size, "cross-rank check passed");
    Ok(CheckReport {
        world_size,
        events_per_rank: instances.events.iter().map(Vec::len).collect(),
        teams: instances.teams.clone(),
        collectives_per_team,
        point_to_point,
        groups,
    })
}
