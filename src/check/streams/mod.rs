//! Stream order: every access to a buffer is ordered after the accesses it conflicts with.
//!
//! A rank runs its compute on streams and its communications asynchronously; only stream
//! order, `synchronize` (an event) and `wait` order them. This check proves, per rank and
//! before anything runs, that no access touches elements that a communication or compute on
//! another stream may still read or write: the static counterpart of the CPU backend's
//! dynamic race checker, with the same happens-before relation, so a program it accepts runs
//! race-free on that backend at any stream-pool size.
//!
//! # The relation
//!
//! Every rank is walked on its own values of `my(..)`, loop bounds, stream choices and chunk
//! indices ([`walk`]). Its happens-before relation is kept as vector clocks over *timelines*
//! ([`Clocks`](crate::ordering::Clocks)): one per stream (`main` and every distinct
//! `worker(k)`; distinct worker numbers are distinct streams, the strictest reading, since
//! a pool that maps two of them to one stream only adds order) and one per communication
//! label. A compute op ticks its stream; a communication posted on stream `s` starts an
//! instance of its label that has seen what `s` has seen (and the label's earlier instances:
//! waiting on the latest covers them, the IR's `wait` contract); `wait c` joins the latest
//! instance of `c` into the current stream, a coalescing group's label joins all its
//! members, and `synchronize u` joins stream `u`. Each buffer keeps the frontier of its
//! accesses not yet superseded ([`Shadow`](crate::ordering::Shadow)); an access that
//! overlaps a recorded one, with one of them writing, while not ordered after it, is a
//! race: both instructions (text, line, iteration, stream or label) and the buffer are
//! named, with the `wait` or `synchronize` that would order them.
//!
//! # Loops, symbolically
//!
//! Loops are not unrolled when they are long. A loop of more than 64 iterations whose body
//! has no inner loop *folds* when its stream choices are periodic in the loop index `i` and
//! its chunk indices are periodic or translate with `i` ([`fold`]: every `i` under a `% m`,
//! or `a * i + b` plus such terms, as the index simplifier's canonical forms are). Let `P` be
//! the least common multiple of the moduli: iteration `j + P` then does what iteration `j`
//! does, with its translated chunks moved by a fixed step. The walk evaluates the first two
//! periods to find each access's step, and folds only if every access to a buffer whose
//! chunks translate moves by the same step (or spans the whole axis), so that whether two
//! accesses `d` iterations apart overlap depends on `d` and `j mod P` only. Then:
//!
//! - *Happens-before settles.* Which timelines have seen a given access grows
//!   monotonically over the streams (at most once per stream) and, between growths, repeats
//!   with the period; after `S = (streams + 2) * P` iterations nothing changes. So the
//!   relation between iteration `j` and `j + d` is the same for every `d >= S` of one class
//!   modulo `P`, and the same for every `j` of one class (shifting a pair by `P` changes
//!   nothing).
//! - *The walk* records the first `S + P + R` iterations (`R`: how far apart translated
//!   chunks can meet), then runs `S` iterations that only move the clocks, skips a whole
//!   number of periods, and records the last `S + P`. Every pair of accesses inside the loop
//!   has a shifted twin inside the first window; pairs that straddle the skipped middle are
//!   `S` apart or more, so their order is the settled one.
//! - *The skipped chunks* are not lost: at the last period of the first window, an access
//!   that translates is also checked, as a periodic span standing for its class's skipped
//!   chunks ([`Span::periodic`](crate::ordering::Span::periodic)), against what preceded the
//!   loop (the earliest skipped instance has seen no less than this one); at the first
//!   period of the last window it is recorded with that span for what follows the loop (the
//!   latest skipped instance has seen no more than this one).
//!
//! A 40000-iteration chunked all-reduce loop is so walked in about 40 iterations. Loops that
//! do not fold (short ones, nested bodies, irregular indices such as `i / 2`) are unrolled;
//! the whole walk is capped at [`MAX_STEPS`] instructions over all ranks. Ranks that see the
//! same meshes, teams and `my(..)` values walk identically and are walked once.

mod fold;
mod prog;
mod walk;

use std::collections::{HashMap, HashSet};

use meshflow_ir::host::EvalError;
use meshflow_ir::text::inst_to_string;
use meshflow_ir::{Arena, DeviceId, EntityRef, HostProgram, LoopVar, Team};

use super::error::{CheckError, RaceAccess, Site};
use super::events::{InstInfo, Iteration};
use crate::runtime::backend::PreorderIndex;
use prog::{Item, Prog};
use walk::{At, Walker};

/// The most instructions the stream-order walk executes, summed over ranks.
pub const MAX_STEPS: usize = 20_000_000;

/// The walk ran out of steps.
struct TooLarge;

/// One rank's view of the program: its team indices, meshes and tensors.
struct Rank {
    pub device: DeviceId,
    pub my: Vec<[Option<i64>; 3]>,
    /// Per mesh, the rank's flat position in it.
    pub flat: Vec<Option<usize>>,
    pub in_mesh: Vec<bool>,
    pub held: Vec<bool>,
}

