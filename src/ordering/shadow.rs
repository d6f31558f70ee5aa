//! The accesses of one buffer that later accesses must still be checked against.
//!
//! A [`Shadow`] cuts the buffer's flat element range into runs (a `BTreeMap` from a run's
//! first element to the run). Each run keeps the *frontier* of the accesses that touch it:
//! an access is dropped from a run when a later access covers the run (or the earlier
//! access's whole region), is ordered after it, and writes (or both read). Anything that
//! conflicts with the dropped access also conflicts with the one that replaced it (it is not
//! ordered after the later access either, since the earlier one is ordered before it), so
//! no race is missed.
//!
//! A new access splits at most two runs and visits only the runs inside its flat range, so
//! chunked access patterns (a loop writing chunk `i` of a buffer) cost `O(log runs)` per
//! access instead of a scan of the whole history; a run's frontier holds at most one access
//! per timeline and distinct region, because an access on the same timeline is ordered after
//! the earlier one and replaces it.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::clock::{ordered, Timeline};
use super::region::Region;

/// One access, as checked and recorded.
#[derive(Clone, Debug)]
pub struct Access<'a, S> {
    /// The elements touched.
    pub region: &'a Arc<Region>,
    /// True for a write.
    pub write: bool,
    /// The timeline it runs on.
    pub timeline: Timeline,
    /// Its epoch on that timeline.
    pub epoch: u32,
    /// What it has seen (the vector clock it runs under).
    pub clock: &'a [u32],
    /// What a report says about it.
    pub site: S,
}

/// A recorded access.
#[derive(Clone, Debug)]
pub struct Entry<S> {
    /// The elements touched.
    pub region: Arc<Region>,
    /// True for a write.
    pub write: bool,
    /// The timeline it ran on.
    pub timeline: Timeline,
    /// Its epoch there.
    pub epoch: u32,
    /// What a report says about it.
    pub site: S,
    /// [`Scope::seq`] when it was recorded.
    pub born: u64,
    /// The loop (a [`Scope::active_loops`] id) whose skipped iterations it stands for.
    pub stands_for: Option<u64>,
}

/// Which recorded accesses a new access is checked against, and how it is recorded. The
/// default checks against everything and records a plain access (what a backend's dynamic
/// checker wants); the stream-order check uses the rest to fold long loops.
#[derive(Copy, Clone, Debug, Default)]
pub struct Scope<'a> {
    /// The loops running now: entries standing for their skipped iterations are not checked.
    pub active_loops: &'a [u64],
    /// Check only entries recorded before this sequence number.
    pub born_before: Option<u64>,
    /// The sequence number recorded entries get.
    pub seq: u64,
    /// Recorded entries stand for the skipped iterations of this loop.
    pub stands_for: Option<u64>,
}

impl Scope<'_> {
    fn skips<S>(&self, e: &Entry<S>) -> bool {
        e.stands_for.is_some_and(|l| self.active_loops.contains(&l))
            || self.born_before.is_some_and(|b| e.born >= b)
    }
}

#[derive(Clone, Debug)]
struct Run<S> {
    end: u64,
    entries: Vec<Entry<S>>,
}

/// The access record of one buffer (see the module docs).
#[derive(Clone, Debug)]
pub struct Shadow<S> {
    runs: BTreeMap<u64, Run<S>>,
    work: u64,
}

impl<S> Default for Shadow<S> {
    fn default() -> Shadow<S> {
        Shadow {
            runs: BTreeMap::new(),
            work: 0,
        }
    }
}

impl<S: Clone> Shadow<S> {
    /// An empty record.
    pub fn new() -> Shadow<S> {
        Shadow::default()
    }

    /// Accesses held, summed over runs (an access spanning several runs counts in each).
    pub fn retained(&self) -> usize {
        self.runs.values().map(|r| r.entries.len()).sum()
    }

    /// Runs and recorded accesses visited so far: the checker's work, for tests that bound
    /// it without timing anything.
    pub fn work(&self) -> u64 {
        self.work
    }

    /// Forgets every access (the buffer's earlier work is known to be complete).
    pub fn clear(&mut self) {
        self.runs.clear();
    }

    /// Makes `at` the start of a run if it falls inside one.
    fn split(&mut self, at: u64) {
        let Some((&start, run)) = self.runs.range_mut(..at).next_back() else {
            return;
        };
        if run.end <= at || start == at {
            return;
        }
        let tail = Run {
            end: run.end,
            entries: run.entries.clone(),
        };
        run.end = at;
        self.runs.insert(at, tail);
    }

    /// The first recorded access that `access` conflicts with: they overlap, one of them
    /// writes, and the recorded one is not ordered before `access`.
    pub fn conflict(
        &mut self,
        shape: &[u64],
        access: &Access<'_, S>,
        scope: &Scope<'_>,
    ) -> Option<Entry<S>> {
        let (a, b) = access.region.hull(shape);
        if a >= b {
            return None;
        }
        self.split(a);
        self.split(b);
        for run in self.runs.range(a..b).map(|(_, r)| r) {
            self.work += 1;
            for e in &run.entries {
                self.work += 1;
                if (e.write || access.write)
                    && !scope.skips(e)
                    && !ordered(access.clock, e.timeline, e.epoch)
                    && e.region.overlaps(access.region, shape)
                {
                    return Some(e.clone());
                }
            }
        }
        None
    }

