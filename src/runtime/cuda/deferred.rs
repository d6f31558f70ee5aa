//! [`Deferrals`]: device work a rank posted before what it needs from a peer had arrived,
//! finished later by the rank's host, in posting order.
//!
//! The one user is the copy engine (`transport/copy_engine.rs`): a pull whose sender's offer
//! has not arrived when the pull is posted does not block the host there (across processes an
//! offer takes a TCP hop, and the sender posts it only when its own host gets there). Its
//! stream is joined to the posting stream at once, and the rest (take the offer, copy, report
//! the read, record the done event the communication's `wait` waits for) is queued here and
//! done at the first of:
//!
//! 1. a `wait` on that communication (the wait finishes the queue up to it, in order);
//! 2. any host wait of the rank that may block: another pull that cannot be deferred, a
//!    collection of peers' reads, a device synchronization, the end of the run, a download or
//!    upload, the release of a buffer a queued pull writes, any communication not carried by
//!    the copy engine (NCCL, MoE, host proxy: their device or host waits may depend on peers'
//!    hosts), a coalescing group, a graph;
//! 3. opportunistically, without blocking, at each later copy-engine post and compute launch
//!    (the front of the queue whose offers have arrived).
//!
//! A later pull is queued behind the earlier ones whenever the queue is not empty, so takes
//! happen in posting order (the CUDA IPC link numbers the transfers of each peer and checks
//! that order).
//!
//! # Why no new deadlock
//!
//! Each rank's host runs a sequence of *blocking* points (waits for a peer's offer or read
//! report, barriers, device synchronizations, waits for the device work of other transports)
//! and of *sends* (offers, read reports, device signals), which never block. Without
//! deferral a pull is a blocking point at its post. With deferral, by rule 2, every queued pull
//! is finished, in posting order, before the next blocking point: the sequence of blocking
//! points is the same as without deferral, in the same order, and every send still happens
//! before the blocking point that followed it (sends that came after a deferred pull in
//! program order now happen earlier, which no peer can wait for in vain). So for every
//! blocking point of every rank, what its peers had sent by then without deferral they have
//! sent by then with it: a run that completes without deferral completes with it. The device
//! side keeps the links' rule that a device wait is only enqueued for a signal the peer has
//! already enqueued (a queued pull enqueues nothing until its offer is there), and no device
//! work that waits for a peer's later host call (an NCCL or MoE kernel) is enqueued while a
//! pull is queued.
//!
//! Errors of a queued pull (a timeout, a lost peer, an abort) are those its take would have
//! reported at the post, reported where it is finished (naming the transfer).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use crate::runtime::backend::BackendError;

/// Where a queued item's result lands (the communication handle shares it).
pub(crate) type Slot<T> = Rc<RefCell<Option<T>>>;

/// An item of deferred work on context `C`, producing `T`.
pub(crate) trait Pending<C, T> {
    /// Finishes the work: waits for what it needs when `block` (errors as the blocking call it
    /// was deferred from would report them); without `block`, `Ok(None)` when that has not
    /// arrived yet (and nothing was done).
    fn finish(&mut self, cx: &mut C, block: bool) -> Result<Option<T>, BackendError>;
}

/// One queued item: the work, its slot, and the buffer it writes.
struct Entry<C, T, B> {
    pending: Box<dyn Pending<C, T>>,
    slot: Slot<T>,
    writes: B,
}

/// Deferred work of one rank in posting order (see the module docs); `B` names a buffer.
pub(crate) struct Deferrals<C, T, B> {
    queue: VecDeque<Entry<C, T, B>>,
}

impl<C, T, B> Default for Deferrals<C, T, B> {
    fn default() -> Self {
        Deferrals {
            queue: VecDeque::new(),
        }
    }
}

