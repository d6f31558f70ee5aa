//! Completing communications on the core's streams: one at once, or the members of a
//! coalescing group when it ends.

use std::rc::Rc;

use meshflow_passes::Transport;

use super::core::{CudaComm, DeviceCore, Group};
use super::profile::IntervalKind;
use crate::runtime::backend::{BackendError, InstCtx};

impl DeviceCore {
    /// Completes a communication enqueued on the current stream: inside a coalescing group
    /// its handle is filled when the group ends; outside, it is an event recorded now. Its
    /// profiling interval must be closed already (see [`Self::close_op`]): the completion event
    /// is the runtime's bookkeeping, not the communication's device work, and an event record
    /// costs the stream about as much as a small kernel.
    pub fn complete_on_stream(&mut self) -> Result<CudaComm, BackendError> {
        match self.group.as_mut() {
            Some(g) => {
                let handle = CudaComm::default();
                if !g.streams.contains(&self.current) {
                    g.streams.push(self.current);
                }
                g.members.push(handle.clone());
                Ok(handle)
            }
            None => {
                let e = self
                    .stream()
                    .record_event()
                    .map_err(self.err("cuEventRecord"))?;
                Ok(CudaComm::on_stream(self.current, e))
            }
        }
    }

    /// Ends the open coalescing group: `issue` issues its communications (NCCL's group end),
    /// then outputs written through temporaries are copied into their views, and every member's
    /// handle becomes complete once all streams the group used are (one interval `coalesced`,
    /// carried by `transport`, covers it).
    pub fn end_group(
        &mut self,
        transport: Option<Transport>,
        ctx: InstCtx<'_>,
        issue: impl FnOnce() -> Result<(), BackendError>,
    ) -> Result<CudaComm, BackendError> {
        let g = self
            .group
            .take()
            .ok_or_else(|| BackendError::Invalid("end_coalescing without a group".into()))?;
        // The group's interval spans from its first member's stream position to its end.
        let opened = self
            .timeline
            .open(
                &self.streams,
                self.current,
                IntervalKind::Comm,
                "coalesced",
                transport,
                ctx.preorder,
                ctx.iteration,
            )
            .map_err(self.err("cuEventRecord"))?;
        issue()?;
        let Group {
            members,
            unstage,
            mut streams,
            temps,
        } = g;
        for u in unstage {
            let saved = self.current;
            self.current = u.stream;
            let r = self.unstage(&u.temp, &u.dst);
            self.current = saved;
            r?;
        }
        // The interval ends with the group's device work; the events below are bookkeeping.
        self.close_op(opened)?;
        if !streams.contains(&self.current) {
            streams.push(self.current);
        }
        let mut events = Vec::with_capacity(streams.len());
        for s in &streams {
            let e = self.streams[*s]
                .record_event()
                .map_err(self.err("cuEventRecord"))?;
            events.push(Rc::new(e));
        }
        for t in temps {
            let pending = streams
                .iter()
                .map(|s| self.streams[*s].record_event())
                .collect::<Result<Vec<_>, _>>()
                .map_err(self.err("cuEventRecord"))?;
            self.memory.retire(t, pending);
        }
        for m in &members {
            *m.events.borrow_mut() = Some(events.clone());
        }
        Ok(CudaComm::done_after(events))
    }
}