/// What the walks found.
struct Findings {
    errors: Vec<CheckError>,
    reported: HashSet<(PreorderIndex, PreorderIndex)>,
    eval_reported: HashSet<(PreorderIndex, &'static str)>,
    budget: usize,
    /// Fold long loops (off only in tests that compare with the unrolled walk).
    fold: bool,
    /// Each instruction's text and source location, by pre-order position.
    insts: Arena<PreorderIndex, (String, meshflow_ir::SourceLoc)>,
    labels: Vec<String>,
    group_of: Vec<Option<usize>>,
    tensor_names: Vec<String>,
}

impl Findings {
    fn spend(&mut self) -> Result<(), TooLarge> {
        if self.budget == 0 {
            return Err(TooLarge);
        }
        self.budget -= 1;
        Ok(())
    }

    fn site(&mut self, ord: PreorderIndex, iteration: &[(LoopVar, i64)]) -> Site {
        let (text, loc) = self
            .insts
            .get(ord)
            .cloned()
            .unwrap_or_else(|| (String::new(), meshflow_ir::SourceLoc::NONE));
        Site {
            inst: InstInfo { text, loc },
            at: Iteration(iteration.to_vec()),
        }
    }

    fn eval_error(
        &mut self,
        rank: DeviceId,
        ord: PreorderIndex,
        what: &'static str,
        iteration: std::sync::Arc<[(LoopVar, i64)]>,
        error: EvalError,
    ) {
        if self.eval_reported.insert((ord, what)) {
            let site = self.site(ord, &iteration);
            self.errors.push(CheckError::Eval {
                rank,
                what,
                site,
                error,
            });
        }
    }

    fn stream_name(&self, s: Option<i64>) -> String {
        match s {
            Some(w) => format!("worker({w})"),
            None => "main".to_string(),
        }
    }

    fn describe(&mut self, a: &At) -> RaceAccess {
        let site = self.site(a.ord, &a.iteration);
        let tensor = self.tensor_names.get(a.tensor).cloned().unwrap_or_default();
        let verb = if a.write { "writes" } else { "reads" };
        let by = match a.label {
            Some(l) => format!(
                "as communication {} (posted on stream {})",
                self.labels.get(l).cloned().unwrap_or_default(),
                self.stream_name(a.stream)
            ),
            None => format!("on stream {}", self.stream_name(a.stream)),
        };
        let standing = match a.stands_for {
            Some((var, p, last)) => {
                format!(" (and in every {p}th iteration up to {var}={last}, which the check folds)")
            }
            None => String::new(),
        };
        RaceAccess {
            site,
            access: format!("{verb} `{tensor}` {by}{standing}"),
        }
    }

    fn fix(&self, earlier: &At, later: &At) -> String {
        let label = |l: usize| self.labels.get(l).cloned().unwrap_or_default();
        match earlier.label {
            Some(l) => match self.group_of.get(l).copied().flatten() {
                Some(g) => format!(
                    "missing `wait {}` (the coalescing group of {}) before the later instruction",
                    label(g),
                    label(l)
                ),
                None => format!("missing `wait {}` before the later instruction", label(l)),
            },
            None if later.label.is_some() => format!(
                "missing `synchronize {}` before the communication is posted",
                self.stream_name(earlier.stream)
            ),
            None => format!(
                "missing `synchronize {}` on stream {} before the later instruction",
                self.stream_name(earlier.stream),
                self.stream_name(later.stream)
            ),
        }
    }

