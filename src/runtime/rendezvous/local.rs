//! [`LocalRendezvous`]: a store shared by the threads of one process, and the [`Store`] that
//! the TCP server also uses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Rendezvous, RendezvousError};

#[derive(Debug, Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    arrivals: HashMap<String, usize>,
    aborted: Option<String>,
    /// A rank whose connection ended without a goodbye, and how that was seen.
    lost: Option<(usize, String)>,
}

impl State {
    /// `Some` once `parties` arrivals were counted at barrier `name`.
    fn barrier_reached(&self, name: &str, parties: usize) -> Option<()> {
        (self.arrivals.get(name).copied().unwrap_or(0) >= parties).then_some(())
    }
}

/// How long a waiter of [`Store::timing_barrier`] spins before it sleeps like any other.
const TIMING_SPIN: Duration = Duration::from_millis(2);

/// Values, barrier counters and an abort flag behind one lock, with a condition variable that
/// wakes waiters on every change, and a counter of changes that spinning waiters watch.
#[derive(Debug, Default)]
pub(super) struct Store {
    state: Mutex<State>,
    changed: Condvar,
    /// Bumped (under the lock) with every notification of `changed`.
    changes: AtomicU64,
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter (called with the lock held, after a change).
    fn notify(&self) {
        self.changes.fetch_add(1, Ordering::Release);
        self.changed.notify_all();
    }

    /// What a waiter for `ready` does with the state as it is now: `None` to keep waiting.
    fn settle<T>(
        s: &State,
        ready: &mut impl FnMut(&State) -> Option<T>,
    ) -> Option<Result<T, RendezvousError>> {
        if let Some(reason) = &s.aborted {
            return Some(Err(RendezvousError::Aborted(reason.clone())));
        }
        if let Some(v) = ready(s) {
            return Some(Ok(v));
        }
        s.lost.as_ref().map(|(rank, reason)| {
            Err(RendezvousError::Lost {
                rank: *rank,
                reason: reason.clone(),
            })
        })
    }

    pub(super) fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let mut s = self.lock();
        if let Some(reason) = &s.aborted {
            return Err(RendezvousError::Aborted(reason.clone()));
        }
        s.values.insert(key.to_owned(), value.to_vec());
        self.notify();
        Ok(())
    }

    /// Waits until `ready` holds (or the timeout / an abort), then maps the state.
    fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut(&State) -> Option<T>,
    ) -> Result<T, RendezvousError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(r) = Self::settle(&s, &mut ready) {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RendezvousError::Timeout {
                    what: what.to_owned(),
                    waited: timeout,
                });
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub(super) fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.wait_for(&format!("key `{key}`"), timeout, |s| {
            s.values.get(key).cloned()
        })
    }

    pub(super) fn barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.arrive(name);
        self.await_barrier(name, parties, timeout)
    }

    /// [`barrier`](Self::barrier), but a waiter spins (watching the change counter) for up to
    /// [`TIMING_SPIN`] before it sleeps, so it leaves within about a microsecond of the last
    /// arrival instead of after a thread wake-up (tens of microseconds, and a different delay
    /// for every waiter).
    pub(super) fn timing_barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.arrive(name);
        let mut ready = |s: &State| s.barrier_reached(name, parties);
        let spin_end = Instant::now() + TIMING_SPIN.min(timeout);
        let mut seen = None;
        while Instant::now() < spin_end {
            let now = self.changes.load(Ordering::Acquire);
            if seen != Some(now) {
                seen = Some(now);
                if let Some(r) = Self::settle(&self.lock(), &mut ready) {
                    return r;
                }
            }
            std::hint::spin_loop();
        }
        self.await_barrier(name, parties, timeout)
    }

    /// Counts one arrival at barrier `name`.
    pub(super) fn arrive(&self, name: &str) {
        let mut s = self.lock();
        *s.arrivals.entry(name.to_owned()).or_insert(0) += 1;
        self.notify();
    }

    /// Waits until `parties` arrivals were counted at barrier `name`.
    pub(super) fn await_barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        let what = format!("barrier `{name}` ({parties} parties)");
        self.wait_for(&what, timeout, |s| s.barrier_reached(name, parties))
    }

    /// Records that `rank` is gone (the first loss is kept): every wait that is not complete
    /// yet, now or later, fails with [`RendezvousError::Lost`].
    pub(super) fn lose(&self, rank: usize, reason: &str) {
        let mut s = self.lock();
        if s.lost.is_none() {
            s.lost = Some((rank, reason.to_owned()));
        }
        self.notify();
    }

    pub(super) fn abort(&self, reason: &str) {
        let mut s = self.lock();
        if s.aborted.is_none() {
            s.aborted = Some(reason.to_owned());
        }
        self.notify();
    }
}

/// A rendezvous for ranks that are threads of one process. Cheap to clone; clones share the
/// store.
#[derive(Clone, Debug)]
pub struct LocalRendezvous {
    store: Arc<Store>,
    namespace: String,
}

impl LocalRendezvous {
    /// A fresh, empty store named `namespace`.
    pub fn new(namespace: impl Into<String>) -> LocalRendezvous {
        LocalRendezvous {
            store: Arc::new(Store::default()),
            namespace: namespace.into(),
        }
    }
}

impl Rendezvous for LocalRendezvous {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.store.publish(key, value)
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.store.fetch(key, timeout)
    }

    fn barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.store.barrier(name, parties, timeout)
    }

    fn timing_barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        self.store.timing_barrier(name, parties, timeout)
    }

    fn abort(&self, reason: &str) {
        self.store.abort(reason);
    }

    fn spans_processes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_fetch_barrier_and_abort() {
        let r = LocalRendezvous::new("t");
        let t = Duration::from_secs(2);
        std::thread::scope(|s| {
            let r2 = r.clone();
            s.spawn(move || {
                r2.publish("k", b"v").unwrap();
                r2.barrier("b", 2, t).unwrap();
            });
            assert_eq!(r.fetch("k", t).unwrap(), b"v");
            r.barrier("b", 2, t).unwrap();
        });
        let err = r.fetch("missing", Duration::from_millis(20)).unwrap_err();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
        assert!(!r.spans_processes(), "threads of one process only");
        r.abort("rank 1 failed");
        let err = r.barrier("c", 2, t).unwrap_err();
        assert_eq!(err, RendezvousError::Aborted("rank 1 failed".into()));
    }

    #[test]
    fn timing_barrier_waits_for_every_party_spinning_or_asleep() {
        let r = LocalRendezvous::new("t");
        let t = Duration::from_secs(5);
        let arrived = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            // One party arrives at once (it spins, then sleeps), one after the spin, one last
            // within it: nobody leaves before the last arrival.
            for delay_ms in [0u64, 10, 1] {
                let (r, arrived) = (r.clone(), &arrived);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay_ms));
                    arrived.fetch_add(1, Ordering::SeqCst);
                    r.timing_barrier("start", 3, t).unwrap();
                    assert_eq!(arrived.load(Ordering::SeqCst), 3);
                });
            }
        });
        // Too few parties: a timeout naming the barrier.
        let err = r
            .timing_barrier("alone", 2, Duration::from_millis(5))
            .unwrap_err();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("alone"), "{err}");
        // An abort ends the wait, spinning or not.
        std::thread::scope(|s| {
            let r2 = r.clone();
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(1));
                r2.abort("rank 0 failed");
            });
            let err = r.timing_barrier("never", 2, t).unwrap_err();
            assert_eq!(err, RendezvousError::Aborted("rank 0 failed".into()));
        });
    }
}
