//! The MoE-over-NCCL transport: MoE dispatch and combine through the NCCL engine of
//! `meshflow-kernels` ([`NcclMoe`]: padded per-destination blocks, grouped send/recv, counts
//! exchanged on the device). Each engine has its own communicator, made through the
//! rendezvous like the team ones (cached for the process under `<namespace>/moe`). In runs
//! split into nodes, the blocks for members on other nodes go through the host proxy.

use meshflow_kernels::moe::{MoeShape, MoeTransport, MoeWire, NcclMoe};
use meshflow_kernels::KernelError;
use meshflow_passes::Transport;

use super::moe::{EngineSource, MoeTeams};
use super::object::PostCx;
use super::proxy::{ProxyAccess, MOE_ROUTE};
use crate::runtime::backend::{BackendError, TeamInfo};
use crate::runtime::cuda::teams::{self, TeamKey};

/// Makes NCCL MoE engines (with a route through the host proxy where the team crosses nodes).
pub(super) struct NcclEngines {
    proxy: Option<ProxyAccess>,
    crosses_nodes: bool,
}

/// An NCCL MoE engine and the key its communicator is cached under.
pub(super) struct NcclEngine {
    key: TeamKey,
    moe: NcclMoe,
}

/// The MoE-over-NCCL transport of one rank.
pub(super) fn moe_over_nccl(proxy: Option<ProxyAccess>) -> MoeTeams<NcclEngines> {
    MoeTeams::new(NcclEngines {
        proxy,
        crosses_nodes: false,
    })
}

impl EngineSource for NcclEngines {
    type Engine = NcclEngine;
    const TRANSPORT: Transport = Transport::Nccl;

    fn make(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        shape: &MoeShape,
        wire: MoeWire,
    ) -> Result<NcclEngine, BackendError> {
        let core = &*cx.core;
        let lib = cx.comms.loaded()?.clone();
        let key = TeamKey {
            namespace: format!("{}/moe", core.namespace()),
            ordinal: core.device.ordinal(),
            members: team.members.clone(),
        };
        let comm = match teams::checkout(&key) {
            Some(c) => c,
            None => cx.comms.create(core, &lib, &key, team.my_index)?,
        };
        let mut moe = NcclMoe::with_wire(comm, shape, wire)
            .map_err(core.err("creating the NCCL MoE transport"))?;
        if let Some(p) = &self.proxy {
            if let Some(route) = p.new_route(core, &team.members, MOE_ROUTE)? {
                moe.set_route(route);
                self.crosses_nodes = true;
            }
        }
        Ok(NcclEngine { key, moe })
    }

    fn engine(e: &mut NcclEngine) -> &mut dyn MoeTransport {
        &mut e.moe
    }

    fn route_failure(e: &NcclEngine) -> Option<KernelError> {
        e.moe.route_failure()
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        self.crosses_nodes
            .then_some("MoE rows for other nodes are staged through the host proxy by the host")
    }

    /// Hands the engine's communicator back to the cache (healthy ranks) or drops it.
    fn release(e: NcclEngine, healthy: bool) {
        if healthy {
            teams::checkin(e.key, e.moe.into_comm());
        }
    }
}
