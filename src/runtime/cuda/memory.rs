//! Device memory of one rank: the buffer table behind [`CudaBuffer`] handles and a caching
//! allocator.
//!
//! Allocations come from `cuMemAlloc` and are never freed while the backend lives (so no
//! `cuMemFree`, which synchronizes the device, runs in the middle of a program). A released
//! buffer goes to a cache together with events recorded on every stream that may still use
//! it; it is handed out again only once those events have completed. Repeated runs of one
//! program therefore allocate nothing after the first.
//!
//! Released buffers are fenced lazily: [`Memory::release`] only sets the allocation aside,
//! and the next allocation first records one set of events on every stream for everything
//! set aside since ([`Memory::fence`]). A fence recorded later than the release covers at
//! least the work that used the buffer, so this is as safe as fencing at the release, and the
//! deallocations that a host program issues back to back (the end of every step) cost one
//! event per stream instead of one per stream and buffer.

use std::cell::RefCell;
use std::rc::Rc;

use meshflow_ir::DType;
use meshflow_kernels::{Device, DeviceBuffer, Event, KernelError};

/// A buffer handle of the CUDA backend: a slot of the rank's buffer table and its generation
/// (so a stale handle is detected).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudaBuffer {
    slot: u32,
    generation: u32,
}

/// A live buffer: `bytes` bytes at the start of a cached allocation.
#[derive(Debug)]
pub(super) struct Entry {
    /// The whole allocation (returned to the cache on release).
    whole: DeviceBuffer,
    /// Exactly the requested bytes.
    pub(super) data: DeviceBuffer,
    /// Element type.
    pub(super) dtype: DType,
    /// The caller's memory ([`Memory::import`]): never cached or reused.
    external: bool,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

/// Events that must complete before the allocations they fence are reused; shared by every
/// allocation fenced at once (completed events are dropped as they are found).
#[derive(Debug)]
struct Fence(RefCell<Vec<Event>>);

impl Fence {
    fn new(events: Vec<Event>) -> Rc<Fence> {
        Rc::new(Fence(RefCell::new(events)))
    }

