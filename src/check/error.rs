//! The errors of the cross-rank check.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use meshflow_ir::host::EvalError;
use meshflow_ir::DeviceId;

use super::events::{InstInfo, Iteration};

/// At most this many errors of one category are listed; the rest are counted.
pub const MAX_ERRORS_PER_CATEGORY: usize = 5;

/// Where a rank issued a communication: the instruction and the loop iteration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// The instruction.
    pub inst: InstInfo,
    /// The iteration.
    pub at: Iteration,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.inst, self.at)
    }
}

/// One side of a [`CheckError::Race`]: the instruction, its iteration and what it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceAccess {
    /// The instruction and iteration.
    pub site: Site,
    /// What it does: ``writes `ag_chunk` as communication c0``, ``reads `y` on stream main``.
    pub access: String,
}

impl fmt::Display for RaceAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.site, self.access)
    }
}

/// A rank that cannot progress, in a [`CheckError::Deadlock`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StuckRank {
    /// The rank.
    pub rank: DeviceId,
    /// Where it is blocked (the first communication of its current group).
    pub site: Site,
    /// How many communications its current coalescing group holds (1 outside groups).
    pub group_len: usize,
    /// The ranks it waits for.
    pub waits_for: Vec<DeviceId>,
}

impl fmt::Display for StuckRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} waits in {}", self.rank, self.site)?;
        if self.group_len > 1 {
            write!(f, " (coalesced with {} more)", self.group_len - 1)?;
        }
        match self.waits_for.as_slice() {
            [] => f.write_str(" for peers that are not ready"),
            [one] => write!(f, " for rank {one}"),
            many => write!(f, " for ranks {many:?}"),
        }
    }
}

