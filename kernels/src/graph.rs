//! CUDA graphs: record the device work issued to a stream (and the streams forked from it
//! through events) once, then replay it with one call. Events recorded with
//! [`Event::record_external`] during the capture become event record nodes; each replay can
//! record a different event in their place ([`Graph::retarget_event`]), so that the parts of
//! every replay can be timed.

use std::fmt;

use cudarc::driver::sys;

use crate::device::{drv, Device};
use crate::error::{KernelError, Result};
use crate::event::Event;
use crate::stream::Stream;

/// An instantiated graph of one device, replayed with [`Graph::replay`]. Destroyed on drop
/// (after the device work of its launches, which the caller must have waited for).
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    device: Device,
    /// The event record nodes of the graph and the event each recorded when captured.
    event_nodes: Vec<(sys::CUevent, sys::CUgraphNode)>,
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
        let mut made = Graph {
            graph,
            exec,
            device: self.device().clone(),
            event_nodes: Vec::new(),
        };
        made.event_nodes = event_record_nodes(graph)?;
        Ok(made)
    }
}

/// The event record nodes of `graph` (top level) with the events they record.
fn event_record_nodes(graph: sys::CUgraph) -> Result<Vec<(sys::CUevent, sys::CUgraphNode)>> {
    let mut n = 0usize;
    // SAFETY: a live graph; a null node array asks for the count only.
    drv("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n).result()
    })?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` has room for `n` handles, the count passed in.
    drv("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n).result()
    })?;
    nodes.truncate(n);
    let mut found = Vec::new();
    for node in nodes {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph; `ty` is a valid out pointer.
        drv("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(node, &mut ty).result()
        })?;
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EVENT_RECORD {
            continue;
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: an event record node of the live graph; `ev` is a valid out pointer.
        drv("cuGraphEventRecordNodeGetEvent", unsafe {
            sys::cuGraphEventRecordNodeGetEvent(node, &mut ev).result()
        })?;
        found.push((ev, node));
    }
    Ok(found)
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

impl Graph {
    /// Makes the later replays record `now` where the capture recorded `captured` (an event
    /// recorded with [`Event::record_external`] during the capture); replays already
    /// enqueued keep the event they had. Errors when the graph has no such node.
    pub fn retarget_event(&self, captured: &Event, now: &Event) -> Result<()> {
        if !now.device().same_as(&self.device) {
            return Err(KernelError::InvalidArgument(format!(
                "an event of device {} for a graph of device {}",
                now.device().ordinal(),
                self.device.ordinal()
            )));
        }
        let node = self
            .event_nodes
            .iter()
            .find(|(e, _)| *e == captured.raw())
            .map(|(_, n)| *n)
            .ok_or_else(|| {
                KernelError::InvalidArgument(
                    "the graph records no such event (record it with Event::record_external \
                     during the capture)"
                        .into(),
                )
            })?;
        self.device.bind()?;
        // SAFETY: a live executable graph, one of its event record nodes, a live event of the
        // same context.
        drv("cuGraphExecEventRecordNodeSetEvent", unsafe {
            sys::cuGraphExecEventRecordNodeSetEvent(self.exec, node, now.raw()).result()
        })
    }

    /// How many event record nodes the graph has.
    pub fn event_record_nodes(&self) -> usize {
        self.event_nodes.len()
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
