//! [`GraphRecorder`]: one step of a run recorded as a CUDA graph on the main stream and
//! replayed, and the memory the recording uses held until the run's device work is done.

use meshflow_kernels::Graph;

use super::core::{dev_err, DeviceCore};
use crate::runtime::backend::BackendError;

/// A step recorded as a graph: recording (`exec` empty) or replayed (until the run ends).
#[derive(Debug)]
struct Recording {
    exec: Option<Graph>,
}

/// The graph of the current run, if one is recorded.
#[derive(Debug, Default)]
pub(super) struct GraphRecorder {
    recording: Option<Recording>,
}

impl GraphRecorder {
    /// Starts capturing the core's main stream (and the streams forked from it).
    pub fn begin(&mut self, core: &mut DeviceCore) -> Result<(), BackendError> {
        if self.recording.is_some() {
            return Err(BackendError::Invalid(
                "a graph is already being recorded".into(),
            ));
        }
        if core.streams[0].is_legacy_default() {
            return Err(BackendError::Invalid(format!(
                "rank {}: a run cannot be recorded as a CUDA graph on the legacy default stream \
                 (it cannot be captured): give the backend a stream of its own, forked from the \
                 caller's with an event",
                core.rank
            )));
        }
        core.step_started()?;
        core.streams[0]
            .begin_capture()
            .map_err(core.err("cuStreamBeginCapture"))?;
        // Profiling intervals become event record nodes of the graph, retargeted per replay.
        core.timeline.begin_capture();
        core.memory.begin_hold();
        self.recording = Some(Recording { exec: None });
        Ok(())
    }

    /// Ends the capture and launches `replays` replays of it (0: drop the recording).
    pub fn end(&mut self, core: &mut DeviceCore, replays: usize) -> Result<(), BackendError> {
        let Some(state) = self.recording.as_mut() else {
            return Err(BackendError::Invalid(
                "end_graph without begin_graph".into(),
            ));
        };
        let made = core.streams[0].end_capture();
        let captured = core.timeline.end_capture();
        if replays == 0 {
            // Nothing will replay: forget the recording now.
            drop(made);
            return self.end_run(core);
        }
        let exec = made.map_err(|e| dev_err(core.rank, "cuStreamEndCapture", e))?;
        // The run's device time is that of the replays (the steps), not of the host's
        // recording and instantiation, during which the device idles. Instantiation takes
        // each rank a different time: with a start barrier, the ranks meet again first.
        core.align_ranks("replays")?;
        core.timeline
            .restart(&core.streams[0])
            .map_err(core.err("cuEventRecord"))?;
        for _ in 0..replays {
            // Each replay records its intervals into events of its own.
            core.timeline
                .retarget_for_replay(&exec, &captured)
                .map_err(|e| dev_err(core.rank, "cuGraphExecEventRecordNodeSetEvent", e))?;
            exec.replay(&core.streams[0])
                .map_err(|e| dev_err(core.rank, "cuGraphLaunch", e))?;
        }
        state.exec = Some(exec);
        Ok(())
    }

    /// After a run's device work is done: drops its graph and returns the memory the graph
    /// used to the allocator.
    pub fn end_run(&mut self, core: &mut DeviceCore) -> Result<(), BackendError> {
        let Some(state) = self.recording.take() else {
            return Ok(());
        };
        drop(state.exec);
        let streams = core.streams.clone();
        let e = core.err("cuEventRecord");
        core.memory
            .end_hold(|| streams.iter().map(|s| s.record_event()).collect())
            .map_err(e)
    }
}
