//! `meshflow parse FILE [--ranks N] [--param k=v]...`: prints the verified canonical program.

use clap::Args;

use super::common::{options, print_out, CliError, ProgramArgs};

/// Arguments of `parse`.
#[derive(Debug, Args)]
pub struct ParseArgs {
    #[command(flatten)]
    program: ProgramArgs,
}

/// Runs `parse`.
pub fn run(args: ParseArgs) -> Result<(), CliError> {
    let options = options(&args.program, None)?;
    let program = args.program.load(&options)?;
    print_out(&program.to_string())
}
