//! The `meshflow` binary as a user runs it: `parse`, `lower`, `check`, `run`, `trace`, and
//! multi-process CPU runs (`--nodes`), with their output and their errors (`error: ...`, exit
//! code 1, never a panic).

#[path = "../../../tests/support/mod.rs"]
mod support;

mod lower;
mod nodes;
mod run;
mod trace;
