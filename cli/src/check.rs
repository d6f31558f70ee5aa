//! `meshflow check FILE [program and compile options]`: the static cross-rank check. A level-1
//! program is lowered first; a host program is checked as written (the two are told apart by
//! content; `--param` is refused for host IR, which has none). Every
//! rank's communications are instantiated and matched (teams, kinds, sizes, roots, peers) and
//! progress is simulated to find deadlocks; the command exits 1 with a message naming the
//! ranks, iterations and instructions involved when the program is wrong.

use super::common::{options, print_out, CliError, CompileArgs, Input, ProgramArgs};
use clap::Args;

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
    let input = args.program.load_any(&options)?;
    if matches!(input, Input::Host(_)) {
        args.compile.refuse_for_host(&args.program.file)?;
    }
    let compiled = args.program.compile(input, &options)?;
    let report = compiled
        .check_report()
        .ok_or_else(|| CliError::Check("the cross-rank check did not run".to_string()))?;
    print_out(&format!("ok {}: {report}\n", compiled.host().name))
}
