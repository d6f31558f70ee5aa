//! `meshflow check FILE [--ranks N] [--param k=v]... [--streams N]`: the static cross-rank
//! check. A level-1 program (`.mf`) is lowered first; a host program (`.mfh`) is checked as
//! written. Every rank's communications are instantiated and matched (teams, kinds, sizes,
//! roots, peers) and progress is simulated to find deadlocks; the command exits 1 with a
//! message naming the ranks, iterations and instructions involved when the program is wrong.

use clap::Args;
use meshflow::check::check_program;
use meshflow::ir::{parse_host, verify_host};
use meshflow::pipeline::{compile, CompileOptions};

use super::common::{print_out, CliError, ProgramArgs};

/// Arguments of `check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// Size of the worker stream pool used when lowering a level-1 program.
    #[arg(long, default_value_t = 2)]
    streams: usize,
}

/// Runs `check`.
pub fn run(args: CheckArgs) -> Result<(), CliError> {
    let is_host = args.program.file.extension().is_some_and(|e| e == "mfh");
    let host = if is_host {
        let path = &args.program.file;
        let text = std::fs::read_to_string(path).map_err(|source| CliError::Read {
            path: path.clone(),
            source,
        })?;
        let host = parse_host(&text).map_err(|source| CliError::Parse {
            path: path.clone(),
            source,
        })?;
        verify_host(&host).map_err(|source| CliError::Verify {
            path: path.clone(),
            source,
        })?;
        host
    } else {
        let program = args.program.load()?;
        let options = CompileOptions {
            num_streams: args.streams.max(1),
            ..CompileOptions::default()
        };
        compile(&program, &options)?.host
    };
    let world = host.world_size();
    let ranks = match args.program.ranks {
        Some(r) if is_host => usize::try_from(r)
            .map_err(|_| CliError::Usage(format!("--ranks {r}: must be positive")))?,
        _ => world,
    };
    let report = check_program(&host, ranks).map_err(|e| CliError::Check(e.to_string()))?;
    print_out(&format!("ok {}: {report}\n", host.name))
}
