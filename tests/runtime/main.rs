//! The runtime on the CPU backend: every communication kind, MoE, hand-written programs
//! against the reference, race detection, evaluator errors, faults (a rank that fails stops the
//! others, naming it; a rank process that exits fails its peers waiting at the TCP rendezvous),
//! nodes linked by the host proxy, and scatter/gather by layout.

#[path = "../support/mod.rs"]
mod support;

mod comm;
mod errors;
mod faults;
mod moe;
mod moe_weights;
mod nodes;
mod programs;
mod race;
mod shard;
mod store_loss;
