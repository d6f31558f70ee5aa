//! Ranks on other nodes: collective permutes (and, in [`moe`](super::moe), MoE dispatch and
//! combine) whose peer is on another node go through the inter-node host proxy of
//! `meshflow-kernels` ([`StagedRoute`]), staged in host memory by the rank's thread; peers of
//! the same node stay on NCCL. Nodes come from [`CudaConfig::node_size`](super::CudaConfig) or
//! `MESHFLOW_NODE_SIZE` (forced splits of one host) in [`run_cuda`](super::run_cuda) and
//! [`run_rank`](super::run_rank).
//!
//! Transfers are ordered on the rank's streams (staging copies into pinned host memory, the
//! device waits for a flag the route's receive thread raises), so the rank's thread never
//! waits for a peer. Every member of a team issues the team's permutes in the same order, so
//! each rank numbers its messages per team; a rank that fails tells the other nodes through its
//! proxy ([`CudaBackend::notify_proxy_failure`]); a failed transfer releases the streams
//! waiting for it and fails the run when it finishes.

use std::sync::Arc;

use meshflow_ir::DeviceId;
use meshflow_kernels::nccl;
use meshflow_kernels::proxy::{CancelCheck, Proxy, StagedRoute, Topology};

use super::backend::CudaBackend;
use super::layout::kdtype;
use super::memory::CudaBuffer;
use crate::runtime::backend::{BackendError, TeamInfo, TensorView};

/// Message domains of the routes of one team.
pub(super) const PERMUTE_ROUTE: u64 = 1;
/// MoE dispatch and combine rows.
pub(super) const MOE_ROUTE: u64 = 2;

/// This rank's proxy and the nodes of the run.
#[derive(Debug, Clone)]
pub(super) struct ProxyAccess {
    pub proxy: Arc<Proxy>,
    pub topology: Topology,
}

impl CudaBackend {
    /// Reaches ranks of other nodes (by `topology`) through `proxy`, this rank's host proxy:
    /// collective permutes and MoE dispatch/combine with a peer on another node use it, the
    /// rest stays on NCCL. CUDA graph recording is refused once a proxy is set.
    pub fn set_proxy(&mut self, proxy: Arc<Proxy>, topology: Topology) {
        self.proxy = Some(ProxyAccess { proxy, topology });
    }

    /// Whether a team has a member on another node than this rank.
    pub(super) fn team_crosses_nodes(&self, members: &[DeviceId]) -> bool {
        self.proxy
            .as_ref()
            .is_some_and(|p| members.iter().any(|&m| !p.topology.same_node(self.rank, m)))
    }

    /// Tells the ranks of other nodes that this rank failed (their waits for its messages end
    /// at once with the reason).
    pub fn notify_proxy_failure(&self, reason: &str) {
        if let Some(p) = &self.proxy {
            p.proxy.notify_failure(self.rank, reason);
        }
    }

    /// A new route of this rank within `members` (`purpose`: [`PERMUTE_ROUTE`] or
    /// [`MOE_ROUTE`]), or `None` when every member is on this node.
    pub(super) fn new_route(
        &self,
        members: &[DeviceId],
        purpose: u64,
    ) -> Result<Option<StagedRoute>, BackendError> {
        let Some(p) = &self.proxy else {
            return Ok(None);
        };
        if !self.team_crosses_nodes(members) {
            return Ok(None);
        }
        let cancel: Option<CancelCheck> = self.abort.clone().map(|a| {
            let check: CancelCheck = Arc::new(move || a.first());
            check
        });
        StagedRoute::new(
            p.proxy.clone(),
            &self.device,
            &p.topology,
            members.to_vec(),
            purpose,
            self.config.timeout,
            cancel,
        )
        .map(Some)
        .map_err(self.err("proxy route"))
    }

    /// The index in `self.routes` of this rank's permute route for `team`, when the team
    /// crosses nodes.
    fn permute_route(&mut self, team: &TeamInfo) -> Result<Option<usize>, BackendError> {
        if let Some(i) = self.routes.iter().position(|(m, _)| *m == team.members) {
            return Ok(Some(i));
        }
        match self.new_route(&team.members, PERMUTE_ROUTE)? {
            Some(r) => {
                self.routes.push((team.members.clone(), r));
                Ok(Some(self.routes.len() - 1))
            }
            None => Ok(None),
        }
    }

    /// A collective permute with a peer on another node: the send to another node goes
    /// through the proxy first (it only waits for this rank's data), then NCCL moves the parts
    /// with peers of this node, then the message from another node is copied in. `Ok(false)`
    /// when both peers are on this node (the caller uses NCCL alone).
    pub(super) fn permute_through_proxy(
        &mut self,
        team: &TeamInfo,
        send_peer: usize,
        recv_peer: usize,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
    ) -> Result<bool, BackendError> {
        let Some(ri) = self.permute_route(team)? else {
            return Ok(false);
        };
        let (far_send, far_recv) = {
            let r = &self.routes[ri].1;
            (r.is_remote(send_peer), r.is_remote(recv_peer))
        };
        if !far_send && !far_recv {
            return Ok(false);
        }
        let call = format!("collective_permute on team {:?}", team.members);
        let e = self.err(&call);
        let send = self.input_region(input)?;
        let slot = self.output_slot(output, &[input])?;
        let s = self.streams[self.current].clone();
        let tag = self.routes[ri].1.next_tag();
        if far_send {
            self.routes[ri]
                .1
                .send(&s, send_peer, tag, &[&send])
                .map_err(&e)?;
        }
        if !far_send || !far_recv {
            let lib = self
                .nccl
                .clone()
                .ok_or_else(|| BackendError::Invalid("no NCCL library loaded".into()))?;
            let kd = kdtype(input.dtype);
            let comm = self.comm_of(team)?;
            nccl::group(&lib, || {
                if !far_send {
                    comm.send(&send, kd, send_peer, &s)?;
                }
                if !far_recv {
                    comm.recv(&slot.buf, kd, recv_peer, &s)?;
                }
                Ok(())
            })
            .map_err(&e)?;
        }
        if far_recv {
            self.routes[ri]
                .1
                .recv(&s, recv_peer, tag, &[&slot.buf])
                .map_err(&e)?;
        }
        self.finish_output(slot)?;
        Ok(true)
    }

    /// The first failure of a transfer through the host proxy in this run (permute routes
    /// and MoE engines), as a backend error.
    pub(super) fn proxy_failure(&self) -> Option<BackendError> {
        let e = self
            .routes
            .iter()
            .find_map(|(_, r)| r.failure())
            .or_else(|| self.moe.iter().find_map(|m| m.route_failure()))?;
        Some(super::backend::dev_err(
            self.rank,
            "a transfer through the host proxy",
            e,
        ))
    }
}
