//! Every pass, one file each (the lowering in a folder). The order lives in
//! `meshflow::pipeline`.

pub mod assign_streams;
pub mod choose_decompositions;
pub mod decompose_reshardings;
pub mod defer_waits;
pub mod insert_allocations;
pub mod lower_to_host;
pub mod prefetch_transfers;
pub mod propagate_shardings;
pub mod simplify_indices;
pub mod verify;

pub use assign_streams::AssignStreams;
pub use choose_decompositions::ChooseDecompositions;
pub use decompose_reshardings::DecomposeReshardings;
pub use defer_waits::DeferWaits;
pub use insert_allocations::InsertAllocations;
pub use lower_to_host::LowerToHost;
pub use prefetch_transfers::PrefetchTransfers;
pub use propagate_shardings::PropagateShardings;
pub use simplify_indices::SimplifyIndices;
pub use verify::{VerifyHost, VerifyProgram};