impl<C, T, B: PartialEq> Deferrals<C, T, B> {
    /// Queues `pending`, which writes buffer `writes`; its result goes to `slot`.
    pub fn push(&mut self, pending: Box<dyn Pending<C, T>>, slot: Slot<T>, writes: B) {
        self.queue.push_back(Entry {
            pending,
            slot,
            writes,
        });
    }

    /// Items queued.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Forgets every item (a run that failed before its end: nothing of it was enqueued).
    pub fn clear(&mut self) {
        self.queue.clear();
    }

    /// How many items from the front a [`Finish`] covers.
    fn reach(&self, how: &Finish<'_, T, B>) -> usize {
        let last = |found: Option<usize>| found.map_or(0, |i| i + 1);
        match how {
            Finish::Ready | Finish::All => self.queue.len(),
            Finish::Through(slot) => {
                last(self.queue.iter().position(|e| Rc::ptr_eq(&e.slot, slot)))
            }
            Finish::Writing(b) => last(self.queue.iter().rposition(|e| e.writes == **b)),
        }
    }
}

/// How much of the queue to finish.
pub(crate) enum Finish<'a, T, B> {
    /// The front items that can finish without blocking (stops at the first that cannot).
    Ready,
    /// Everything up to and including the item of this slot (blocking); nothing when it is
    /// not queued (finished already, or never deferred).
    Through(&'a Slot<T>),
    /// Everything up to and including the last item writing this buffer (blocking).
    Writing(&'a B),
    /// Everything (blocking): before a host wait that may block.
    All,
}

/// A context that holds a queue of deferred work on itself.
pub(crate) trait Defers<T, B>: Sized {
    /// The queue.
    fn deferrals(&mut self) -> &mut Deferrals<Self, T, B>;
}

/// Finishes queued items of `cx` as `how` says, in posting order. On an error the failed
/// item is dropped (its slot stays empty) and the later ones stay queued.
pub(crate) fn finish<C: Defers<T, B>, T, B: PartialEq>(
    cx: &mut C,
    how: Finish<'_, T, B>,
) -> Result<(), BackendError> {
    let n = cx.deferrals().reach(&how);
    let block = !matches!(how, Finish::Ready);
    for _ in 0..n {
        let Some(mut e) = cx.deferrals().queue.pop_front() else {
            break;
        };
        match e.pending.finish(cx, block)? {
            Some(out) => *e.slot.borrow_mut() = Some(out),
            None => {
                cx.deferrals().queue.push_front(e);
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A rank with a fake link: offers that have arrived, and what it did in order.
    #[derive(Default)]
    struct Fake {
        arrived: HashSet<u32>,
        log: Vec<String>,
        queue: Deferrals<Fake, u32, &'static str>,
    }

    impl Defers<u32, &'static str> for Fake {
        fn deferrals(&mut self) -> &mut Deferrals<Fake, u32, &'static str> {
            &mut self.queue
        }
    }

    /// A pull of transfer `key`: takes the offer if it arrived; blocking on one that never
    /// arrives times out as the links do, naming the transfer.
    struct Pull {
        key: u32,
    }

    impl Pending<Fake, u32> for Pull {
        fn finish(&mut self, cx: &mut Fake, block: bool) -> Result<Option<u32>, BackendError> {
            if !cx.arrived.remove(&self.key) {
                if !block {
                    return Ok(None);
                }
                return Err(BackendError::Timeout {
                    peer: 1,
                    waited: std::time::Duration::ZERO,
                    what: format!("collective_permute #0 instance {} data", self.key),
                });
            }
            cx.log.push(format!("pull {}", self.key));
            Ok(Some(self.key * 10))
        }
    }

    /// Queues pulls of `keys` (writing buffers named by `bufs`) and returns their slots.
    fn queue(cx: &mut Fake, keys: &[(u32, &'static str)]) -> Vec<Slot<u32>> {
        keys.iter()
            .map(|&(key, buf)| {
                let slot: Slot<u32> = Rc::default();
                cx.queue.push(Box::new(Pull { key }), slot.clone(), buf);
                slot
            })
            .collect()
    }

    fn values(slots: &[Slot<u32>]) -> Vec<Option<u32>> {
        slots.iter().map(|s| *s.borrow()).collect()
    }

    #[test]
    fn ready_items_finish_in_posting_order_and_never_overtake_the_front() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b"), (3, "c")]);
        cx.arrived.extend([2, 3]);
        finish(&mut cx, Finish::Ready).unwrap();
        assert_eq!(
            values(&slots),
            [None, None, None],
            "the front has not arrived"
        );
        assert!(cx.log.is_empty());
        assert_eq!(cx.queue.len(), 3);
        cx.arrived.insert(1);
        finish(&mut cx, Finish::Ready).unwrap();
        assert_eq!(values(&slots), [Some(10), Some(20), Some(30)]);
        assert_eq!(cx.log, ["pull 1", "pull 2", "pull 3"]);
        assert!(cx.queue.is_empty());
    }

    #[test]
    fn ready_items_stop_at_the_first_that_has_not_arrived() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b"), (3, "c")]);
        cx.arrived.extend([1, 3]);
        finish(&mut cx, Finish::Ready).unwrap();
        assert_eq!(values(&slots), [Some(10), None, None]);
        assert_eq!(cx.queue.len(), 2);
    }

    #[test]
    fn a_wait_finishes_the_queue_up_to_its_item_only() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b"), (3, "c")]);
        cx.arrived.extend([1, 2, 3]);
        finish(&mut cx, Finish::Through(&slots[1])).unwrap();
        assert_eq!(values(&slots), [Some(10), Some(20), None]);
        assert_eq!(cx.log, ["pull 1", "pull 2"]);
        // Its item is gone: a second wait on it finishes nothing more.
        finish(&mut cx, Finish::Through(&slots[1])).unwrap();
        assert_eq!(cx.queue.len(), 1);
        // A slot that was never queued (a pull done at its post) finishes nothing.
        let other: Slot<u32> = Rc::new(RefCell::new(Some(7)));
        finish(&mut cx, Finish::Through(&other)).unwrap();
        assert_eq!(values(&slots), [Some(10), Some(20), None]);
    }

    #[test]
    fn a_blocking_wait_finishes_everything_before_it_blocks() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b")]);
        cx.arrived.extend([1, 2]);
        finish(&mut cx, Finish::All).unwrap();
        // The caller's own blocking wait comes only now.
        cx.log.push("reads_done".into());
        assert_eq!(values(&slots), [Some(10), Some(20)]);
        assert_eq!(cx.log, ["pull 1", "pull 2", "reads_done"]);
    }

    #[test]
    fn releasing_a_buffer_finishes_through_the_last_pull_into_it() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b"), (3, "a"), (4, "c")]);
        cx.arrived.extend([1, 2, 3, 4]);
        finish(&mut cx, Finish::Writing(&"a")).unwrap();
        assert_eq!(values(&slots), [Some(10), Some(20), Some(30), None]);
        finish(&mut cx, Finish::Writing(&"z")).unwrap();
        assert_eq!(cx.queue.len(), 1, "no pull writes `z`");
    }

    #[test]
    fn a_failed_item_reports_its_transfer_and_leaves_the_later_ones_queued() {
        let mut cx = Fake::default();
        let slots = queue(&mut cx, &[(1, "a"), (2, "b"), (3, "c")]);
        cx.arrived.extend([1, 3]);
        let err = finish(&mut cx, Finish::All).unwrap_err().to_string();
        assert!(err.contains("collective_permute #0 instance 2"), "{err}");
        assert_eq!(values(&slots), [Some(10), None, None]);
        assert_eq!(
            cx.queue.len(),
            1,
            "the failed item is dropped, the third stays"
        );
        cx.queue.clear();
        assert!(cx.queue.is_empty());
    }
}
