//! `meshflow check FILE [program and compile options]`: the static cross-rank check. A level-1
//! program (`.mf`) is lowered first; a host program (`.mfh`) is checked as written. Every
//! rank's communications are instantiated and matched (teams, kinds, sizes, roots, peers) and
//! progress is simulated to find deadlocks; the command exits 1 with a message naming the
//! ranks, iterations and instructions involved when the program is wrong.

use clap::Args;
use meshflow::{compile, Compiled};

use super::common::{options, print_out, CliError, CompileArgs, ProgramArgs};

/// Arguments of `check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    program: ProgramArgs,
    #[command(flatten)]
    compile: CompileArgs,
}

/// Runs `check`.
pub fn run(args: CheckArgs) -> Result<(), CliError> {
    let options = options(&args.program, Some(&args.compile))?.check(true);
    let is_host = args.program.file.extension().is_some_and(|e| e == "mfh");
    let compiled = if is_host {
        Compiled::from_host_text(&args.program.text()?, &options)
    } else {
        let program = args.program.load(&options)?;
        compile(&program, &options)
    }
    .map_err(|e| args.program.error(e))?;
    let report = compiled
        .check_report()
        .ok_or_else(|| CliError::Check("the cross-rank check did not run".to_string()))?;
    print_out(&format!("ok {}: {report}\n", compiled.host().name))
}
