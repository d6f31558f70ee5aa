//! meshflow-passes: the pass manager and every pass that lowers a sharded program to host IR.
#![forbid(unsafe_code)]
