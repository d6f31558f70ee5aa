//! `meshflow run FILE [program and compile options] [--backend cpu|cuda] [--seed S]
//! [--trace out.json] [--timeout-ms T] [--no-race-check] [--nodes M]`: lowers the program, checks the host program across ranks, runs it on every rank with random inputs,
//! compares the gathered outputs with an unsharded reference, and prints a summary whose last
//! line starts with `ok` or `mismatch`. Exits 0 only when every output matches. With `--nodes M`
//! (or `MESHFLOW_NODE_SIZE`) the CPU ranks run in M processes linked by the host proxy (see
//! [`node`](super::node)); GPU ranks (`--backend cuda`) stay in this process (or the processes
//! of `meshflow launch`) and reach the ranks of other nodes through their host proxies.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::ranks::{run_cpu, CpuOptions, RunInputs};
use meshflow::runtime::reference::evaluate;
use meshflow::Compiled;

use super::common::{options, print_out, CliError, CompileArgs, ProgramArgs};
use super::node::ExecArgs;

/// Where the ranks run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The embedded CPU backend: one thread per rank, host memory.
    #[value(alias = "sim")]
    Cpu,
    /// GPUs over CUDA and NCCL (needs the `cuda` feature).
    Cuda,
}

/// Arguments of `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    program: ProgramArgs,
    #[command(flatten)]
    compile: CompileArgs,
    #[command(flatten)]
    exec: ExecArgs,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Write a Chrome/Perfetto trace (one track per rank and stream).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Split the ranks into this many nodes linked by the host proxy over TCP (default:
    /// `MESHFLOW_NODE_SIZE` ranks per node when set, else one node). CPU ranks run in one
    /// process per node; GPU ranks move collective permutes and MoE rows between nodes
    /// through the proxy.
    #[arg(long)]
    nodes: Option<usize>,
}

/// Runs `run`.
pub fn run(args: RunArgs) -> Result<(), CliError> {
    let options = options(&args.program, Some(&args.compile))?.check(true);
    let program = args.program.load(&options)?;
    let compiled = meshflow::compile(&program, &options).map_err(|e| args.program.error(e))?;
    let lowered = compiled
        .timings()
        .iter()
        .map(|t| t.wall.as_secs_f64())
        .sum::<f64>();
    let world = compiled.host().world_size();
    let ranks = compiled.world_size();
    let mut summary = format!(
        "{}: lowered in {:.1} ms ({} host instructions)\n",
        program.name,
        lowered * 1e3,
        count_insts(compiled.host())
    );
    if let Some(report) = compiled.check_report() {
        summary.push_str(&format!("cross-rank check: {report}\n"));
    }
    if ranks > world {
        summary.push_str(&format!(
            "note: ranks {world}..{ranks} hold no tensor of this program and stay idle\n"
        ));
    }
    let nodes = super::node::nodes_of(ranks, args.nodes)?;
    if nodes > 1 && args.backend == BackendKind::Cpu {
        if args.trace.is_some() {
            summary.push_str("note: --trace is not recorded in multi-process runs\n");
        }
        return super::node::start_nodes(
            &args.program,
            &args.compile,
            &args.exec,
            ranks,
            nodes,
            &summary,
        );
    }
    let level1 = compiled.level1().map_err(|e| args.program.error(e))?;
    let inputs =
        random_inputs(&program, args.exec.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let got = match args.backend {
        BackendKind::Cpu => {
            let cpu = CpuOptions {
                ranks: Some(ranks),
                config: CpuConfig {
                    stream_pool: args.compile.streams,
                    timeout: Duration::from_millis(args.exec.timeout_ms),
                    race_check: !args.exec.no_race_check,
                    ..CpuConfig::default()
                },
                trace: args.trace.is_some(),
            };
            let outcome = run_cpu(
                compiled.host(),
                RunInputs::Full {
                    program: level1,
                    inputs: &inputs,
                },
                &cpu,
            )
            .map_err(|e| CliError::Run(e.to_string()))?;
            summary.push_str(&format!(
                "ran on {ranks} CPU ranks in {:.1} ms (seed {})\n",
                outcome.elapsed.as_secs_f64() * 1e3,
                args.exec.seed
            ));
            if let (Some(path), Some(trace)) = (&args.trace, &outcome.trace) {
                trace.write(path).map_err(|source| {
                    CliError::Run(format!(
                        "cannot write the trace `{}`: {source}",
                        path.display()
                    ))
                })?;
                summary.push_str(&format!("trace written to {}\n", path.display()));
            }
            outcome
                .gather(level1)
                .map_err(|e| CliError::Run(e.to_string()))?
        }
        BackendKind::Cuda => match run_cuda(
            &args,
            &compiled,
            &inputs,
            ranks,
            (nodes > 1).then(|| ranks.div_ceil(nodes)),
            &mut summary,
        )? {
            Some(gathered) => gathered,
            // A rank other than 0 of a multi-process run: rank 0 compares.
            None => return print_out(&summary),
        },
    };
    let want = evaluate(&program, &inputs).map_err(|e| CliError::Run(e.to_string()))?;
    let comparison =
        compare_outputs(&program, &got, &want).map_err(|e| CliError::Run(e.to_string()))?;
    summary.push_str(&format!("{comparison}\n"));
    print_out(&summary)?;
    if comparison.passed() {
        Ok(())
    } else {
        Err(CliError::Mismatch)
    }
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _args: &RunArgs,
    _compiled: &Compiled,
    _inputs: &std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>,
    _ranks: usize,
    _node_size: Option<usize>,
    _summary: &mut String,
) -> Result<Option<std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>>, CliError>
{
    Err(CliError::Usage(
        "this meshflow was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda` to use --backend cuda"
            .to_string(),
    ))
}

#[cfg(feature = "cuda")]
fn run_cuda(
    args: &RunArgs,
    compiled: &Compiled,
    inputs: &std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>,
    ranks: usize,
    node_size: Option<usize>,
    summary: &mut String,
) -> Result<Option<std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>>, CliError>
{
    let how = super::run_cuda::GpuRun {
        ranks,
        node_size,
        streams: args.compile.streams,
        timeout: Duration::from_millis(args.exec.timeout_ms),
        trace: args.trace.as_deref(),
    };
    super::run_cuda::run(compiled, inputs, &how, summary)
}

fn count_insts(host: &meshflow::ir::HostProgram) -> usize {
    let mut n = 0;
    host.walk(&mut |_, _| n += 1);
    n
}
