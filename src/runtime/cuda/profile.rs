//! Device-side timing of a run: the run's duration from CUDA events on the main stream, and
//! (in profiling mode) one interval per compute op and communication, read from events
//! recorded before and after it on its stream.
//!
//! In a step recorded as a CUDA graph the events are recorded as the graph's event record
//! nodes ([`Event::record_external`]); before every replay each node is given fresh events
//! ([`Timeline::retarget_for_replay`]), so that every replay reports its own intervals, as the
//! steps of a run without a graph do.

use meshflow_ir::DeviceId;
use meshflow_kernels::{Event, Graph, KernelError, Stream};
use meshflow_passes::Transport;

use crate::runtime::backend::PreorderIndex;
use crate::runtime::trace::TraceEvent;

/// What an [`Interval`] measured.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum IntervalKind {
    /// A compute op or launched kernel.
    Compute,
    /// A communication (or a whole coalescing group).
    Comm,
}

/// One op as the GPU ran it: from the moment its stream reached it to the moment it finished,
/// in microseconds since the rank's run started (its first upload or instruction).
#[derive(Clone, Debug, PartialEq)]
pub struct Interval {
    /// The rank.
    pub rank: DeviceId,
    /// The stream (0 = main, `1 + w` = worker `w`).
    pub stream: usize,
    /// Compute or communication.
    pub kind: IntervalKind,
    /// The instruction name (`linear`, `all_gather`, `coalesced`, ...).
    pub name: &'static str,
    /// For a communication: the transport that executed it.
    pub transport: Option<Transport>,
    /// The instruction's position in program pre-order.
    pub preorder: PreorderIndex,
    /// Loop variable values.
    pub iteration: Vec<i64>,
    /// Start, µs.
    pub start_us: f64,
    /// End, µs.
    pub end_us: f64,
}

impl Interval {
    /// `end_us - start_us`.
    pub fn duration_us(&self) -> f64 {
        self.end_us - self.start_us
    }

    /// Whether two intervals share some time.
    pub fn intersects(&self, other: &Interval) -> bool {
        self.start_us < other.end_us && other.start_us < self.end_us
    }

    /// The interval as a trace event (`text` says compute or comm).
    pub fn to_trace_event(&self) -> TraceEvent {
        TraceEvent {
            rank: self.rank,
            stream: self.stream,
            name: self.name,
            text: match (self.kind, self.transport) {
                (IntervalKind::Compute, _) => "compute (GPU time)".into(),
                (IntervalKind::Comm, None) => "communication (GPU time)".into(),
                (IntervalKind::Comm, Some(t)) => format!("communication over {t} (GPU time)"),
            },
            iteration: self.iteration.clone(),
            start_us: self.start_us,
            dur_us: self.duration_us(),
            transport: self.transport,
            moe_weights: None,
        }
    }
}

/// An op whose interval is being recorded.
#[derive(Debug)]
struct Pending {
    stream: usize,
    kind: IntervalKind,
    name: &'static str,
    transport: Option<Transport>,
    preorder: PreorderIndex,
    iteration: Vec<i64>,
    start: Event,
    end: Event,
}

/// A started interval: close it with [`Timeline::close`].
#[derive(Debug)]
pub(crate) struct Opened {
    stream: usize,
    kind: IntervalKind,
    name: &'static str,
    transport: Option<Transport>,
    preorder: PreorderIndex,
    iteration: Vec<i64>,
    start: Event,
}

/// The timing state of one rank.
#[derive(Debug, Default)]
pub(crate) struct Timeline {
    /// Record intervals.
    pub profile: bool,
    start: Option<Event>,
    pending: Vec<Pending>,
    /// Duration of the last finished run, µs.
    pub last_run_us: Option<f64>,
    /// Intervals of the last finished run (profiling mode).
    pub intervals: Vec<Interval>,
    /// While a step is recorded as a graph: the intervals recorded as event record nodes of
    /// the graph (`Some` in profiling mode only).
    captured: Option<Vec<Pending>>,
}

impl Timeline {
    pub(super) fn new(profile: bool) -> Timeline {
        Timeline {
            profile,
            ..Timeline::default()
        }
    }

    /// Whether the run clock runs.
    pub(super) fn is_started(&self) -> bool {
        self.start.is_some()
    }

    /// Starts the run clock on `main` unless it runs already.
    pub(super) fn ensure_started(&mut self, main: &Stream) -> Result<(), KernelError> {
        if self.start.is_none() {
            let e = Event::timing(main.device())?;
            e.record(main)?;
            self.start = Some(e);
        }
        Ok(())
    }

    /// Restarts the run clock on `main`: a run recorded as a CUDA graph times its replays
    /// only, not the recording and instantiation on the host (nor the step issued without
    /// recording before the first recording, whose intervals are dropped).
    pub(super) fn restart(&mut self, main: &Stream) -> Result<(), KernelError> {
        self.pending.clear();
        self.start = None;
        self.ensure_started(main)
    }

    /// A step is being recorded as a graph: in profiling mode, intervals opened from now on
    /// are recorded as event record nodes of the graph ([`Timeline::end_capture`]).
    pub(super) fn begin_capture(&mut self) {
        self.captured = self.profile.then(Vec::new);
    }

