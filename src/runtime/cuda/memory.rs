//! Device memory of one rank: the buffer table behind [`CudaBuffer`] handles and a caching
//! allocator.
//!
//! Allocations come from `cuMemAlloc` and are never freed while the backend lives (so no
//! `cuMemFree`, which synchronizes the device, runs in the middle of a program). A released
//! buffer goes to a cache together with events recorded on every stream that may still use
//! it; it is handed out again only once those events have completed. Repeated runs of one
//! program therefore allocate nothing after the first.

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

/// A released allocation and the events that must complete before it is reused.
#[derive(Debug)]
struct Cached {
    whole: DeviceBuffer,
    pending: Vec<Event>,
}

impl Cached {
    fn ready(&mut self) -> Result<bool, KernelError> {
        while let Some(e) = self.pending.last() {
            if !e.is_complete()? {
                return Ok(false);
            }
            self.pending.pop();
        }
        Ok(true)
    }
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
}

impl Memory {
    pub(super) fn new(device: &Device) -> Memory {
        Memory {
            device: device.clone(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            cache: Vec::new(),
        }
    }

    /// An allocation of at least `bytes` bytes whose previous users have finished, as a view
    /// of exactly `bytes` bytes plus the whole allocation.
    pub(super) fn raw(
        &mut self,
        bytes: usize,
    ) -> Result<(DeviceBuffer, DeviceBuffer), KernelError> {
        let rounded = bytes.div_ceil(GRANULE).max(1) * GRANULE;
        let mut found = None;
        for (i, c) in self.cache.iter_mut().enumerate() {
            if c.whole.len() == rounded && c.ready()? {
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
        self.cache.push(Cached { whole, pending });
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

    /// Releases `b`; its memory is reused once `pending` have completed.
    pub(super) fn release(&mut self, b: CudaBuffer, pending: Vec<Event>) -> bool {
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
            self.cache.push(Cached {
                whole: entry.whole,
                pending,
            });
        }
        true
    }
}
