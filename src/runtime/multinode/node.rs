//! [`run_node`]: one node's part of a multi-process CPU run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshflow_ir::{DeviceId, HostProgram};
use meshflow_kernels::proxy::{connect_wire, Layout, Proxy, ProxyStats, Topology, WireChoice};

use super::codec::{decode_result, encode_result, NodeResult};
use super::link::{ProxyLink, RendezvousStore};
use crate::runtime::cpu::Fabric;
use crate::runtime::data::TensorData;
use crate::runtime::ranks::{run_ranks, CpuOptions, RunFailure};
use crate::runtime::rendezvous::Rendezvous;

/// Default bytes per proxy ring (one per pair of ranks on different nodes).
pub const DEFAULT_RING: usize = 1 << 20;

/// How long a node that has run waits for the others to finish theirs. Long: a node that fails
/// aborts the rendezvous and a node process that dies is noticed by the process supervisor.
const FINISH_TIMEOUT: Duration = Duration::from_secs(3600);

/// Where a node stands in a multi-process run.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    /// This node.
    pub node: usize,
    /// The node of every rank.
    pub topology: Topology,
    /// The address this node's proxies listen on (reachable from the other nodes).
    pub host: String,
    /// Bytes per proxy ring.
    pub ring: usize,
    /// How long connection setup and the rendezvous steps may take.
    pub setup_timeout: Duration,
    /// The wire of the proxies (every node of the run must name the same).
    pub wire: WireChoice,
}

/// What a node's run produced.
#[derive(Clone, Debug)]
pub struct NodeOutcome {
    /// On node 0: the outputs of every rank of the run, gathered through the rendezvous.
    pub outputs: Option<BTreeMap<DeviceId, BTreeMap<String, TensorData>>>,
    /// The counters of this node's proxies, by rank.
    pub proxy_stats: BTreeMap<DeviceId, ProxyStats>,
    /// The wire the proxies used.
    pub wire: &'static str,
    /// Why that wire (`requested`, or what `auto` found).
    pub wire_reason: String,
    /// Wall-clock time of the run (setup excluded).
    pub elapsed: Duration,
}

/// Why a node's run failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NodeError {
    /// The node is not in the topology, or connecting the proxies failed.
    #[error("node {node}: setup failed: {message}")]
    Setup {
        /// The node.
        node: usize,
        /// What failed.
        message: String,
    },
    /// One or more ranks of this node failed.
    #[error("node {node} (ranks {ranks:?}): {failure}")]
    Run {
        /// The node.
        node: usize,
        /// Its ranks.
        ranks: Vec<DeviceId>,
        /// Every rank's error.
        failure: String,
    },
    /// Another node failed (reported through the rendezvous).
    #[error("{0}")]
    Remote(String),
}

fn key(name: &str, node: usize) -> String {
    format!("meshflow/node/{name}/{node}")
}

/// The proxies of a node's ranks, and why their wire was chosen.
#[derive(Debug, Default)]
pub(crate) struct NodeProxies {
    /// The proxies, by rank (ranks with no peer on another node have none).
    pub proxies: BTreeMap<DeviceId, Proxy>,
    /// Why the wire was chosen (empty when no rank has a proxy).
    pub reason: String,
}

/// Connects the proxies of `local` ranks (one thread each: connections are made pairwise, so
/// the ranks of a node must not wait for each other) over the wire `spec.wire` asks for; ranks
/// with no peer on another node get none. Only `spec`'s topology, host, ring, setup timeout
/// and wire are used.
pub(crate) fn connect_proxies(
    spec: &NodeSpec,
    local: &[DeviceId],
    rendezvous: &Arc<dyn Rendezvous>,
) -> Result<NodeProxies, String> {
    let store = RendezvousStore(rendezvous.clone());
    type Connected = Result<Option<(Proxy, String)>, String>;
    let results: Vec<(DeviceId, Connected)> = std::thread::scope(|s| {
        let handles: Vec<_> = local
            .iter()
            .map(|&rank| {
                let store = &store;
                let h = s.spawn(move || {
                    let layout =
                        Layout::new(&spec.topology, rank, spec.ring).map_err(|e| e.to_string())?;
                    if layout.peers.is_empty() {
                        return Ok(None);
                    }
                    let chosen = connect_wire(
                        spec.wire,
                        &spec.topology,
                        &layout,
                        &spec.host,
                        store,
                        "meshflow/proxy",
                        spec.setup_timeout,
                    )
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                    Proxy::start(layout, chosen.wire)
                        .map(|p| Some((p, chosen.reason)))
                        .map_err(|e| format!("rank {rank}: {e}"))
                });
                (rank, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(format!("rank {rank}: proxy setup panicked")));
                (rank, r)
            })
            .collect()
    });
    let mut out = NodeProxies::default();
    for (rank, r) in results {
        if let Some((p, reason)) = r? {
            out.proxies.insert(rank, p);
            out.reason = reason;
        }
    }
    Ok(out)
}