    /// The recording ended: the intervals recorded into the graph (to be given fresh events
    /// before every replay with [`Timeline::retarget_for_replay`]).
    pub(super) fn end_capture(&mut self) -> Vec<CapturedInterval> {
        self.captured
            .take()
            .unwrap_or_default()
            .into_iter()
            .map(CapturedInterval)
            .collect()
    }

    /// Before a replay of `graph`: gives every captured interval's nodes fresh events and
    /// keeps them as an interval of this run (read at [`Timeline::collect`]).
    pub(super) fn retarget_for_replay(
        &mut self,
        graph: &Graph,
        captured: &[CapturedInterval],
    ) -> Result<(), KernelError> {
        for CapturedInterval(c) in captured {
            let start = Event::timing(c.start.device())?;
            let end = Event::timing(c.start.device())?;
            graph.retarget_event(&c.start, &start)?;
            graph.retarget_event(&c.end, &end)?;
            self.pending.push(Pending {
                stream: c.stream,
                kind: c.kind,
                name: c.name,
                transport: c.transport,
                preorder: c.preorder,
                iteration: c.iteration.clone(),
                start,
                end,
            });
        }
        Ok(())
    }

    /// Opens an interval on `stream` (profiling mode only; `None` otherwise).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        &mut self,
        streams: &[Stream],
        stream: usize,
        kind: IntervalKind,
        name: &'static str,
        transport: Option<Transport>,
        preorder: PreorderIndex,
        iteration: &[i64],
    ) -> Result<Option<Opened>, KernelError> {
        match streams.get(stream) {
            Some(s) => self.open_on(s, stream, kind, name, transport, preorder, iteration),
            None => Ok(None),
        }
    }

    /// Opens an interval on stream `s`, reported as stream number `stream` (the run clock must
    /// be running; profiling mode only).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open_on(
        &mut self,
        s: &Stream,
        stream: usize,
        kind: IntervalKind,
        name: &'static str,
        transport: Option<Transport>,
        preorder: PreorderIndex,
        iteration: &[i64],
    ) -> Result<Option<Opened>, KernelError> {
        if !self.profile || self.start.is_none() {
            return Ok(None);
        }
        let start = Event::timing(s.device())?;
        if self.captured.is_some() {
            start.record_external(s)?;
        } else {
            start.record(s)?;
        }
        Ok(Some(Opened {
            stream,
            kind,
            name,
            transport,
            preorder,
            iteration: iteration.to_vec(),
            start,
        }))
    }

    /// Closes an interval at the current end of `streams[opened.stream]`.
    pub(super) fn close(
        &mut self,
        streams: &[Stream],
        opened: Option<Opened>,
    ) -> Result<(), KernelError> {
        let Some(s) = opened.as_ref().and_then(|o| streams.get(o.stream)) else {
            return Ok(());
        };
        self.close_on(s, opened)
    }

    /// Closes an interval at the current end of stream `s`.
    pub(super) fn close_on(
        &mut self,
        s: &Stream,
        opened: Option<Opened>,
    ) -> Result<(), KernelError> {
        let Some(o) = opened else {
            return Ok(());
        };
        let end = Event::timing(s.device())?;
        let closed = |end| Pending {
            stream: o.stream,
            kind: o.kind,
            name: o.name,
            transport: o.transport,
            preorder: o.preorder,
            iteration: o.iteration,
            start: o.start,
            end,
        };
        match self.captured.as_mut() {
            Some(captured) => {
                end.record_external(s)?;
                captured.push(closed(end));
            }
            None => {
                end.record(s)?;
                self.pending.push(closed(end));
            }
        }
        Ok(())
    }

    /// Ends the run: records the end on `main` (which has joined every stream). Call
    /// [`Timeline::collect`] once the device has finished.
    pub(super) fn end_event(&mut self, main: &Stream) -> Result<Option<Event>, KernelError> {
        if self.start.is_none() {
            return Ok(None);
        }
        let e = Event::timing(main.device())?;
        e.record(main)?;
        Ok(Some(e))
    }

    /// Reads the finished run's duration and intervals (all events have completed).
    pub(super) fn collect(
        &mut self,
        rank: DeviceId,
        end: Option<Event>,
    ) -> Result<(), KernelError> {
        let Some(start) = self.start.take() else {
            self.pending.clear();
            self.last_run_us = None;
            return Ok(());
        };
        if let Some(end) = end {
            self.last_run_us = Some(f64::from(Event::elapsed_ms(&start, &end)?) * 1e3);
        }
        self.intervals.clear();
        for p in self.pending.drain(..) {
            let s = f64::from(Event::elapsed_ms(&start, &p.start)?) * 1e3;
            let e = f64::from(Event::elapsed_ms(&start, &p.end)?) * 1e3;
            self.intervals.push(Interval {
                rank,
                stream: p.stream,
                kind: p.kind,
                name: p.name,
                transport: p.transport,
                preorder: p.preorder,
                iteration: p.iteration,
                start_us: s,
                end_us: e,
            });
        }
        Ok(())
    }

    /// Forgets an unfinished run (after an error).
    pub(super) fn reset(&mut self) {
        self.start = None;
        self.pending.clear();
        self.captured = None;
    }
}

/// An interval recorded as two event record nodes of a graph (see
/// [`Timeline::retarget_for_replay`]).
#[derive(Debug)]
pub(crate) struct CapturedInterval(Pending);
