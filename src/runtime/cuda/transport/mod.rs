//! Transports: one object per way of moving bytes between GPUs, behind one trait
//! ([`CommTransport`]), each working on the rank's [`DeviceCore`]:
//!
//! - `nccl.rs`: every collective kind and collective permutes over NCCL;
//! - `copy_engine.rs`: permutes, broadcasts and sum reduce-scatters between GPUs that reach
//!   each other's memory, as copy-engine pulls;
//! - `proxy.rs`: permutes with peers on other nodes, staged through the host proxy;
//! - `moe_nccl.rs`, `moe_nvlink.rs`: MoE dispatch and combine over NCCL or the NVLink kernels
//!   (the request handling they share is `moe.rs`).
//!
//! The copy engine and MoE over NVLink reach the peers' memory through a [`PeerLink`]
//! (`peers.rs`): the launch's hub for ranks that are threads of one process (`hub.rs`), CUDA
//! IPC for ranks in several processes of one host (`ipc/`).
//!
//! The trait and what a post gets are in `object.rs`; this file only selects and holds the
//! objects (it depends on every transport file, none depends on it).
//!
//! [`Transports`] selects the carrier of every communication label once, when a program is
//! prepared, with the rules of `src/runtime/transport_rules.rs`, and makes the objects the
//! program needs. A post goes straight to its label's object: there is no fallback from one
//! transport to another at run time.

mod copy_engine;
mod hub;
mod ipc;
mod moe;
mod moe_nccl;
mod moe_nvlink;
mod nccl;
mod object;
mod peers;
mod proxy;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use meshflow_ir::{Arena, DeviceId, EntityRef};
use meshflow_passes::Transport;

use super::config::CudaConfig;
use super::core::DeviceCore;
use crate::runtime::backend::{BackendError, CommLabel, CommOp, PlanInfo, TeamId};
use crate::runtime::transport_rules::{select, Carrier, TeamFacts, Wants};

pub(crate) use hub::HubLink;
pub use hub::PeerHub;
pub(crate) use ipc::IpcLink;
pub(crate) use object::{CommTransport, PostCx, Posted};
pub(crate) use peers::PeerLink;
pub(crate) use proxy::ProxyAccess;

/// Where the selection looks up the facts of a team.
pub(crate) struct Environment<'a> {
    /// How this rank reaches its peers' memory, if it can.
    pub link: Option<&'a Arc<dyn PeerLink>>,
    pub proxy: Option<&'a ProxyAccess>,
    pub config: &'a CudaConfig,
}

/// The transport objects of a rank and the carrier of every label of the prepared program.
#[derive(Default)]
pub(crate) struct Transports {
    objects: Vec<(Carrier, Box<dyn CommTransport>)>,
    /// Per label of the prepared program.
    routes: Vec<Option<Carrier>>,
}

impl std::fmt::Debug for Transports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let objects: Vec<Carrier> = self.objects.iter().map(|(c, _)| *c).collect();
        f.debug_struct("Transports")
            .field("objects", &objects)
            .field("routes", &self.routes)
            .finish()
    }
}

impl Transports {
    /// Selects the carrier of every communication of `info` and prepares the objects.
    pub fn prepare(
        &mut self,
        core: &DeviceCore,
        info: &PlanInfo<'_>,
        env: &Environment<'_>,
    ) -> Result<(), BackendError> {
        let forced = env.config.transport;
        let wants = Wants {
            forced,
            graph: env.config.graph,
        };
        self.routes.clear();
        // Whether each team's ranks reach each other's memory, decided with its members.
        let mut access: Arena<TeamId, Option<peers::Access>> = Arena::new();
        for _ in info.teams.keys() {
            access.push(None);
        }
        if let (Some(link), false) = (env.link, forced == Some(Transport::Nccl)) {
            let multi: Vec<TeamId> = info
                .teams
                .iter()
                .filter(|(_, t)| t.members.len() > 1)
                .map(|(id, _)| id)
                .collect();
            let lists: Vec<&[DeviceId]> = multi
                .iter()
                .map(|&id| info.teams[id].members.as_slice())
                .collect();
            for (id, a) in multi.into_iter().zip(link.decide(core, &lists)?) {
                access[id] = Some(a);
            }
        }
        let mut facts: Arena<TeamId, TeamFacts> = Arena::new();
        for (t, a) in info.teams.values().zip(access.values()) {
            let crosses_nodes = env.proxy.is_some_and(|p| {
                t.members
                    .iter()
                    .any(|&m| !p.topology.same_node(core.rank, m))
            });
            facts.push(TeamFacts {
                size: t.members.len(),
                peer_access: matches!(a, Some(Ok(()))),
                crosses_nodes,
            });
        }
        let mut carried: Vec<(Carrier, TeamId)> = Vec::new();
        for c in info.comms.values() {
            let (Some(op), team) = (&c.op, c.team) else {
                self.routes.push(None);
                continue;
            };
            let carrier = match team.and_then(|t| Some((t, facts.get(t)?))) {
                Some((t, f)) => {
                    let carrier = select(op, c.grouped, f, wants).map_err(|why| {
                        let detail = match (env.link, access.get(t)) {
                            (Some(l), Some(Some(Err(no)))) => format!(" ({}: {no})", l.name()),
                            _ => String::new(),
                        };
                        BackendError::Invalid(format!(
                            "rank {}: `{}` ({}) on team {:?}: {why}{detail}",
                            core.rank,
                            c.name,
                            c.comm,
                            info.team(t).map(|t| t.members.clone()).unwrap_or_default()
                        ))
                    })?;
                    if !carried.contains(&(carrier, t)) {
                        carried.push((carrier, t));
                    }
                    carrier
                }
                // The end of a coalescing group: an NCCL group.
                None if matches!(op, CommOp::Group) => Carrier::Nccl,
                None => {
                    return Err(BackendError::Invalid(format!(
                        "rank {}: `{}` ({}) names no team",
                        core.rank, c.name, c.comm
                    )))
                }
            };
            self.routes.push(Some(carrier));
        }
        for (carrier, t) in carried {
            let team = &info.teams[t];
            self.object(carrier, env)?.prepare_team(core, team)?;
        }
        Ok(())
    }

