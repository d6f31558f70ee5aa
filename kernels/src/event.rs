//! Pooled CUDA events: record on one stream, wait on another, synchronize, time.

use std::fmt;
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// A raw event handle that may move between threads (CUDA events are thread-safe handles).
#[derive(Clone, Copy)]
pub(crate) struct RawEvent(sys::CUevent);
// SAFETY: a CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for RawEvent {}

/// Recycled events of one device, kept apart by whether they record timestamps.
#[derive(Default)]
pub(crate) struct EventPool {
    plain: Mutex<Vec<RawEvent>>,
    timing: Mutex<Vec<RawEvent>>,
}

impl EventPool {
    fn list(&self, timing: bool) -> &Mutex<Vec<RawEvent>> {
        if timing {
            &self.timing
        } else {
            &self.plain
        }
    }

    fn take(&self, timing: bool) -> Option<RawEvent> {
        self.list(timing).lock().ok()?.pop()
    }

    fn give_back(&self, timing: bool, ev: RawEvent) {
        match self.list(timing).lock() {
            Ok(mut l) => l.push(ev),
            // SAFETY: the event came from `cuEventCreate` and nobody else holds it.
            Err(_) => drop(unsafe { result::event::destroy(ev.0) }),
        }
    }

    /// Destroys every pooled event; the owning context must be current.
    pub(crate) fn destroy_all(&self) {
        for timing in [false, true] {
            if let Ok(mut l) = self.list(timing).lock() {
                for ev in l.drain(..) {
                    // SAFETY: pooled events are owned by the pool only.
                    if let Err(e) = unsafe { result::event::destroy(ev.0) } {
                        tracing::warn!("cuEventDestroy failed: {e}");
                    }
                }
            }
        }
    }
}

/// A CUDA event from the device's pool; returned to the pool on drop.
pub struct Event {
    raw: RawEvent,
    device: Device,
    timing: bool,
}

impl Event {
    fn create(device: &Device, timing: bool) -> Result<Event> {
        let raw = match device.inner.events.take(timing) {
            Some(raw) => raw,
            None => {
                device.bind()?;
                let flags = if timing {
                    sys::CUevent_flags::CU_EVENT_DEFAULT
                } else {
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
                };
                RawEvent(drv("cuEventCreate", result::event::create(flags))?)
            }
        };
        Ok(Event {
            raw,
            device: device.clone(),
            timing,
        })
    }

    /// A pooled event without timing (the cheap kind, for ordering streams).
    pub fn new(device: &Device) -> Result<Event> {
        Event::create(device, false)
    }

    /// A pooled event that records a timestamp, for [`Event::elapsed_ms`].
    pub fn timing(device: &Device) -> Result<Event> {
        Event::create(device, true)
    }

    /// The device this event belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records the event at the current end of `stream` (a stream of the same device).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.expect_device(&self.device, "recording an event")?;
        let s = stream.bind_raw()?;
        // SAFETY: the event and the stream are live handles of the same, current context.
        drv("cuEventRecord", unsafe {
            result::event::record(self.raw.0, s)
        })
    }

    /// Records the event on `stream` as an *external* record: outside a stream capture it is
    /// [`Event::record`]; while `stream` is being captured into a graph, it becomes an event
    /// record node of the graph (a plain record would only order the capture), so every
    /// replay records it, e.g. to time the parts of a replay ([`Graph::retarget_event`](crate::Graph::retarget_event)
    /// gives each replay an event of its own).
    pub fn record_external(&self, stream: &Stream) -> Result<()> {
        stream.expect_device(&self.device, "recording an event")?;
        let s = stream.bind_raw()?;
        let flags = sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as std::ffi::c_uint;
        // SAFETY: the event and the stream are live handles of the same, current context;
        // the flag is a defined `CUevent_record_flags` value.
        drv("cuEventRecordWithFlags", unsafe {
            sys::cuEventRecordWithFlags(self.raw.0, s, flags).result()
        })
    }

    /// The raw handle (for graph nodes that record it).
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.raw.0
    }

    /// Makes `stream` (of any device) wait for this event.
    pub(crate) fn wait_on(&self, stream: &Stream) -> Result<()> {
        let s = stream.bind_raw()?;
        // SAFETY: both handles are live; flags 0 is the only defined value.
        drv("cuStreamWaitEvent", unsafe {
            result::stream::wait_event(
                s,
                self.raw.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    }

    /// Blocks until the work captured by the last `record` has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: live event handle.
        drv("cuEventSynchronize", unsafe {
            result::event::synchronize(self.raw.0)
        })
    }

    /// Whether the captured work has completed (never blocks).
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: live event handle.
        match unsafe { result::event::query(self.raw.0) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => drv("cuEventQuery", Err(e)),
        }
    }

    /// Milliseconds between two recorded timing events (`start` before `end`); both must come
    /// from [`Event::timing`] and have completed.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32> {
        if !start.timing || !end.timing {
            return Err(KernelError::InvalidArgument(
                "elapsed time needs two events created with Event::timing".into(),
            ));
        }
        start.device.bind()?;
        // SAFETY: two live timing events.
        drv("cuEventElapsedTime", unsafe {
            result::event::elapsed(start.raw.0, end.raw.0)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.device.inner.events.give_back(self.timing, self.raw);
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.ordinal())
            .field("timing", &self.timing)
            .finish()
    }
}
