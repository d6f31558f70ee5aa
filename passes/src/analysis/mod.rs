//! Analyses shared by the passes: shardings and op axis maps.

pub mod axis_map;
pub mod sharding;

pub use axis_map::{op_axis_map, AxisClasses, AxisMap};
pub use sharding::{AxisSplit, Sharding, Spec, StreamSpec};
