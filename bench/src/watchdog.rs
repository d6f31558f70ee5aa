//! A watchdog over the rank threads of a measurement: a rank that makes no progress for too
//! long ends the case as an error naming what it was doing (case, program, phase), never as a
//! hang.
//!
//! Every rank thread records what it starts ([`Progress::at`]); the thread that started them
//! waits in [`watch`]. When one rank has been at the same thing for longer than the limit, the
//! caller's `on_stall` aborts the case (the abort signal and the rendezvous end every wait of
//! meshflow's own). A thread blocked where no abort reaches (a host call inside NCCL waiting
//! for a peer that will not come) may still not return: after a grace period [`watch`] gives
//! up on it and says so, and the caller ends the process with that message.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What each watched thread is doing, and since when.
#[derive(Debug)]
pub(crate) struct Progress {
    slots: Mutex<Vec<Slot>>,
}

#[derive(Debug)]
struct Slot {
    what: String,
    since: Instant,
    done: bool,
}

/// A thread that made no progress: its slot, what it was doing and for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stall {
    pub slot: usize,
    pub what: String,
    pub waited: Duration,
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: no progress for {:.0} s",
            self.what,
            self.waited.as_secs_f64()
        )
    }
}

impl Progress {
    /// `n` threads, each starting.
    pub(crate) fn new(n: usize) -> Progress {
        let now = Instant::now();
        let slots = (0..n)
            .map(|_| Slot {
                what: "starting".into(),
                since: now,
                done: false,
            })
            .collect();
        Progress {
            slots: Mutex::new(slots),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Thread `slot` starts `what` now.
    pub(crate) fn at(&self, slot: usize, what: impl Into<String>) {
        if let Some(s) = self.slots().get_mut(slot) {
            s.what = what.into();
            s.since = Instant::now();
        }
    }

    /// Thread `slot` is done (never stalled).
    pub(crate) fn done(&self, slot: usize) {
        if let Some(s) = self.slots().get_mut(slot) {
            s.done = true;
        }
    }

    /// The thread at the same thing for longest, when longer than `limit`.
    fn stalled(&self, limit: Duration) -> Option<Stall> {
        self.slots()
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.done)
            .map(|(slot, s)| Stall {
                slot,
                what: s.what.clone(),
                waited: s.since.elapsed(),
            })
            .filter(|s| s.waited > limit)
            .max_by_key(|s| s.waited)
    }
}

/// Waits until `finished()`. A thread at one thing for longer than `limit` is reported once to
/// `on_stall` (which should abort the run); if the threads have still not finished `grace`
/// later, gives up: `Err` with the stall (the threads are blocked where no abort reaches).
pub(crate) fn watch(
    progress: &Progress,
    limit: Duration,
    grace: Duration,
    finished: impl Fn() -> bool,
    on_stall: impl FnOnce(&Stall),
) -> Result<(), Stall> {
    let mut on_stall = Some(on_stall);
    let mut reported: Option<(Stall, Instant)> = None;
    while !finished() {
        std::thread::sleep(Duration::from_millis(50));
        match &reported {
            None => {
                if let Some(s) = progress.stalled(limit) {
                    if let Some(f) = on_stall.take() {
                        f(&s);
                    }
                    reported = Some((s, Instant::now()));
                }
            }
            Some((s, at)) => {
                if at.elapsed() > grace && !finished() {
                    return Err(s.clone());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;

    #[test]
    fn threads_that_progress_finish_unreported() {
        let p = Progress::new(2);
        let stalls = Mutex::new(Vec::new());
        let r = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|slot| {
                    let p = &p;
                    s.spawn(move || {
                        for i in 0..5 {
                            p.at(slot, format!("step {i}"));
                        }
                        p.done(slot);
                    })
                })
                .collect();
            watch(
                &p,
                Duration::from_secs(600),
                Duration::from_secs(600),
                || hs.iter().all(|h| h.is_finished()),
                |s| stalls.lock().unwrap().push(s.clone()),
            )
        });
        assert_eq!(r, Ok(()));
        assert!(stalls.lock().unwrap().is_empty());
    }

    /// A thread that waits until aborted: reported once, naming what it was at, and then
    /// returns (the abort reached it).
    #[test]
    fn a_stalled_thread_is_reported_with_what_it_was_doing() {
        let p = Progress::new(2);
        let aborted = AtomicBool::new(false);
        let mut seen = Vec::new();
        let r = std::thread::scope(|s| {
            let p = &p;
            let aborted = &aborted;
            let quick = s.spawn(move || {
                p.at(0, "rank 0: case: variant: check run");
                p.done(0);
            });
            let stuck = s.spawn(move || {
                p.at(1, "rank 1: case: variant: check run");
                while !aborted.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
            });
            watch(
                p,
                Duration::from_millis(20),
                Duration::from_secs(600),
                || quick.is_finished() && stuck.is_finished(),
                |st| {
                    seen.push(st.clone());
                    aborted.store(true, Ordering::SeqCst);
                },
            )
        });
        assert_eq!(r, Ok(()));
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].slot, 1);
        assert!(seen[0]
            .to_string()
            .starts_with("rank 1: case: variant: check run"));
    }

    /// A thread that no abort reaches: the watchdog gives up on it with the stall.
    #[test]
    fn a_thread_no_abort_reaches_ends_the_watch_with_the_stall() {
        let p = Progress::new(1);
        let (release, wait) = mpsc::channel::<()>();
        let r = std::thread::scope(|s| {
            let p = &p;
            let h = s.spawn(move || {
                p.at(0, "rank 0: case: ring: round 3");
                let _ = wait.recv();
            });
            let r = watch(
                p,
                Duration::from_millis(20),
                Duration::from_millis(20),
                || h.is_finished(),
                |_| {},
            );
            let _ = release.send(());
            r
        });
        let stall = r.expect_err("the watch must give up");
        assert_eq!(stall.slot, 0);
        assert_eq!(stall.what, "rank 0: case: ring: round 3");
    }
}
