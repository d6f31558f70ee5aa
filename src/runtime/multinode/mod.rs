//! Multi-process CPU runs: each process is a **node** that runs the ranks of that node as
//! threads (in-process fabric between them) and reaches the ranks of the other nodes through
//! the inter-node host proxy ([`meshflow_kernels::proxy`]) over TCP or ibverbs: one-sided writes with
//! immediates into registered receive rings, counted by the receiver's proxy thread. The
//! fabric's message keys are unchanged, so every communication kind (collectives, collective
//! permute, MoE dispatch/combine) crosses nodes through the proxy protocol.
//!
//! - [`ProxyLink`]: the fabric's [`RemoteLink`](crate::runtime::cpu::RemoteLink) over the
//!   proxies of a node's ranks.
//! - [`run_node`]: one node's part of a run (connect the proxies through the rendezvous, run
//!   the local ranks, gather every rank's outputs on node 0).
//! - [`supervise`]: starts the node processes and waits for them with a deadline; a process
//!   that dies makes the others fail (their proxies lose its links) and nothing hangs.
//! - [`codec`]: bytes of fabric messages and of node results.
//!
//! `meshflow run FILE --ranks N --nodes M` (or `MESHFLOW_NODE_SIZE`) starts M node processes of
//! the `meshflow` binary itself; node 0 serves the rendezvous, gathers and compares.

pub mod codec;
mod link;
mod node;
mod supervise;

pub use link::{ProxyLink, RendezvousStore};
#[cfg(feature = "cuda")]
pub(crate) use node::{connect_proxies, NodeProxies};
pub use node::{local_address_toward, run_node, NodeError, NodeOutcome, NodeSpec, DEFAULT_RING};
pub use supervise::{supervise, NodeCommand, NodeExit};
