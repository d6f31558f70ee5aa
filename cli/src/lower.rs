//! `meshflow lower FILE [program and compile options] [--dump-after PASS|all] [--explain]
//! [--timings]`: prints the host IR on stdout; dumps, explain records and timings go to
//! stderr. A host program (told apart by content) is verified and printed as it is: it is not
//! lowered again, so the lowering options are refused for it.

use clap::Args;
use meshflow::compile;

use super::common::{
    options, print_err, print_out, profile_line, refuse_lowering_flags, CliError, CompileArgs,
    Input, ProgramArgs,
};

/// Arguments of `lower`.
#[derive(Debug, Args)]
pub struct LowerArgs {
    #[command(flatten)]
    program: ProgramArgs,
    #[command(flatten)]
    compile: CompileArgs,
    /// Print the IR after this pass (or `all`) to stderr.
    #[arg(long, value_name = "PASS|all")]
    dump_after: Option<String>,
    /// Print the decomposition decisions (variants, estimated costs, choice) to stderr.
    #[arg(long)]
    explain: bool,
    /// Print the wall time of every pass to stderr.
    #[arg(long)]
    timings: bool,
}

/// Runs `lower`.
pub fn run(args: LowerArgs) -> Result<(), CliError> {
    let mut options = options(&args.program, Some(&args.compile))?.check(false);
    if let Some(pass) = &args.dump_after {
        options = options.dump_after(pass.clone());
    }
    let program = match args.program.load_any(&options)? {
        Input::Program(p) => p,
        Input::Host(h) => {
            args.compile.refuse_for_host(&args.program.file)?;
            let mut given = Vec::new();
            for (flag, on) in [
                ("--dump-after", args.dump_after.is_some()),
                ("--explain", args.explain),
                ("--timings", args.timings),
            ] {
                if on {
                    given.push(flag);
                }
            }
            refuse_lowering_flags(&args.program.file, &given)?;
            return print_out(&h.to_string());
        }
    };
    let compiled = compile(&program, &options).map_err(|e| args.program.error(e))?;
    for dump in compiled.dumps() {
        print_err(&format!(
            "// ===== after {} =====\n{}",
            dump.after, dump.text
        ))?;
    }
    if args.explain {
        let mut text = String::from("// ===== decompositions =====\n");
        text.push_str(&profile_line(&args.compile, &compiled));
        if compiled.explain().is_empty() {
            text.push_str("no resharding\n");
        }
        for r in compiled.explain() {
            text.push_str(&r.to_string());
        }
        print_err(&text)?;
    }
    if args.timings {
        let mut text = String::from("// ===== pass timings =====\n");
        for t in compiled.timings() {
            let state = if t.ran { "" } else { " (disabled)" };
            text.push_str(&format!(
                "{:<24} {:>10.3} ms{state}\n",
                t.pass,
                t.wall.as_secs_f64() * 1e3
            ));
        }
        print_err(&text)?;
    }
    print_out(&compiled.host_text())
}