    /// The object of `carrier`, made on first use.
    fn object(
        &mut self,
        carrier: Carrier,
        env: &Environment<'_>,
    ) -> Result<&mut Box<dyn CommTransport>, BackendError> {
        let i = match self.objects.iter().position(|(c, _)| *c == carrier) {
            Some(i) => i,
            None => {
                let made: Box<dyn CommTransport> = match carrier {
                    Carrier::Nccl => Box::new(nccl::NcclTransport),
                    Carrier::CopyEngine => Box::new(copy_engine::CopyEngine::new(
                        need(env.link, "the copy engine", "a link to the peers' memory")?.clone(),
                        env.config.copy_stream,
                        env.config.defer_pulls,
                    )),
                    Carrier::HostProxy => Box::new(proxy::HostProxy::new(
                        need(env.proxy, "the host proxy", "a host proxy")?.clone(),
                    )),
                    Carrier::MoeNccl => Box::new(moe_nccl::moe_over_nccl(env.proxy.cloned())),
                    Carrier::MoeNvlink => Box::new(moe_nvlink::moe_over_nvlink(
                        need(env.link, "MoE over NVLink", "a link to the peers' memory")?.clone(),
                    )),
                };
                self.objects.push((carrier, made));
                self.objects.len() - 1
            }
        };
        Ok(&mut self.objects[i].1)
    }

    /// The object that carries `label`.
    pub fn carrier_of(
        &mut self,
        label: CommLabel,
    ) -> Result<&mut Box<dyn CommTransport>, BackendError> {
        let carrier = self
            .routes
            .get(label.index())
            .copied()
            .flatten()
            .ok_or_else(|| {
                BackendError::Invalid(format!("{label:?} was not selected a transport"))
            })?;
        self.objects
            .iter_mut()
            .find(|(c, _)| *c == carrier)
            .map(|(_, o)| o)
            .ok_or_else(|| BackendError::Invalid(format!("no {carrier:?} transport was made")))
    }

    /// The transport that carries `label`.
    pub fn transport_of(&self, label: CommLabel) -> Option<Transport> {
        self.routes
            .get(label.index())
            .copied()
            .flatten()
            .map(Carrier::transport)
    }

    /// Why the transports of the prepared program cannot be recorded as a CUDA graph.
    pub fn capture_blocker(&self) -> Option<(Transport, &'static str)> {
        self.objects
            .iter()
            .filter(|(c, _)| self.routes.contains(&Some(*c)))
            .find_map(|(_, o)| o.capture_blocker().map(|why| (o.kind(), why)))
    }

    /// The first failure of a transfer of any object.
    pub fn transfer_failure(&self, rank: DeviceId) -> Option<BackendError> {
        self.objects
            .iter()
            .find_map(|(_, o)| o.transfer_failure(rank))
    }

    /// Checks every object's device status after a run.
    pub fn check_status(&mut self, core: &DeviceCore) -> Result<(), BackendError> {
        for (_, o) in &mut self.objects {
            o.check_status(core)?;
        }
        Ok(())
    }

    /// Releases every object (see [`CommTransport::release`]).
    pub fn release(&mut self, healthy: bool) {
        for (_, o) in &mut self.objects {
            o.release(healthy);
        }
    }
}

fn need<'a, T>(v: Option<&'a T>, who: &str, what: &str) -> Result<&'a T, BackendError> {
    v.ok_or_else(|| BackendError::Invalid(format!("{who} was selected without {what}")))
}
