//! The MoE-over-NVLink transport: MoE dispatch and combine through the NVLink kernels of
//! `meshflow-kernels` ([`NvlinkMoe`]: rows stored straight into the peers' peer-mapped
//! buffers, device-side flags). Selected for teams whose GPUs are all in this process with
//! peer access; the engines of a team are made together by its first member through the
//! launch's [`PeerHub`] and each member takes its own.
//!
//! The engines keep their step number on the device and can be replayed in a CUDA graph (the
//! kernels crate tests that), but recording runtime steps that use them is not enabled yet: the
//! transport still refuses graph recording until the runtime path is tested on GPUs.

use std::sync::Arc;

use meshflow_kernels::moe::{MoeShape, MoeTransport, NvlinkMoe};
use meshflow_passes::Transport;

use super::hub::PeerHub;
use super::moe::{EngineSource, MoeTeams};
use super::object::PostCx;
use crate::runtime::backend::{BackendError, TeamInfo};
use crate::runtime::cuda::core::dev_err;

/// Makes NVLink MoE engines through the launch's hub.
pub(super) struct NvlinkEngines {
    hub: Arc<PeerHub>,
}

/// The MoE-over-NVLink transport of one rank.
pub(super) fn moe_over_nvlink(hub: Arc<PeerHub>) -> MoeTeams<NvlinkEngines> {
    MoeTeams::new(NvlinkEngines { hub })
}

impl EngineSource for NvlinkEngines {
    type Engine = NvlinkMoe;
    const TRANSPORT: Transport = Transport::Nvlink;

    fn make(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        shape: &MoeShape,
    ) -> Result<NvlinkMoe, BackendError> {
        let core = &*cx.core;
        let rank = core.rank;
        let timeout = core.timeout;
        let abort = || core.aborted();
        let mut engine = self.hub.nvlink_engine(
            &team.members,
            team.my_index,
            shape,
            timeout,
            &abort,
            |devices| {
                NvlinkMoe::team(devices, shape)
                    .map_err(|e| dev_err(rank, "creating the NVLink MoE transport", e))
            },
        )?;
        engine.set_flag_timeout(timeout);
        Ok(engine)
    }

    fn engine(e: &mut NvlinkMoe) -> &mut dyn MoeTransport {
        e
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        Some(
            "recording steps with the NVLink MoE transport is not enabled yet; force the NCCL \
             transport to record graphs",
        )
    }
}
