//! The static cross-rank check: correct programs pass at every world size, the mutation corpus
//! fails with the expected messages (and, forced to run, ends in an error rather than a hang),
//! the errors the corpus does not cover, and adversarial inputs from parse to run (no panic,
//! no hang).

#[path = "../support/mod.rs"]
mod support;

mod bad_inputs;
mod errors;
mod mutations;
mod programs;
mod run_mutations;
