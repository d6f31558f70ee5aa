//! The `meshflow` command line: one file per subcommand, dispatched from [`Command`]. Every
//! subcommand that compiles takes the same program and compile arguments
//! (`common::ProgramArgs`, `common::CompileArgs`) and goes through [`meshflow::compile`].
#![forbid(unsafe_code)]

mod bench;
mod bench_moe;
mod calibrate;
mod check;
mod common;
mod launch;
mod lower;
mod node;
mod parse;
mod rank;
mod run;
#[cfg(feature = "cuda")]
mod run_cuda;
mod trace;

use clap::{Parser, Subcommand};

pub use common::CliError;

/// Lower sharded tensor programs to host IR and run them.
#[derive(Debug, Parser)]
#[command(name = "meshflow", version, about)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and verify a program (level-1 or host IR text) and print it in canonical form.
    Parse(parse::ParseArgs),
    /// Compile a level-1 program and print the host IR (host IR text is printed as it is).
    Lower(lower::LowerArgs),
    /// Check a program across ranks: matching communications, no deadlock.
    Check(check::CheckArgs),
    /// Lower, check and run a program on every rank; compare with an unsharded reference.
    Run(run::RunArgs),
    /// GPU benchmarks: overlapped AG+GEMM (`agmm`), GEMM+RS (`rsmm`) next to the bound,
    /// collective-permute bandwidth (`permute`) and MoE dispatch/combine latency (`moe`).
    Bench(bench::BenchCommand),
    /// Measure this machine (CPU backend, or GPUs with `--backend cuda`) and write a profile
    /// that `--profile` reads.
    Calibrate(calibrate::CalibrateArgs),
    /// Start N ranks of a command on this host (torchrun variables, `[rank r]` output).
    Launch(launch::LaunchArgs),
    /// Run a program once and write a Perfetto trace and an SVG timeline of its streams.
    Trace(trace::TraceArgs),
    /// One node of a multi-process run (started by `run --nodes`).
    #[command(hide = true)]
    Node(node::NodeArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Parse(args) => parse::run(args),
        Command::Lower(args) => lower::run(args),
        Command::Check(args) => check::run(args),
        Command::Run(args) => run::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Trace(args) => trace::run(args),
        Command::Node(args) => node::run(args),
    }
}
