//! meshflow-passes: the pass manager and every pass that lowers a sharded level-1 program to
//! the host IR.
//!
//! - [`manager`]: [`PassManager`] and its typed [`Stage`]s, the pass traits
//!   ([`ProgramPass`], [`LowerPass`], [`HostPass`]).
//! - [`options`]: [`PassOptions`] and the [`PassContext`] that borrows them.
//! - [`passes`]: one type per pass, named by a verb phrase (`PropagateShardings`,
//!   `DecomposeReshardings`, `ChooseDecompositions`, `LowerToHost`, `SimplifyIndices`,
//!   `AssignStreams`, `InsertAllocations`, `DeferWaits`, and the verifiers).
//! - Analyses: [`analysis`] (shardings on top of `Layout`, op axis maps),
//!   [`resharding`] (does a consumer need data its producer's device lacks),
//!   [`decision`] (the decision table), [`index`] (egg-based index arithmetic),
//!   [`cost_model`] (predicted times of the plans the schedule search chooses between, from a
//!   machine [`profile`]), [`plan`] (one point of that search), [`transport`] (the transport
//!   kinds the cost model and the GPU runtime share), [`scope_tree`] (the innermost
//!   block holding a set of instructions, from their paths).
//!
//! The one ordered pass list is `meshflow::pipeline` in the root crate.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod analysis;
pub mod cost_model;
pub mod decision;
pub mod edit;
pub mod error;
pub mod explain;
pub mod host_util;
pub mod index;
pub mod manager;
pub mod options;
pub mod passes;
pub mod plan;
pub mod profile;
pub mod redistribute;
pub mod resharding;
pub mod scope_tree;
pub mod transport;

pub use cost_model::CostModel;
pub use error::PassError;
pub use explain::{ExplainRecord, VariantCost};
pub use manager::{
    Dump, DumpAfter, HostPass, Ir, LowerPass, Lowered, PassManager, PassOutput, PassTiming,
    ProgramPass, Stage,
};
pub use options::{Decomposition, PassContext, PassOptions, StreamSchedule};
pub use plan::Plan;
pub use profile::Profile;
pub use transport::{Transport, UnknownTransport};
