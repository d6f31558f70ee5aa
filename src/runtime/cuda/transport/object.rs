//! [`CommTransport`]: the trait every transport object implements, and what a post gets
//! ([`PostCx`]) and returns ([`Posted`]).

use meshflow_ir::DeviceId;
use meshflow_kernels::Event;
use meshflow_passes::Transport;

use crate::runtime::backend::{BackendError, CommRequest, InstCtx, TeamInfo};
use crate::runtime::cuda::core::{CudaComm, DeviceCore};
use crate::runtime::cuda::memory::CudaBuffer;
use crate::runtime::cuda::profile::Opened;
use crate::runtime::cuda::teams::Communicators;

/// What a transport's post needs besides itself: the rank's device core and the NCCL
/// communicators of its teams.
pub(crate) struct PostCx<'a> {
    pub core: &'a mut DeviceCore,
    pub comms: &'a Communicators,
}

/// How a posted communication completes.
pub(crate) enum Posted {
    /// Enqueued on the current stream (inside a coalescing group: issued at the group's end);
    /// the backend closes its profiling interval, then records its completion there.
    OnStream(Option<Opened>),
    /// Complete once these events are (recorded by the transport on the streams it used).
    Events(Vec<Event>),
    /// Deferred: its work is enqueued later (a copy-engine pull queued in the core's
    /// `deferred`, see `deferred.rs`), which fills in the handle's events; a `wait` on it
    /// finishes it first.
    Deferred(CudaComm),
}

/// One transport: the object that moves the bytes of the communications selected for it.
pub(crate) trait CommTransport {
    /// Which transport this is (for traces and reports).
    fn kind(&self) -> Transport;

    /// Called when a program is prepared, for every team whose communications this object
    /// carries.
    fn prepare_team(&mut self, core: &DeviceCore, team: &TeamInfo) -> Result<(), BackendError> {
        let _ = (core, team);
        Ok(())
    }

    /// Posts `request` on the core's current stream.
    fn post(
        &mut self,
        cx: &mut PostCx<'_>,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError>;

    /// Why a step using this transport cannot be recorded as a CUDA graph, if it cannot.
    fn capture_blocker(&self) -> Option<&'static str> {
        None
    }

    /// The first failure of a transfer that went on without the host (after the device is
    /// done with a run).
    fn transfer_failure(&self, rank: DeviceId) -> Option<BackendError> {
        let _ = rank;
        None
    }

    /// Reads and clears device-side status after a run (the device is idle).
    fn check_status(&mut self, core: &DeviceCore) -> Result<(), BackendError> {
        let _ = core;
        Ok(())
    }

    /// Releases what the object holds: hands healthy resources back for reuse, or drops them
    /// after a failure.
    fn release(&mut self, healthy: bool) {
        let _ = healthy;
    }
}
