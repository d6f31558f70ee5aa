//! Analyses shared by the passes: shardings, op axis maps, per-op sharding rules and
//! placements.

pub mod accumulate;
pub mod axis_map;
pub mod local_sharding;
pub mod op_rules;
pub mod placements;
pub mod sharding;

pub use accumulate::accumulates_in_place;
pub use axis_map::{op_axis_map, AxisClasses, AxisMap};
pub use op_rules::{local_split_ok, Requirement};
pub use placements::{describe, partial_kind, placements_text};
pub use sharding::{AxisSplit, Sharding, Spec, StreamSpec};