/// One problem found by the cross-rank check.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// A mesh or team names a device outside `0..world_size`.
    #[error("{what} names device {device}, but the world has only {world_size} ranks")]
    WorldTooSmall {
        /// The mesh or instruction.
        what: String,
        /// The device.
        device: DeviceId,
        /// The world size checked.
        world_size: usize,
    },
    /// Instantiation would unroll too many loop iterations and communications.
    #[error(
        "instantiating the program on {world_size} ranks exceeds {limit} loop iterations and \
         communications; loop bounds too large to check"
    )]
    TooManyInstances {
        /// The world size checked.
        world_size: usize,
        /// The cap.
        limit: usize,
    },
    /// A scalar expression could not be evaluated on a rank.
    #[error("rank {rank}: cannot evaluate the {what} of {site}: {error}")]
    Eval {
        /// The rank.
        rank: DeviceId,
        /// Which expression (`loop bounds`, `root`, `send peer`, `recv peer`).
        what: &'static str,
        /// The instruction and iteration.
        site: Site,
        /// Why.
        error: EvalError,
    },
    /// A root or peer evaluates outside `0..team size`.
    #[error("rank {rank}: {what} {value} of {site} is out of range for team {team:?} of size {}", team.len())]
    OutOfRange {
        /// The rank.
        rank: DeviceId,
        /// `root`, `send peer` or `recv peer`.
        what: &'static str,
        /// The value.
        value: i64,
        /// The team (device ids).
        team: Vec<DeviceId>,
        /// The instruction and iteration.
        site: Site,
    },
    /// A malformed communication (coalescing structure, `send_recv` team size, ...).
    #[error("rank {rank}: {site}: {detail}")]
    Malformed {
        /// The rank.
        rank: DeviceId,
        /// The instruction and iteration.
        site: Site,
        /// What is wrong.
        detail: String,
    },
    /// A team member does not hold a buffer its part of a communication needs.
    #[error(
        "rank {rank} takes part in {site} (team {team:?}) but does not hold its {role} buffer \
         `{tensor}` (on mesh `{mesh}`)"
    )]
    MissingBuffer {
        /// The rank.
        rank: DeviceId,
        /// The instruction and iteration.
        site: Site,
        /// The team.
        team: Vec<DeviceId>,
        /// `send` or `receive`.
        role: &'static str,
        /// The tensor's name.
        tensor: String,
        /// Its mesh's name.
        mesh: String,
    },
    /// A rank holds every buffer of a communication but is not in its team, so it skips it.
    #[error(
        "rank {rank} holds every buffer of {site} but is not in its team {team:?}: the \
         communication is skipped on rank {rank}"
    )]
    NotInTeam {
        /// The rank.
        rank: DeviceId,
        /// The instruction and iteration.
        site: Site,
        /// The team as resolved from its members.
        team: Vec<DeviceId>,
    },
    /// A rank's send and receive buffers violate the communication's contract.
    #[error("rank {rank}: {site}: {detail}")]
    BufferContract {
        /// The rank.
        rank: DeviceId,
        /// The instruction and iteration.
        site: Site,
        /// What is wrong.
        detail: String,
    },
    /// Two members of a team issue different collectives at the same position.
    #[error(
        "ranks {rank_a} and {rank_b} disagree on collective #{index} of team {team:?}: rank \
         {rank_a} issues {site_a}, rank {rank_b} issues {site_b} ({difference})"
    )]
    SequenceMismatch {
        /// The team.
        team: Vec<DeviceId>,
        /// Position in the team's sequence (0-based).
        index: usize,
        /// The reference member.
        rank_a: DeviceId,
        /// Its collective.
        site_a: Site,
        /// The member that disagrees.
        rank_b: DeviceId,
        /// Its collective.
        site_b: Site,
        /// What differs, e.g. `root 0 vs 1`.
        difference: String,
    },
    /// A member of a team issues fewer collectives on it than another member.
    #[error(
        "collective #{index} of team {team:?} is issued by rank {rank_a} ({site_a}) but never by \
         rank {rank_b}, which issues only {count_b} collective(s) on that team"
    )]
    MissingCollective {
        /// The team.
        team: Vec<DeviceId>,
        /// Position in the team's sequence (0-based).
        index: usize,
        /// A member that issues it.
        rank_a: DeviceId,
        /// Its collective.
        site_a: Site,
        /// The member that does not.
        rank_b: DeviceId,
        /// How many collectives `rank_b` issues on the team.
        count_b: usize,
    },
    /// Several members of a collective permute send to the same member.
    #[error(
        "{site} on team {team:?} is not a permutation: ranks {senders:?} all send to rank {target}"
    )]
    NotAPermutation {
        /// The instruction and iteration (of the first sender).
        site: Site,
        /// The team.
        team: Vec<DeviceId>,
        /// The member receiving several sends.
        target: DeviceId,
        /// The senders.
        senders: Vec<DeviceId>,
    },
    /// In a collective permute, a member expects to receive from a peer that sends elsewhere.
    #[error(
        "in {site}, rank {rank} expects to receive from rank {recv_peer}, but rank {recv_peer} \
         sends to rank {peer_sends_to}"
    )]
    PeerMismatch {
        /// The instruction and iteration.
        site: Site,
        /// The receiving rank.
        rank: DeviceId,
        /// Whom it receives from.
        recv_peer: DeviceId,
        /// Whom that peer sends to.
        peer_sends_to: DeviceId,
    },
    /// A send and its matching receive disagree on the byte count.
    #[error(
        "rank {src} sends {send_bytes} bytes to rank {dst} in {send_site}, but the matching \
         receive on rank {dst} in {recv_site} expects {recv_bytes} bytes"
    )]
    SizeMismatch {
        /// The sender.
        src: DeviceId,
        /// The receiver.
        dst: DeviceId,
        /// The send.
        send_site: Site,
        /// Bytes sent.
        send_bytes: u64,
        /// The receive.
        recv_site: Site,
        /// Bytes expected.
        recv_bytes: u64,
    },
    /// A send with no matching receive.
    #[error(
        "unmatched send: rank {src} sends to rank {dst} in {site} (message #{index} from {src} \
         to {dst}), but rank {dst} receives only {received} message(s) from rank {src}"
    )]
    UnmatchedSend {
        /// The sender.
        src: DeviceId,
        /// The receiver.
        dst: DeviceId,
        /// The send.
        site: Site,
        /// Position among the sends from `src` to `dst` (0-based).
        index: usize,
        /// How many receives from `src` the receiver posts.
        received: usize,
    },
    /// A receive with no matching send.
    #[error(
        "unmatched receive: rank {dst} receives from rank {src} in {site} (message #{index} from \
         {src} to {dst}), but rank {src} sends only {sent} message(s) to rank {dst}"
    )]
    UnmatchedRecv {
        /// The sender.
        src: DeviceId,
        /// The receiver.
        dst: DeviceId,
        /// The receive.
        site: Site,
        /// Position among the receives at `dst` from `src` (0-based).
        index: usize,
        /// How many sends to `dst` the sender posts.
        sent: usize,
    },
    /// No rank can progress although some have not finished.
    #[error(
        "deadlock: no rank can make progress; {}{}",
        list_stuck(stuck),
        list_finished(finished)
    )]
    Deadlock {
        /// Every rank that has not finished.
        stuck: Vec<StuckRank>,
        /// The ranks that finished.
        finished: Vec<DeviceId>,
    },
    /// Two accesses of one buffer on one rank that no stream order, `synchronize` or `wait`
    /// orders: a communication or compute on another stream may still touch the elements.
    #[error(
        "rank {rank}: race on buffer `{buffer}`: {earlier}, and {later}, with nothing ordering \
         them: {fix}"
    )]
    Race {
        /// The rank.
        rank: DeviceId,
        /// The buffer (the tensor it was allocated for).
        buffer: String,
        /// The access made first in program order.
        earlier: RaceAccess,
        /// The access that may overlap it.
        later: RaceAccess,
        /// What would order them.
        fix: String,
    },
    /// The stream-order analysis would take too many steps.
    #[error(
        "checking stream order on {world_size} ranks exceeds {limit} steps: loops too large to \
         check (a loop folds when its stream choices and chunk indices repeat with a period)"
    )]
    OrderTooLarge {
        /// The world size checked.
        world_size: usize,
        /// The cap.
        limit: usize,
    },
    /// Errors of one category left out of the report.
    #[error(
        "... and {count} more error(s) of kind `{category}` (the same mistake on other ranks or \
         iterations, or past the first {MAX_ERRORS_PER_CATEGORY})"
    )]
    More {
        /// The category.
        category: &'static str,
        /// How many were left out.
        count: usize,
    },
}

