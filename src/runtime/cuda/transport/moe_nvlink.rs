//! The MoE-over-NVLink transport: MoE dispatch and combine through the NVLink kernels of
//! `meshflow-kernels` ([`NvlinkMoe`]: rows stored straight into the peers' mapped buffers,
//! device-side flags). Selected for teams whose GPUs reach each other's memory: in this
//! process (the engines of a team are made together by its first member through the launch's
//! hub), or in processes of one host over CUDA IPC (each member makes its own and they
//! exchange handles at the rendezvous); the team's [`PeerLink`] does either.
//!
//! The engines keep their step number (epoch) on the device and the runtime's dispatch and
//! combine are device work only (copies, casts, the engine's kernels; the engine is made in the
//! first, unrecorded step), so steps using them can be recorded as CUDA graphs and replayed.

use std::sync::Arc;

use meshflow_kernels::moe::{MoeShape, MoeTransport, MoeWire, NvlinkMoe};
use meshflow_passes::Transport;

use super::moe::{EngineSource, MoeTeams};
use super::object::PostCx;
use super::peers::PeerLink;
use crate::runtime::backend::{BackendError, TeamInfo};

/// Makes NVLink MoE engines through the team's link.
pub(super) struct NvlinkEngines {
    link: Arc<dyn PeerLink>,
}

/// The MoE-over-NVLink transport of one rank.
pub(super) fn moe_over_nvlink(link: Arc<dyn PeerLink>) -> MoeTeams<NvlinkEngines> {
    MoeTeams::new(NvlinkEngines { link })
}

impl EngineSource for NvlinkEngines {
    type Engine = NvlinkMoe;
    const TRANSPORT: Transport = Transport::Nvlink;

    fn make(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<NvlinkMoe, BackendError> {
        let core = &*cx.core;
        let mut engine = self.link.nvlink_engine(core, team, shape, wire)?;
        engine.set_flag_timeout(core.timeout);
        // A failing rank of this process ends the engine's waits for peers at once.
        if let Some(abort) = &core.abort {
            abort.watch(engine.abort_word());
        }
        Ok(engine)
    }

    fn engine(e: &mut NvlinkMoe) -> &mut dyn MoeTransport {
        e
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        None
    }

    /// After a failure, the engine's waits for peers give up at once (its abort word: so that
    /// dropping it, which waits for its kernels, does not wait for the flag timeout).
    fn release(e: NvlinkMoe, healthy: bool) {
        if !healthy {
            e.abandon();
        }
    }
}
