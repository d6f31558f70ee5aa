//! `meshflow launch --nproc N [--master-addr A] [--master-port P] -- <cmd> [args]`: starts N
//! processes of `<cmd>` on this host as ranks `0..N` with the torchrun variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), prefixes
//! their output with `[rank r]`, and if one fails, terminates the others and exits non-zero
//! naming the rank and its exit status. E.g.
//! `meshflow launch --nproc 2 -- meshflow run prog.mf --backend cuda`.

use std::sync::{Arc, Mutex};

use clap::Args;
use meshflow::launch::{launch_processes, LaunchSpec, Sink};

use super::common::CliError;

/// Arguments of `launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of processes (one per GPU).
    #[arg(long)]
    nproc: usize,
    /// `MASTER_ADDR` of the rendezvous (rank 0's host).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// `MASTER_PORT` of the rendezvous; default: a free port.
    #[arg(long)]
    master_port: Option<u16>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Runs `launch`.
pub fn run(args: LaunchArgs) -> Result<(), CliError> {
    let spec = LaunchSpec {
        nproc: args.nproc,
        master_addr: args.master_addr,
        master_port: args.master_port,
        command: args.command,
    };
    let out: Sink = Arc::new(Mutex::new(std::io::stdout()));
    let err: Sink = Arc::new(Mutex::new(std::io::stderr()));
    launch_processes(&spec, out, err).map_err(|e| CliError::Usage(e.to_string()))
}
