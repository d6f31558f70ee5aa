//! The inter-node **host proxy** (pplx-garden's design): the compute side never posts network
//! work. A rank *stages* message chunks into its registered send region and *raises a flag*; a proxy
//! thread per rank *watches the flags*, posts **one-sided writes with an immediate** into the
//! peers' registered receive regions, *counts the incoming immediates* per message and *raises
//! the flag* the receiver waits on, and returns ring space to the sender with credit writes.
//!
//! The protocol (rings, chunk headers, immediates, credits: [`layout`]) and the proxy thread
//! ([`Proxy`]) are independent of the wire it writes over. Two wires implement [`Wire`]
//! ([`connect_wire`] connects the one a [`WireChoice`] asks for):
//! - [`TcpWire`]: the same one-sided write + immediate semantics over TCP sockets; works
//!   everywhere, so CI runs the whole proxy path, between processes acting as nodes;
//! - `IbvWire` (feature `rdma`): RC queue pairs and `RDMA_WRITE_WITH_IMM` over ibverbs,
//!   regions registered as pinned host staging. Not run on RDMA hardware (none is available).
//!
//! [`Topology`] says which ranks share a node: in-node peers use the in-node path (the CPU backend's
//! in-process fabric on CPU, NVLink on GPUs), ranks of other nodes are proxy peers.
//!
//! On GPUs (feature `cuda`) [`StagedRoute`] moves device memory through the same proxy, in
//! stream order: the stream copies the bytes into pinned host memory and a staging thread hands
//! them to the proxy once the copy's event completes; on the receiving side a staging thread
//! copies the counted message into pinned memory and raises a flag the stream waits on
//! (`cuStreamWaitValue32`) before copying it in (collective permutes and MoE dispatch/combine
//! of the CUDA backend with cross-node peers). The staging is done by DMA copies and stream
//! memory operations, not by custom kernels writing mapped memory.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use meshflow_kernels::proxy::{Layout, MemoryStore, Proxy, TcpWire, Topology};
//!
//! // Two ranks on two nodes, both in this process (each would normally be its own process).
//! let topology = Topology::contiguous(2, 1)?;
//! let store = Arc::new(MemoryStore::new());
//! let proxies = std::thread::scope(|s| {
//!     let handles: Vec<_> = (0..2)
//!         .map(|rank| {
//!             let (topology, store) = (&topology, store.clone());
//!             s.spawn(move || {
//!                 let layout = Layout::new(topology, rank, 1 << 16)?;
//!                 let wire = TcpWire::connect(&layout, "127.0.0.1", &*store, "doc", Duration::from_secs(10))?;
//!                 Proxy::start(layout, Arc::new(wire))
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().expect("no panic")).collect::<Result<Vec<_>, _>>()
//! })?;
//! proxies[0].send(1, (7, 1), b"rows", Duration::from_secs(10))?;
//! assert_eq!(proxies[1].recv(0, (7, 1), Duration::from_secs(10))?, b"rows");
//! # Ok::<(), meshflow_kernels::proxy::ProxyError>(())
//! ```

mod choose;
mod engine;
mod error;
#[cfg(feature = "rdma")]
mod ibverbs;
pub mod layout;
mod qp_info;
mod region;
#[cfg(feature = "cuda")]
mod staged;
mod tcp;
mod topology;
mod wire;

pub use choose::{connect_wire, ibverbs_available, ChosenWire, WireChoice};
pub use engine::{Proxy, ProxyStats};
pub use error::ProxyError;
#[cfg(feature = "rdma")]
pub use ibverbs::{device_names, IbvWire, DEVICE_ENV, GID_INDEX_ENV};
pub use layout::{Layout, Tag};
pub use qp_info::QpInfo;
pub use region::HostRegion;
#[cfg(feature = "cuda")]
pub use staged::{CancelCheck, StagedRoute};
pub use tcp::TcpWire;
pub use topology::{node_size_from_env, Topology, NODE_SIZE_ENV};
pub use wire::{Completion, MemoryStore, Regions, SetupStore, Wire};

#[cfg(test)]
mod tests;
