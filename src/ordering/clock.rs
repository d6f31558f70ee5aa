//! Vector clocks over the timelines of one rank: its streams and its communication labels.

use std::sync::Arc;

/// Where an operation runs: communication label `l` is timeline `l`, stream `s` is timeline
/// `labels + s` (see [`Clocks`]).
pub type Timeline = usize;

/// True when an operation stamped `epoch` on `timeline` is ordered before whatever holds
/// `clock` (a missing entry is 0).
pub fn ordered(clock: &[u32], timeline: Timeline, epoch: u32) -> bool {
    clock.get(timeline).copied().unwrap_or(0) >= epoch
}

/// Joins `b` into `a` (entry-wise maximum; `a` grows to `b`'s length).
pub fn join_into(a: &mut Vec<u32>, b: &[u32]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, &y) in a.iter_mut().zip(b) {
        *x = (*x).max(y);
    }
}

/// The vector clocks of one rank.
///
/// Every stream has a clock; a compute op on stream `s` ticks `s`'s own entry and is stamped
/// with it. Posting a communication with label `l` on `s` starts instance `n` of `l`: its
/// accesses carry `s`'s clock with entry `l` set to `n`, so they come after everything `s`
/// has seen, and after the label's earlier instances (waiting on the latest instance covers
/// the earlier ones, as the IR's `wait` contract states). `wait` joins an instance's clock
/// into the current stream; `synchronize u` joins `u`'s clock. Streams are numbered from 0
/// and created on first use with an empty clock (a fresh stream has seen nothing).
#[derive(Clone, Debug)]
pub struct Clocks {
    labels: usize,
    streams: Vec<Vec<u32>>,
    instances: Vec<u32>,
}

impl Clocks {
    /// Clocks for a rank whose program has `labels` communication labels.
    pub fn new(labels: usize) -> Clocks {
        Clocks {
            labels,
            streams: Vec::new(),
            instances: vec![0; labels],
        }
    }

    /// The timeline of stream `s`.
    pub fn stream_timeline(&self, s: usize) -> Timeline {
        self.labels + s
    }

    fn stream_mut(&mut self, s: usize) -> &mut Vec<u32> {
        if self.streams.len() <= s {
            self.streams.resize_with(s + 1, Vec::new);
        }
        &mut self.streams[s]
    }

    /// The clock of stream `s`.
    pub fn clock(&self, s: usize) -> &[u32] {
        self.streams.get(s).map_or(&[], Vec::as_slice)
    }

    /// Ticks stream `s` for a new operation; returns its timeline and epoch.
    pub fn tick(&mut self, s: usize) -> (Timeline, u32) {
        let t = self.stream_timeline(s);
        let c = self.stream_mut(s);
        if c.len() <= t {
            c.resize(t + 1, 0);
        }
        c[t] += 1;
        (t, c[t])
    }

    /// Starts a new instance of `label` on stream `s`: returns its clock, whose entry `label`
    /// is the instance's epoch.
    pub fn post(&mut self, s: usize, label: usize) -> Arc<[u32]> {
        let n = match self.instances.get_mut(label) {
            Some(n) => {
                *n += 1;
                *n
            }
            None => 1,
        };
        let mut clock = self.clock(s).to_vec();
        if clock.len() <= label {
            clock.resize(label + 1, 0);
        }
        clock[label] = n;
        clock.into()
    }

    /// Stream `s` waits for `clock`.
    pub fn join(&mut self, s: usize, clock: &[u32]) {
        join_into(self.stream_mut(s), clock);
    }

    /// Stream `s` waits for everything enqueued on `other` so far.
    pub fn sync(&mut self, s: usize, other: usize) {
        if s != other {
            let o = self.clock(other).to_vec();
            self.join(s, &o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posts_are_ordered_by_waits_and_syncs() {
        let mut c = Clocks::new(1);
        let (t, e) = c.tick(1);
        let comm = c.post(1, 0);
        assert!(
            ordered(&comm, t, e),
            "a post comes after its stream's earlier work"
        );
        assert!(!ordered(c.clock(2), 0, comm[0]), "stream 2 has not waited");
        c.join(2, &comm);
        assert!(ordered(c.clock(2), 0, comm[0]) && ordered(c.clock(2), t, e));
        c.sync(3, 2);
        assert!(ordered(c.clock(3), 0, comm[0]));
        let next = c.post(3, 0);
        assert_eq!(next[0], 2, "the second instance of the label");
    }
}
