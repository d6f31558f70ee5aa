//! `meshflow parse FILE [--ranks N] [--param k=v]...`: prints the verified program in canonical
//! form, a level-1 program or a host program (told apart by content).

use clap::Args;

use super::common::{options, print_out, CliError, Input, ProgramArgs};

/// Arguments of `parse`.
#[derive(Debug, Args)]
pub struct ParseArgs {
    #[command(flatten)]
    program: ProgramArgs,
}

/// Runs `parse`.
pub fn run(args: ParseArgs) -> Result<(), CliError> {
    let options = options(&args.program, None)?;
    match args.program.load_any(&options)? {
        Input::Program(p) => print_out(&p.to_string()),
        Input::Host(h) => print_out(&h.to_string()),
    }
}