/// Runs the ranks of `spec.node` on threads (in-process fabric between them) and reaches the
/// ranks of the other nodes through host proxies over the wire `spec.wire` asks for. Every node of the run calls this
/// with the same program, inputs and topology; node 0 gathers the outputs of every rank.
///
/// A failing node aborts the rendezvous with its error, so the other nodes stop at their next
/// rendezvous step; its proxies are gone, so the ranks waiting for its ranks fail at once
/// naming them.
pub fn run_node(
    host: &HostProgram,
    per_rank: &BTreeMap<DeviceId, BTreeMap<String, TensorData>>,
    spec: &NodeSpec,
    rendezvous: Arc<dyn Rendezvous>,
    options: &CpuOptions,
) -> Result<NodeOutcome, NodeError> {
    let node = spec.node;
    let local = spec.topology.ranks_of(node);
    let nodes = spec.topology.nodes();
    let fail = |e: NodeError| {
        rendezvous.abort(&e.to_string());
        e
    };
    if local.is_empty() {
        return Err(fail(NodeError::Setup {
            node,
            message: format!(
                "no rank of the {} ranks is on this node",
                spec.topology.world()
            ),
        }));
    }
    let NodeProxies {
        proxies,
        reason: wire_reason,
    } = connect_proxies(spec, &local, &rendezvous)
        .map_err(|message| fail(NodeError::Setup { node, message }))?;
    let wire = proxies.values().next().map_or("none", |p| p.wire_name());
    let link = Arc::new(ProxyLink::new(
        spec.topology.clone(),
        node,
        proxies,
        options.config.timeout,
    ));
    let fabric = Arc::new(Fabric::with_remote(link.clone()));
    let start = Instant::now();
    let ran = run_ranks(host, &local, per_rank, &fabric, options, start).map_err(|e| {
        fail(NodeError::Run {
            node,
            ranks: local.clone(),
            failure: e.to_string(),
        })
    })?;
    let elapsed = start.elapsed();
    if !ran.errors.is_empty() {
        let failure = RunFailure {
            first: fabric.failure(),
            errors: ran.errors,
            undelivered: Vec::new(),
        };
        return Err(fail(NodeError::Run {
            node,
            ranks: local,
            failure: failure.to_string(),
        }));
    }
    for p in link.proxies().values() {
        if let Err(e) = p.flush(spec.setup_timeout) {
            tracing::warn!(rank = p.rank(), "proxy flush: {e}");
        }
    }
    // Keep every proxy up until every node has run (a node that leaves early closes links
    // the others may still use).
    rendezvous
        .barrier("meshflow/node/ran", nodes, FINISH_TIMEOUT)
        .map_err(|e| NodeError::Remote(e.to_string()))?;
    let proxy_stats = link
        .proxies()
        .iter()
        .map(|(&r, p)| (r, p.stats()))
        .collect();
    let mut undelivered: Vec<String> = fabric
        .undelivered()
        .into_iter()
        .map(|(src, dst, _, seq)| format!("rank {src} -> rank {dst} (team operation #{seq})"))
        .collect();
    for (&dst, p) in link.proxies() {
        undelivered.extend(p.undelivered().into_iter().map(|(src, (_, seq))| {
            format!("rank {src} -> rank {dst} (team operation #{seq}, through the proxy)")
        }));
    }
    let result: NodeResult = if undelivered.is_empty() {
        Ok(ran.outputs)
    } else {
        Err(format!(
            "node {node}: messages sent but never received: {}",
            undelivered.join(", ")
        ))
    };
    drop(fabric);
    drop(link);
    if node != 0 {
        rendezvous
            .publish(&key("result", node), &encode_result(&result))
            .map_err(|e| NodeError::Remote(e.to_string()))?;
        // Node 0 serves the store until every node is here; it may leave before answering,
        // which is harmless now that the result is stored.
        if let Err(e) = rendezvous.barrier("meshflow/node/done", nodes, spec.setup_timeout) {
            tracing::debug!("final barrier: {e}");
        }
        return match result {
            Ok(_) => Ok(NodeOutcome {
                outputs: None,
                proxy_stats,
                wire,
                wire_reason,
                elapsed,
            }),
            Err(failure) => Err(NodeError::Run {
                node,
                ranks: local,
                failure,
            }),
        };
    }
    let mut all = result.map_err(|failure| NodeError::Run {
        node,
        ranks: local,
        failure,
    })?;
    for other in 1..nodes {
        let bytes = rendezvous
            .fetch(&key("result", other), spec.setup_timeout)
            .map_err(|e| NodeError::Remote(format!("node {other} sent no result: {e}")))?;
        let outputs = decode_result(&bytes)
            .map_err(|e| NodeError::Remote(format!("node {other}: malformed result: {e}")))?
            .map_err(NodeError::Remote)?;
        all.extend(outputs);
    }
    rendezvous
        .barrier("meshflow/node/done", nodes, spec.setup_timeout)
        .map_err(|e| NodeError::Remote(e.to_string()))?;
    Ok(NodeOutcome {
        outputs: Some(all),
        proxy_stats,
        wire,
        wire_reason,
        elapsed,
    })
}

/// The address of this host that other hosts reach when it talks to `master` (no packet is
/// sent), or `127.0.0.1` when that cannot be told.
pub fn local_address_toward(master: &str) -> String {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|s| {
        s.connect(master)?;
        s.local_addr()
    });
    match probe {
        Ok(a) if !a.ip().is_unspecified() => a.ip().to_string(),
        _ => "127.0.0.1".to_string(),
    }
}
