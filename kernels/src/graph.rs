//! CUDA graphs: record the device work issued to a stream (and the streams forked from it
//! through events) once, then replay it with one call.

use std::fmt;

use cudarc::driver::sys;

use crate::device::{drv, Device};
use crate::error::Result;
use crate::stream::Stream;

/// An instantiated graph of one device, replayed with [`Graph::replay`]. Destroyed on drop
/// (after the device work of its launches, which the caller must have waited for).
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    device: Device,
}

impl Stream {
    /// Starts capturing this stream in relaxed mode: work issued to it (and to streams that
    /// wait on events recorded in it) is recorded instead of run, until
    /// [`Stream::end_capture`].
    pub fn begin_capture(&self) -> Result<()> {
        let s = self.bind_raw()?;
        // SAFETY: a live stream of the current context.
        drv("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                s,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
            .result()
        })
    }

    /// Ends the capture started with [`Stream::begin_capture`] and instantiates the graph.
    /// Every stream forked from this one must have been joined back into it.
    pub fn end_capture(&self) -> Result<Graph> {
        let s = self.bind_raw()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: a live stream of the current context; `graph` is a valid out pointer.
        drv("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(s, &mut graph).result()
        })?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` was just created by the capture; `exec` is a valid out pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0).result() };
        if let Err(e) = r {
            // SAFETY: the graph is ours and not instantiated.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            return drv("cuGraphInstantiate", Err(e));
        }
        Ok(Graph {
            graph,
            exec,
            device: self.device().clone(),
        })
    }
}

impl Graph {
    /// Enqueues one replay of the graph on `stream` (of the graph's device).
    pub fn replay(&self, stream: &Stream) -> Result<()> {
        stream.expect_device(&self.device, "a graph launch")?;
        let s = stream.bind_raw()?;
        // SAFETY: a live executable graph and a live stream of the same context.
        drv("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, s).result()
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        // SAFETY: both handles are ours; the caller waited for the graph's launches.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.device.ordinal())
            .finish()
    }
}