fn list_stuck(stuck: &[StuckRank]) -> String {
    const SHOWN: usize = 8;
    let mut parts: Vec<String> = stuck.iter().take(SHOWN).map(|s| s.to_string()).collect();
    if stuck.len() > SHOWN {
        parts.push(format!("and {} more stuck ranks", stuck.len() - SHOWN));
    }
    parts.join("; ")
}

fn list_finished(finished: &[DeviceId]) -> String {
    if finished.is_empty() {
        String::new()
    } else {
        format!(" (finished: ranks {finished:?})")
    }
}

impl CheckError {
    /// A short name of the error's category, used to cap the report.
    pub fn category(&self) -> &'static str {
        match self {
            CheckError::WorldTooSmall { .. } => "world too small",
            CheckError::TooManyInstances { .. } => "too many instances",
            CheckError::Eval { .. } => "evaluation",
            CheckError::OutOfRange { .. } => "out of range",
            CheckError::Malformed { .. } => "malformed",
            CheckError::MissingBuffer { .. } => "missing buffer",
            CheckError::NotInTeam { .. } => "not in team",
            CheckError::BufferContract { .. } => "buffer contract",
            CheckError::SequenceMismatch { .. } => "sequence mismatch",
            CheckError::MissingCollective { .. } => "missing collective",
            CheckError::NotAPermutation { .. } => "not a permutation",
            CheckError::PeerMismatch { .. } => "peer mismatch",
            CheckError::SizeMismatch { .. } => "size mismatch",
            CheckError::UnmatchedSend { .. } => "unmatched send",
            CheckError::UnmatchedRecv { .. } => "unmatched receive",
            CheckError::Deadlock { .. } => "deadlock",
            CheckError::Race { .. } => "race",
            CheckError::OrderTooLarge { .. } => "stream order too large",
            CheckError::More { .. } => "more",
        }
    }

    /// The text of the instruction the error is about, if any.
    pub fn primary_inst(&self) -> Option<&str> {
        let site = match self {
            CheckError::Eval { site, .. }
            | CheckError::OutOfRange { site, .. }
            | CheckError::Malformed { site, .. }
            | CheckError::MissingBuffer { site, .. }
            | CheckError::NotInTeam { site, .. }
            | CheckError::BufferContract { site, .. }
            | CheckError::NotAPermutation { site, .. }
            | CheckError::PeerMismatch { site, .. }
            | CheckError::UnmatchedSend { site, .. }
            | CheckError::UnmatchedRecv { site, .. } => site,
            CheckError::SizeMismatch { send_site, .. } => send_site,
            CheckError::SequenceMismatch { site_b, .. } => site_b,
            CheckError::MissingCollective { site_a, .. } => site_a,
            CheckError::Race { later, .. } => &later.site,
            CheckError::WorldTooSmall { .. }
            | CheckError::TooManyInstances { .. }
            | CheckError::Deadlock { .. }
            | CheckError::OrderTooLarge { .. }
            | CheckError::More { .. } => return None,
        };
        Some(&site.inst.text)
    }
}

/// Every problem the cross-rank check found: the first per category and instruction, at most
/// [`MAX_ERRORS_PER_CATEGORY`] per category, then a [`CheckError::More`] count.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct CheckErrors {
    /// The errors, in the order found.
    pub errors: Vec<CheckError>,
}

impl CheckErrors {
    /// Keeps the first error per category and instruction (the same mistake on other ranks
    /// or iterations is counted, not listed) and at most [`MAX_ERRORS_PER_CATEGORY`] per
    /// category, appending a [`CheckError::More`] count per category.
    pub(crate) fn capped(errors: Vec<CheckError>) -> CheckErrors {
        let mut kept_per_category: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut left_out: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut seen: HashSet<(&'static str, String)> = HashSet::new();
        let mut kept = Vec::new();
        for error in errors {
            let category = error.category();
            let first_at_inst = match error.primary_inst() {
                Some(text) => seen.insert((category, text.to_string())),
                None => true,
            };
            let n = kept_per_category.entry(category).or_insert(0);
            if first_at_inst && *n < MAX_ERRORS_PER_CATEGORY {
                *n += 1;
                kept.push(error);
            } else {
                *left_out.entry(category).or_insert(0) += 1;
            }
        }
        kept.extend(
            left_out
                .into_iter()
                .map(|(category, count)| CheckError::More { category, count }),
        );
        CheckErrors { errors: kept }
    }
}

impl fmt::Display for CheckErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.errors.as_slice() {
            [one] => write!(f, "cross-rank check failed: {one}"),
            all => {
                write!(f, "cross-rank check failed with {} errors:", all.len())?;
                for e in all {
                    write!(f, "\n  - {e}")?;
                }
                Ok(())
            }
        }
    }
}