    /// Records `access`, dropping the accesses it supersedes (see the module docs).
    pub fn record(&mut self, shape: &[u64], access: &Access<'_, S>, scope: &Scope<'_>) {
        let (a, b) = access.region.hull(shape);
        if a >= b {
            return;
        }
        self.split(a);
        self.split(b);
        let dense = access.region.is_dense(shape);
        let entry = Entry {
            region: access.region.clone(),
            write: access.write,
            timeline: access.timeline,
            epoch: access.epoch,
            site: access.site.clone(),
            born: scope.seq,
            stands_for: scope.stands_for,
        };
        let starts: Vec<u64> = self.runs.range(a..b).map(|(&s, _)| s).collect();
        let mut cursor = a;
        let mut alone = true;
        for start in starts {
            if cursor < start {
                self.runs.insert(
                    cursor,
                    Run {
                        end: start,
                        entries: vec![entry.clone()],
                    },
                );
            }
            let Some(run) = self.runs.get_mut(&start) else {
                continue;
            };
            self.work += 1;
            let mut work = 0u64;
            if entry.stands_for.is_none() {
                run.entries.retain(|e| {
                    work += 1;
                    let superseded = ordered(access.clock, e.timeline, e.epoch)
                        && (access.write || !e.write)
                        && (dense || access.region.contains(&e.region));
                    !superseded
                });
            }
            self.work += work;
            alone &= run.entries.is_empty();
            run.entries.push(entry.clone());
            cursor = run.end;
        }
        if alone {
            // The access replaced everything in its range: one run again.
            let inside: Vec<u64> = self.runs.range(a..b).map(|(&s, _)| s).collect();
            for s in inside {
                self.runs.remove(&s);
            }
            self.runs.insert(
                a,
                Run {
                    end: b,
                    entries: vec![entry],
                },
            );
        } else if cursor < b {
            self.runs.insert(
                cursor,
                Run {
                    end: b,
                    entries: vec![entry],
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::clock::Clocks;
    use super::super::region::Span;
    use super::*;

    fn rows(lo: u64, hi: u64) -> Arc<Region> {
        Arc::new(Region::Boxed(vec![Span::new(lo, hi), Span::new(0, 4)]))
    }

    #[test]
    fn unordered_writes_conflict_and_ordered_ones_replace_each_other() {
        let shape = [8u64, 4];
        let mut clocks = Clocks::new(0);
        let mut shadow: Shadow<&str> = Shadow::new();
        let scope = Scope::default();
        let (t, e) = clocks.tick(0);
        let first = rows(0, 4);
        let w = Access {
            region: &first,
            write: true,
            timeline: t,
            epoch: e,
            clock: clocks.clock(0),
            site: "first",
        };
        assert!(shadow.conflict(&shape, &w, &scope).is_none());
        shadow.record(&shape, &w, &scope);
        // Stream 1 has not synchronized with stream 0: its read of row 2 races.
        let (t1, e1) = clocks.tick(1);
        let row = rows(2, 3);
        let r = Access {
            region: &row,
            write: false,
            timeline: t1,
            epoch: e1,
            clock: clocks.clock(1),
            site: "read",
        };
        assert_eq!(
            shadow.conflict(&shape, &r, &scope).map(|e| e.site),
            Some("first")
        );
        // The other half is untouched.
        let other = rows(4, 8);
        let r2 = Access {
            region: &other,
            ..r.clone()
        };
        assert!(shadow.conflict(&shape, &r2, &scope).is_none());
        // After a synchronize, stream 1 overwrites rows 0..4: the first write is dropped.
        clocks.sync(1, 0);
        let (t1, e1) = clocks.tick(1);
        let w2 = Access {
            region: &first,
            write: true,
            timeline: t1,
            epoch: e1,
            clock: clocks.clock(1),
            site: "second",
        };
        assert!(shadow.conflict(&shape, &w2, &scope).is_none());
        shadow.record(&shape, &w2, &scope);
        assert_eq!(shadow.retained(), 1);
    }

    #[test]
    fn chunked_writes_visit_one_run_each() {
        let shape = [4096u64, 4];
        let mut clocks = Clocks::new(0);
        let mut shadow: Shadow<u64> = Shadow::new();
        let scope = Scope::default();
        for i in 0..4096u64 {
            let (t, e) = clocks.tick((i % 2) as usize);
            let region = rows(i, i + 1);
            let w = Access {
                region: &region,
                write: true,
                timeline: t,
                epoch: e,
                clock: clocks.clock((i % 2) as usize),
                site: i,
            };
            assert!(shadow.conflict(&shape, &w, &scope).is_none());
            shadow.record(&shape, &w, &scope);
        }
        // Two visits per access (check and record), each of one run with nothing in it.
        assert!(shadow.work() <= 4 * 4096, "work {}", shadow.work());
    }
}