    /// Reports a race on `rank` (the first per pair of instructions).
    fn race(&mut self, rank: DeviceId, buffer: usize, earlier: At, later: At) {
        if !self.reported.insert((earlier.ord, later.ord)) {
            return;
        }
        let fix = self.fix(&earlier, &later);
        let (earlier, later) = (self.describe(&earlier), self.describe(&later));
        let buffer = self.tensor_names.get(buffer).cloned().unwrap_or_default();
        self.errors.push(CheckError::Race {
            rank,
            buffer,
            earlier,
            later,
            fix,
        });
    }
}

/// Per mesh, each device's flat position.
fn positions(host: &HostProgram) -> Vec<HashMap<DeviceId, usize>> {
    host.meshes
        .values()
        .map(|d| {
            d.mesh
                .devices()
                .iter()
                .enumerate()
                .map(|(i, &dev)| (dev, i))
                .collect()
        })
        .collect()
}

fn rank_view(host: &HostProgram, pos: &[HashMap<DeviceId, usize>], device: DeviceId) -> Rank {
    let mut my = Vec::with_capacity(pos.len());
    let mut in_mesh = Vec::with_capacity(pos.len());
    let mut flats = Vec::with_capacity(pos.len());
    for (decl, p) in host.meshes.values().zip(pos) {
        let mut row = [None; 3];
        let flat = p.get(&device).copied();
        if let Some(mut flat) = flat {
            let shape = decl.mesh.shape();
            let mut coords = vec![0usize; shape.len()];
            for k in (0..shape.len()).rev() {
                let e = shape[k].max(1);
                coords[k] = flat % e;
                flat /= e;
            }
            for (k, pt) in meshflow_ir::ParallelType::DEVICE.iter().enumerate() {
                if let Some(axis) = decl.mesh.axis_of(*pt) {
                    row[k] = coords.get(axis).map(|&c| c as i64);
                }
            }
        }
        my.push(row);
        in_mesh.push(flat.is_some());
        flats.push(p.get(&device).copied());
    }
    let held = host
        .tensors
        .values()
        .map(|t| in_mesh.get(t.mesh.index()).copied().unwrap_or(false))
        .collect();
    Rank {
        device,
        my,
        flat: flats,
        in_mesh,
        held,
    }
}

/// A rank's index in `team` (`my` and `flat`: its team indices and positions per mesh).
fn team_index(
    host: &HostProgram,
    rank: DeviceId,
    my: &[[Option<i64>; 3]],
    flat: &[Option<usize>],
    team: &Team,
) -> Option<i64> {
    match team {
        Team::Devices(d) => d.iter().position(|&x| x == rank).map(|p| p as i64),
        Team::Mesh(m) => flat.get(m.index()).copied().flatten().map(|p| p as i64),
        Team::Slice { mesh, pt } => my.get(mesh.index())?[pt.device_rank()?],
        Team::Flattened { mesh, pts } => {
            // Row-major over the listed axes (outermost first).
            let decl = host.meshes.get(*mesh)?;
            let row = my.get(mesh.index())?;
            pts.iter().try_fold(0i64, |acc, pt| {
                let size = decl.mesh.size_of(*pt)? as i64;
                Some(acc * size + row[pt.device_rank()?]?)
            })
        }
    }
}

/// The teams whose membership, or the rank's index in which, a walk depends on: explicit
/// device lists, and the teams of rooted collectives.
fn rank_teams<'h>(items: &[Item<'h>], out: &mut Vec<&'h Team>) {
    for item in items {
        match item {
            Item::Loop { body, .. } => rank_teams(body, out),
            Item::Comm {
                team, collective, ..
            } if matches!(team, Team::Devices(_))
                || collective.is_some_and(|(_, root)| root.is_some()) =>
            {
                out.push(team)
            }
            _ => {}
        }
    }
}

fn has_order(items: &[Item<'_>]) -> bool {
    items.iter().any(|n| match n {
        Item::Loop { body, .. } => has_order(body),
        Item::Comm { .. } | Item::SetStream { .. } => true,
        _ => false,
    })
}

/// Checks the stream order of `host` on every rank of a world of `world_size`.
pub(crate) fn check(host: &HostProgram, world_size: usize) -> Vec<CheckError> {
    walk_ranks(host, world_size, true).0
}

/// [`check`], folding long loops or not; also returns the instructions walked.
fn walk_ranks(host: &HostProgram, world_size: usize, fold: bool) -> (Vec<CheckError>, usize) {
    let prog = Prog::new(host);
    // With one stream and no communication, program order is the only order.
    if !has_order(&prog.items) {
        return (Vec::new(), 0);
    }
    let mut findings = Findings {
        errors: Vec::new(),
        reported: HashSet::new(),
        eval_reported: HashSet::new(),
        budget: MAX_STEPS,
        fold,
        insts: prog
            .insts
            .values()
            .map(|i| (inst_to_string(host, i), i.loc))
            .collect(),
        labels: prog.labels.iter().map(|c| c.to_string()).collect(),
        group_of: prog.group_of.clone(),
        tensor_names: host.tensors.values().map(|t| t.name.clone()).collect(),
    };
    let pos = positions(host);
    let mut teams = Vec::new();
    rank_teams(&prog.items, &mut teams);
    // What a rank's walk depends on: its meshes, its place in explicit and rooted teams,
    // its `my(..)` values (and its id, when an expression reads `rank`).
    type Signature = (
        Vec<bool>,
        Vec<Option<i64>>,
        Vec<Option<i64>>,
        Option<DeviceId>,
    );
    let mut walked: HashSet<Signature> = HashSet::new();
    for device in 0..world_size {
        let rank = rank_view(host, &pos, device);
        let my_used = prog
            .my_used
            .iter()
            .map(|(m, pt)| {
                let row = rank.my.get(m.index())?;
                row[pt.device_rank()?]
            })
            .collect();
        let members = teams
            .iter()
            .map(|t| team_index(host, device, &rank.my, &rank.flat, t))
            .collect();
        let own = prog.uses_rank.then_some(device);
        if !walked.insert((rank.in_mesh.clone(), members, my_used, own)) {
            continue;
        }
        if Walker::new(&prog, &rank, &mut findings).run().is_err() {
            findings.errors.push(CheckError::OrderTooLarge {
                world_size,
                limit: MAX_STEPS,
            });
            break;
        }
    }
    (findings.errors, MAX_STEPS - findings.budget)
}

#[cfg(test)]
mod tests;
