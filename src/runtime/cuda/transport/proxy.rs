//! The host-proxy transport: collective permutes of teams with members on other nodes go
//! through the inter-node host proxy of `meshflow-kernels` ([`StagedRoute`]), staged in host
//! memory by the rank's thread; the peers of this node stay on NCCL. Nodes come from
//! [`CudaConfig::node_size`](crate::runtime::cuda::CudaConfig) or `MESHFLOW_NODE_SIZE`.
//! The MoE-over-NCCL transport reaches other nodes through routes of the same proxy
//! ([`ProxyAccess::new_route`]).
//!
//! Transfers are ordered on the rank's streams (staging copies into pinned host memory, the
//! device waits for a flag the route's receive thread raises), so the rank's thread never
//! waits for a peer. Every member of a team issues the team's permutes in the same order, so
//! each rank numbers its messages per team; a rank that fails tells the other nodes through its
//! proxy; a failed transfer releases the streams waiting for it and fails the run when it
//! finishes. A step with such transfers cannot be recorded as a CUDA graph.

use std::sync::Arc;

use meshflow_ir::DeviceId;
use meshflow_kernels::proxy::{CancelCheck, Proxy, StagedRoute, Topology};
use meshflow_passes::Transport;

use super::object::{CommTransport, PostCx, Posted};
use crate::runtime::backend::{BackendError, CommRequest, InstCtx, TeamInfo, TensorView};
use crate::runtime::cuda::core::{dev_err, DeviceCore};
use crate::runtime::cuda::layout::kdtype;
use crate::runtime::cuda::memory::CudaBuffer;

/// Message domains of the routes of one team: collective permutes.
const PERMUTE_ROUTE: u64 = 1;
/// MoE dispatch and combine rows.
pub(super) const MOE_ROUTE: u64 = 2;

/// A rank's host proxy and the nodes of the run.
#[derive(Debug, Clone)]
pub(crate) struct ProxyAccess {
    pub proxy: Arc<Proxy>,
    pub topology: Topology,
}

impl ProxyAccess {
    /// A new route of the core's rank within `members` (`purpose`: a message domain), or
    /// `None` when every member is on this rank's node.
    pub(super) fn new_route(
        &self,
        core: &DeviceCore,
        members: &[DeviceId],
        purpose: u64,
    ) -> Result<Option<StagedRoute>, BackendError> {
        if members
            .iter()
            .all(|&m| self.topology.same_node(core.rank, m))
        {
            return Ok(None);
        }
        let cancel: Option<CancelCheck> = core.abort.clone().map(|a| {
            let check: CancelCheck = Arc::new(move || a.first());
            check
        });
        StagedRoute::new(
            self.proxy.clone(),
            &core.device,
            &self.topology,
            members.to_vec(),
            purpose,
            core.timeout,
            cancel,
        )
        .map(Some)
        .map_err(core.err("proxy route"))
    }
}

/// The host-proxy transport of one rank: its proxy and one route per team crossing nodes.
pub(crate) struct HostProxy {
    access: ProxyAccess,
    routes: Vec<(Vec<DeviceId>, StagedRoute)>,
}

impl HostProxy {
    pub fn new(access: ProxyAccess) -> HostProxy {
        HostProxy {
            access,
            routes: Vec::new(),
        }
    }

    /// The index in `routes` of this rank's permute route for `team`.
    fn route(&mut self, core: &DeviceCore, team: &TeamInfo) -> Result<usize, BackendError> {
        if let Some(i) = self.routes.iter().position(|(m, _)| *m == team.members) {
            return Ok(i);
        }
        let route = self
            .access
            .new_route(core, &team.members, PERMUTE_ROUTE)?
            .ok_or_else(|| {
                BackendError::Invalid(format!(
                    "rank {}: the host proxy was selected for team {:?}, all on this node",
                    core.rank, team.members
                ))
            })?;
        self.routes.push((team.members.clone(), route));
        Ok(self.routes.len() - 1)
    }

    /// A collective permute with peers on other nodes: the send to another node goes through
    /// the proxy first (it only waits for this rank's data), then NCCL moves the parts with
    /// peers of this node, then the message from another node is copied in.
    fn permute(
        &mut self,
        cx: &mut PostCx<'_>,
        team: &TeamInfo,
        send_peer: usize,
        recv_peer: usize,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
    ) -> Result<(), BackendError> {
        const NAME: &str = "collective_permute";
        super::nccl::check_permute(input, output)?;
        let my = team.my_index;
        if send_peer == my && recv_peer == my {
            return cx.core.local_copy(NAME, input, output);
        }
        let ri = self.route(cx.core, team)?;
        let (far_send, far_recv) = {
            let r = &self.routes[ri].1;
            (r.is_remote(send_peer), r.is_remote(recv_peer))
        };
        let core = &mut *cx.core;
        let e = core.err(&format!("{NAME} on team {:?}", team.members));
        let send = core.input_region(input)?;
        let slot = core.output_slot(output, &[input])?;
        let s = core.stream().clone();
        let route = &mut self.routes[ri].1;
        let tag = route.next_tag();
        if far_send {
            route.send(&s, send_peer, tag, &[&send]).map_err(&e)?;
        }
        if !far_send || !far_recv {
            let comm = cx.comms.of(core.rank, team)?;
            super::nccl::send_recv(
                cx.comms.loaded()?,
                comm,
                (!far_send).then_some((&send, send_peer)),
                (!far_recv).then_some((&slot.buf, recv_peer)),
                kdtype(input.dtype),
                &s,
            )
            .map_err(&e)?;
        }
        if far_recv {
            route.recv(&s, recv_peer, tag, &[&slot.buf]).map_err(&e)?;
        }
        core.finish_output(slot)
    }
}

impl CommTransport for HostProxy {
    fn kind(&self) -> Transport {
        Transport::HostProxy
    }

    fn post(
        &mut self,
        cx: &mut PostCx<'_>,
        request: &CommRequest<'_, CudaBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Posted, BackendError> {
        let CommRequest::Permute {
            team,
            send_peer,
            recv_peer,
            input,
            output,
            ..
        } = request
        else {
            return Err(BackendError::Invalid(format!(
                "{} is not carried by the host proxy",
                request.name()
            )));
        };
        let opened = cx
            .core
            .begin_op(request.name(), Transport::HostProxy, ctx)?;
        self.permute(cx, team, *send_peer, *recv_peer, input, output)?;
        Ok(Posted::OnStream(opened))
    }

    fn capture_blocker(&self) -> Option<&'static str> {
        Some("transfers through the host proxy are staged by the host")
    }

    fn transfer_failure(&self, rank: DeviceId) -> Option<BackendError> {
        let e = self.routes.iter().find_map(|(_, r)| r.failure())?;
        Some(dev_err(rank, "a transfer through the host proxy", e))
    }
}
