//! `meshflow lower FILE [--ranks N] [--param k=v]... [--dump-after PASS|all] [--explain]
//! [--disable-pass P]... [--streams N] [--schedule S] [--profile NAME|FILE] [--transport T]
//! [--decompose TENSOR=VARIANT]... [--no-verify]`:
//! prints the host IR on stdout; dumps, explain records and timings go to stderr.

use std::collections::BTreeMap;

use clap::Args;
use meshflow::passes::Decomposition;
use meshflow::pipeline::{compile, CompileOptions};

use super::common::{print_err, print_out, CliError, ProgramArgs};

/// Arguments of `lower`.
#[derive(Debug, Args)]
pub struct LowerArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// Print the IR after this pass (or `all`) to stderr.
    #[arg(long, value_name = "PASS|all")]
    dump_after: Option<String>,
    /// Print the decomposition decisions (variants, estimated costs, choice) to stderr.
    #[arg(long)]
    explain: bool,
    /// Skip a pass (repeatable).
    #[arg(long = "disable-pass", value_name = "PASS")]
    disable_pass: Vec<String>,
    /// Size of the worker stream pool.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    #[command(flatten)]
    search: super::common::SearchArgs,
    /// Force a decomposition: `--decompose TENSOR=collective|broadcast|reduce|ring|ring_forward|
    /// ring_bidirectional` (repeatable; TENSOR is the gathered tensor of an all-gather, the
    /// partial sums of a reduce-scatter).
    #[arg(long = "decompose", value_name = "TENSOR=VARIANT")]
    decompose: Vec<String>,
    /// Do not verify between passes.
    #[arg(long)]
    no_verify: bool,
    /// Print the wall time of every pass to stderr.
    #[arg(long)]
    timings: bool,
}

/// Runs `lower`.
pub fn run(args: LowerArgs) -> Result<(), CliError> {
    let program = args.program.load()?;
    let mut decompositions = BTreeMap::new();
    for d in &args.decompose {
        let (tensor, variant) = d.split_once('=').ok_or_else(|| {
            CliError::Usage(format!("--decompose `{d}`: expected TENSOR=VARIANT"))
        })?;
        let variant: Decomposition = variant
            .parse()
            .map_err(|e: meshflow::passes::PassError| CliError::Usage(e.to_string()))?;
        decompositions.insert(tensor.to_string(), variant);
    }
    let options = CompileOptions {
        num_streams: args.streams,
        disabled_passes: args.disable_pass.clone(),
        dump_after: args.dump_after.clone(),
        verify: !args.no_verify,
        decompositions,
        stream_schedule: args.search.schedule.schedule(),
        cost_model: args.search.cost_model()?,
    };
    let compiled = compile(&program, &options)?;
    for dump in &compiled.dumps {
        print_err(&format!(
            "// ===== after {} =====\n{}",
            dump.after, dump.text
        ))?;
    }
    if args.explain {
        let mut text = String::from("// ===== decompositions =====\n");
        if compiled.explain.is_empty() {
            text.push_str("no resharding\n");
        }
        for r in &compiled.explain {
            text.push_str(&r.to_string());
        }
        print_err(&text)?;
    }
    if args.timings {
        let mut text = String::from("// ===== pass timings =====\n");
        for t in &compiled.timings {
            let state = if t.ran { "" } else { " (disabled)" };
            text.push_str(&format!(
                "{:<24} {:>10.3} ms{state}\n",
                t.pass,
                t.wall.as_secs_f64() * 1e3
            ));
        }
        print_err(&text)?;
    }
    print_out(&compiled.host.to_string())
}