    fn ready(&self) -> Result<bool, KernelError> {
        let mut pending = self.0.borrow_mut();
        while let Some(e) = pending.last() {
            if !e.is_complete()? {
                return Ok(false);
            }
            pending.pop();
        }
        Ok(true)
    }
}

/// A released allocation and the fence that must complete before it is reused.
#[derive(Debug)]
struct Cached {
    whole: DeviceBuffer,
    fence: Rc<Fence>,
}

/// Allocation granularity: sizes are rounded up to this many bytes so that buffers of nearly
/// equal sizes share cache entries.
const GRANULE: usize = 512;

/// The buffer table and allocation cache of one rank.
#[derive(Debug)]
pub(super) struct Memory {
    device: Device,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    cache: Vec<Cached>,
    /// While a graph is recorded: allocations released meanwhile, held (not reusable) until
    /// the graph's replays are done ([`Memory::end_hold`]), since the graph uses their
    /// addresses.
    held: Option<Vec<DeviceBuffer>>,
    /// Allocations released since the last [`Memory::fence`]: not reusable until fenced.
    unfenced: Vec<DeviceBuffer>,
}

impl Memory {
    pub(super) fn new(device: &Device) -> Memory {
        Memory {
            device: device.clone(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            cache: Vec::new(),
            held: None,
            unfenced: Vec::new(),
        }
    }

    /// Whether released allocations wait for a fence ([`Memory::fence`]).
    pub(super) fn needs_fence(&self) -> bool {
        !self.unfenced.is_empty()
    }

    /// Fences every allocation released since the last fence with `events` (recorded on every
    /// stream that may have used them, after their release): they go to the cache, reusable
    /// once `events` have completed.
    pub(super) fn fence(&mut self, events: Vec<Event>) {
        if self.unfenced.is_empty() {
            return;
        }
        let fence = Fence::new(events);
        for whole in self.unfenced.drain(..) {
            self.cache.push(Cached {
                whole,
                fence: fence.clone(),
            });
        }
    }

    /// Allocations released and not yet fenced (for tests).
    #[cfg(test)]
    pub(super) fn unfenced_count(&self) -> usize {
        self.unfenced.len()
    }

    /// An allocation of at least `bytes` bytes whose previous users have finished, as a view
    /// of exactly `bytes` bytes plus the whole allocation. Allocations released but not yet
    /// fenced are not considered: the caller fences them first ([`Memory::fence`]).
    pub(super) fn raw(
        &mut self,
        bytes: usize,
    ) -> Result<(DeviceBuffer, DeviceBuffer), KernelError> {
        let rounded = bytes.div_ceil(GRANULE).max(1) * GRANULE;
        let mut found = None;
        for (i, c) in self.cache.iter_mut().enumerate() {
            if c.whole.len() == rounded && c.fence.ready()? {
                found = Some(i);
                break;
            }
        }
        let whole = match found {
            Some(i) => self.cache.swap_remove(i).whole,
            None => match DeviceBuffer::alloc(&self.device, rounded) {
                Ok(b) => b,
                Err(first) => {
                    // Out of memory (or another failure): give back what the cache holds and
                    // try once more.
                    tracing::debug!("cuMemAlloc of {rounded} bytes failed ({first}); trimming");
                    self.device.synchronize()?;
                    self.cache.clear();
                    DeviceBuffer::alloc(&self.device, rounded)?
                }
            },
        };
        let data = whole.view(0, bytes)?;
        Ok((whole, data))
    }

    /// Returns an allocation to the cache once `pending` have completed.
    pub(super) fn retire(&mut self, whole: DeviceBuffer, pending: Vec<Event>) {
        match self.held.as_mut() {
            Some(h) => h.push(whole),
            None => self.cache.push(Cached {
                whole,
                fence: Fence::new(pending),
            }),
        }
    }

    /// Starts holding released allocations (a graph is being recorded).
    pub(super) fn begin_hold(&mut self) {
        // Allocations released before and not fenced yet are held too: a fence recorded
        // during the recording would be part of the graph, not a point the host can query.
        let unfenced = std::mem::take(&mut self.unfenced);
        self.held.get_or_insert_with(Vec::new).extend(unfenced);
    }

    /// Returns the held allocations to the cache, reusable once `pending` (events after the
    /// graph's last replay, made once for all of them) have completed.
    pub(super) fn end_hold(
        &mut self,
        pending: impl FnOnce() -> Result<Vec<Event>, KernelError>,
    ) -> Result<(), KernelError> {
        let held = self.held.take().unwrap_or_default();
        if held.is_empty() {
            return Ok(());
        }
        let fence = Fence::new(pending()?);
        for whole in held {
            self.cache.push(Cached {
                whole,
                fence: fence.clone(),
            });
        }
        Ok(())
    }

    /// Allocates a buffer of `count` elements of `dtype`.
    pub(super) fn allocate(
        &mut self,
        dtype: DType,
        count: usize,
    ) -> Result<CudaBuffer, KernelError> {
        let bytes = count
            .checked_mul(super::layout::elem_bytes(dtype))
            .ok_or_else(|| KernelError::InvalidArgument(format!("{count} {dtype} elements")))?;
        let (whole, data) = self.raw(bytes)?;
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1)
                    .map_err(|_| KernelError::InvalidArgument("too many buffers".into()))?
            }
        };
        let s = &mut self.slots[slot as usize];
        s.entry = Some(Entry {
            whole,
            data,
            dtype,
            external: false,
        });
        Ok(CudaBuffer {
            slot,
            generation: s.generation,
        })
    }

    /// A handle for the caller's memory `data` (holding elements of `dtype`), used in place
    /// until [`Memory::release`] forgets it (never cached, never freed here).
    pub(super) fn import(
        &mut self,
        data: DeviceBuffer,
        dtype: DType,
    ) -> Result<CudaBuffer, KernelError> {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1)
                    .map_err(|_| KernelError::InvalidArgument("too many buffers".into()))?
            }
        };
        let s = &mut self.slots[slot as usize];
        s.entry = Some(Entry {
            whole: data.clone(),
            data,
            dtype,
            external: true,
        });
        Ok(CudaBuffer {
            slot,
            generation: s.generation,
        })
    }

    /// The live entry of `b`, or `None` for a stale or unknown handle.
    pub(super) fn get(&self, b: CudaBuffer) -> Option<&Entry> {
        self.slots
            .get(b.slot as usize)
            .filter(|s| s.generation == b.generation)
            .and_then(|s| s.entry.as_ref())
    }

    /// Releases `b`; its memory is reused once the next [`Memory::fence`] (or, while a graph
    /// is recorded, the graph's replays) have completed.
    pub(super) fn release(&mut self, b: CudaBuffer) -> bool {
        let Some(s) = self
            .slots
            .get_mut(b.slot as usize)
            .filter(|s| s.generation == b.generation)
        else {
            return false;
        };
        let Some(entry) = s.entry.take() else {
            return false;
        };
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(b.slot);
        if !entry.external {
            match self.held.as_mut() {
                Some(h) => h.push(entry.whole),
                None => self.unfenced.push(entry.whole),
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_kernels::Stream;

    /// The GPU, or `None` after printing why the test is skipped.
    fn gpu(test: &str) -> Option<Device> {
        match Device::count() {
            Ok(n) if n >= 1 => Device::new(0).ok(),
            Ok(_) => {
                eprintln!("skipped: {test} needs a GPU, this machine has none");
                None
            }
            Err(e) => {
                eprintln!("skipped: {test} needs a GPU: {e}");
                None
            }
        }
    }

    #[test]
    fn a_released_buffer_is_reused_only_after_a_fence() {
        let Some(device) = gpu("a_released_buffer_is_reused_only_after_a_fence") else {
            return;
        };
        let stream = Stream::new(&device).unwrap();
        let mut m = Memory::new(&device);
        let a = m.allocate(DType::F32, 1024).unwrap();
        let b = m.allocate(DType::F32, 1024).unwrap();
        let buf = |m: &Memory, x: CudaBuffer| m.get(x).unwrap().data.clone();
        let (a_buf, b_buf) = (buf(&m, a), buf(&m, b));
        assert!(m.release(a) && m.release(b));
        assert!(!m.release(a), "a second release of a stale handle");
        assert!(m.needs_fence());
        assert_eq!(m.unfenced_count(), 2);
        // Not fenced yet: a new allocation of the same size gets fresh memory.
        let c = m.allocate(DType::F32, 1024).unwrap();
        let c_buf = buf(&m, c);
        assert!(!c_buf.overlaps(&a_buf) && !c_buf.overlaps(&b_buf));
        // One fence (one event) for both, complete once the stream is idle: both reusable.
        m.fence(vec![stream.record_event().unwrap()]);
        assert!(!m.needs_fence());
        stream.synchronize().unwrap();
        let d = m.allocate(DType::F32, 1024).unwrap();
        let e = m.allocate(DType::F32, 1024).unwrap();
        let (d_buf, e_buf) = (buf(&m, d), buf(&m, e));
        assert!(
            (d_buf.overlaps(&a_buf) && e_buf.overlaps(&b_buf))
                || (d_buf.overlaps(&b_buf) && e_buf.overlaps(&a_buf)),
            "both released allocations are reused once fenced"
        );
    }

    #[test]
    fn buffers_released_before_a_recording_are_held_with_it() {
        let Some(device) = gpu("buffers_released_before_a_recording_are_held_with_it") else {
            return;
        };
        let stream = Stream::new(&device).unwrap();
        let mut m = Memory::new(&device);
        let a = m.allocate(DType::I32, 100).unwrap();
        let a_buf = m.get(a).unwrap().data.clone();
        m.release(a);
        // A graph is recorded: nothing may be fenced until its replays are done.
        m.begin_hold();
        assert!(!m.needs_fence());
        let b = m.allocate(DType::I32, 100).unwrap();
        assert!(!m.get(b).unwrap().data.overlaps(&a_buf));
        m.release(b);
        assert!(
            !m.needs_fence(),
            "released while holding: held, not unfenced"
        );
        let mut fences = 0;
        m.end_hold(|| {
            fences += 1;
            Ok(vec![stream.record_event()?])
        })
        .unwrap();
        assert_eq!(fences, 1, "one fence for every held allocation");
        stream.synchronize().unwrap();
        let c = m.allocate(DType::I32, 100).unwrap();
        let d = m.allocate(DType::I32, 100).unwrap();
        let reused = [c, d]
            .iter()
            .any(|&x| m.get(x).unwrap().data.overlaps(&a_buf));
        assert!(
            reused,
            "the allocation released before the recording is reused after it"
        );
    }
}
