//! `meshflow run FILE [program and compile options] [--backend cpu|cuda] [--seed S]
//! [--trace out.json] [--timeout-ms T] [--no-race-check] [--nodes M] [--wire tcp|ibverbs|auto]
//! [--graph] [--explain]`: lowers the program, checks the host program across ranks, runs it
//! on every rank with random inputs, compares the gathered outputs with an unsharded
//! reference, and prints a summary whose last line starts with `ok` or `mismatch`. Host IR
//! text (told apart by content) is checked and run as written, with random local inputs and no
//! reference to compare with. The trace path is opened before anything runs (a path that
//! cannot be written fails first), and the summary is printed even when writing the trace
//! fails. Exits 0 only when every output matches. With `--nodes M` (or `MESHFLOW_NODE_SIZE`)
//! the CPU ranks run in M processes linked by the host proxy (see [`node`](super::node)); GPU
//! ranks (`--backend cuda`) stay in this process (or the processes of `meshflow launch`) and
//! reach the ranks of other nodes through their host proxies.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use meshflow::ir::Program;
use meshflow::runtime::compare::{compare_outputs, random_inputs, random_local_inputs};
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::data::TensorData;
use meshflow::runtime::ranks::{run_cpu, CpuOptions, RunInputs};
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::rendezvous::TorchrunEnv;
use meshflow::runtime::trace::Trace;
use meshflow::Compiled;

use super::common::{
    on_gpus, options, print_out, profile_line, CliError, CompileArgs, Input, OutputFile,
    ProgramArgs,
};
use super::node::ExecArgs;
use super::rank::LaunchedRank;

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
    /// Record each step as a CUDA graph and replay it (`--backend cuda`); a program whose
    /// transports need the host during a step is refused with the reason.
    #[arg(long)]
    graph: bool,
    /// Also print which transport carried each communication (and the wire between nodes).
    #[arg(long)]
    explain: bool,
}

/// Runs `run`.
pub fn run(args: RunArgs) -> Result<(), CliError> {
    // Output paths before anything else: a path that cannot be written fails here.
    let trace_file = args
        .trace
        .as_deref()
        .map(|p| OutputFile::create(p, "trace"))
        .transpose()?;
    let options = options(&args.program, Some(&args.compile))?.check(true);
    let input = args.program.load_any(&options)?;
    let from_host = matches!(input, Input::Host(_));
    if from_host {
        args.compile.refuse_for_host(&args.program.file)?;
    }
    let options = match args.backend {
        BackendKind::Cuda if !from_host => on_gpus(options),
        _ => options,
    };
    // A rank of a multi-process GPU run lowers the program itself: it meets the other ranks
    // first, to lower with the machine profile they agree on, and checks after lowering that
    // it lowered rank 0's program (see `rank`). Host IR is refused there (`run_cuda_host`).
    let launched = match args.backend {
        BackendKind::Cuda if !from_host => {
            LaunchedRank::connect(Duration::from_millis(args.exec.timeout_ms))?
        }
        _ => None,
    };
    let options = match &launched {
        Some(rank) => rank.agree(options)?,
        None => options,
    };
    let compiled = args.program.compile(input, &options)?;
    if let Some(rank) = &launched {
        rank.check(&compiled)?;
    }
    let host = compiled.host();
    let world = host.world_size();
    let ranks = compiled.world_size();
    if world == 0 {
        return Err(CliError::Usage(format!(
            "`{}` has no meshes, so no rank holds a tensor: there is nothing to run",
            host.name
        )));
    }
    if args.graph && args.backend == BackendKind::Cpu {
        return Err(CliError::Usage(
            "--graph records CUDA graphs: it needs --backend cuda (the CPU backend has none)"
                .into(),
        ));
    }
    let nodes = super::node::nodes_of(ranks, args.nodes)?;
    let in_launch = args.backend == BackendKind::Cuda && launched_rank()?;
    if args.trace.is_some() && ((nodes > 1 && args.backend == BackendKind::Cpu) || in_launch) {
        return Err(CliError::Usage(
            "--trace is recorded in single-process runs only: run without --nodes (CPU) or \
             without `meshflow launch` to trace"
                .into(),
        ));
    }
    let lowered = compiled
        .timings()
        .iter()
        .map(|t| t.wall.as_secs_f64())
        .sum::<f64>();
    let mut summary = match from_host {
        false => format!(
            "{}: lowered in {:.1} ms ({} host instructions)\n",
            host.name,
            lowered * 1e3,
            count_insts(host)
        ),
        true => format!(
            "{}: host IR ({} host instructions)\n",
            host.name,
            count_insts(host)
        ),
    };
    if let Some(report) = compiled.check_report() {
        summary.push_str(&format!("cross-rank check: {report}\n"));
    }
    if ranks > world {
        summary.push_str(&format!(
            "note: ranks {world}..{ranks} hold no tensor of this program and stay idle\n"
        ));
    }
    if args.explain {
        summary.push_str(&profile_line(&args.compile, &compiled));
    }
    if args.explain && args.backend == BackendKind::Cpu {
        summary.push_str(if nodes > 1 {
            "transports: the CPU backend moves communications through its in-process fabric, \
             and between node processes through the host proxy (see its wire below)\n"
        } else {
            "transports: the CPU backend moves communications through its in-process fabric\n"
        });
    }
    if nodes > 1 && args.backend == BackendKind::Cpu {
        if from_host {
            return Err(CliError::Usage(
                "multi-process CPU runs (--nodes) need a level-1 program; host IR runs in one \
                 process"
                    .into(),
            ));
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
    let node_size = (nodes > 1).then(|| ranks.div_ceil(nodes));
    let (outcome, trace) = match compiled.level1() {
        Ok(level1) => {
            let how = Level1Run {
                ranks,
                node_size,
                launched: launched.as_ref(),
            };
            run_level1(&args, &compiled, level1, &how, &mut summary)?
        }
        Err(_) => run_host(&args, &compiled, ranks, node_size, &mut summary)?,
    };
    let result = match (trace_file, trace) {
        (Some(file), Some(trace)) => {
            let path = file.path().display().to_string();
            let pool = (args.backend == BackendKind::Cuda).then_some(args.compile.streams);
            file.write(&trace.to_json_with_pool(pool))
                .map(|()| summary.push_str(&format!("trace written to {path}\n")))
        }
        (Some(file), None) => Err(CliError::Run(format!(
            "no trace was recorded for `{}`",
            file.path().display()
        ))),
        (None, _) => Ok(()),
    };
    summary.push_str(&outcome.line);
    // The summary (and its last line) is printed even when writing the trace failed.
    print_out(&summary)?;
    result?;
    match outcome.passed {
        true => Ok(()),
        false => Err(CliError::Mismatch),
    }
}

/// The last line of a run's summary and whether it passed.
struct Outcome {
    line: String,
    passed: bool,
}

/// True when this process is a rank started by `meshflow launch` (or torchrun).
fn launched_rank() -> Result<bool, CliError> {
    Ok(TorchrunEnv::from_env()
        .map_err(|e| CliError::Usage(e.to_string()))?
        .is_some())
}

/// Where a program lowered from level 1 runs (a build without `cuda` reads only `ranks`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Level1Run<'a> {
    /// Number of ranks.
    ranks: usize,
    /// Ranks per node, when the run is split into nodes.
    node_size: Option<usize>,
    /// This process's rank of a multi-process GPU run.
    launched: Option<&'a LaunchedRank>,
}

/// Runs a program lowered from level 1 with random full inputs and compares the gathered
/// outputs with the unsharded reference.
fn run_level1(
    args: &RunArgs,
    compiled: &Compiled,
    level1: &Program,
    how: &Level1Run<'_>,
    summary: &mut String,
) -> Result<(Outcome, Option<Trace>), CliError> {
    let ranks = how.ranks;
    let inputs = random_inputs(level1, args.exec.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let (got, trace) = match args.backend {
        BackendKind::Cpu => {
            let outcome = run_cpu(
                compiled.host(),
                RunInputs::Full {
                    program: level1,
                    inputs: &inputs,
                },
                &cpu_options(args, ranks),
            )
            .map_err(|e| CliError::Run(e.to_string()))?;
            summary.push_str(&format!(
                "ran on {ranks} CPU ranks in {:.1} ms (seed {})\n",
                outcome.elapsed.as_secs_f64() * 1e3,
                args.exec.seed
            ));
            let got = outcome
                .gather(level1)
                .map_err(|e| CliError::Run(e.to_string()))?;
            (got, outcome.trace)
        }
        BackendKind::Cuda => {
            let gpu = run_cuda(args, compiled, &inputs, how, summary)?;
            match gpu.outputs {
                Some(got) => (got, gpu.trace),
                // A rank other than 0 of a multi-process run: rank 0 compares (the summary
                // says so).
                None => {
                    let line = String::new();
                    return Ok((Outcome { line, passed: true }, gpu.trace));
                }
            }
        }
    };
    let want = evaluate(level1, &inputs).map_err(|e| CliError::Run(e.to_string()))?;
    let comparison =
        compare_outputs(level1, &got, &want).map_err(|e| CliError::Run(e.to_string()))?;
    let outcome = Outcome {
        line: format!("{comparison}\n"),
        passed: comparison.passed(),
    };
    Ok((outcome, trace))
}

/// Runs a host program loaded from text: random local inputs on every rank, no reference
/// (host IR has no level-1 program to evaluate).
fn run_host(
    args: &RunArgs,
    compiled: &Compiled,
    ranks: usize,
    node_size: Option<usize>,
    summary: &mut String,
) -> Result<(Outcome, Option<Trace>), CliError> {
    let host = compiled.host();
    let per_rank =
        random_local_inputs(host, args.exec.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let trace = match args.backend {
        BackendKind::Cpu => {
            let outcome = run_cpu(
                host,
                RunInputs::PerRank(per_rank),
                &cpu_options(args, ranks),
            )
            .map_err(|e| CliError::Run(e.to_string()))?;
            summary.push_str(&format!(
                "ran on {ranks} CPU ranks in {:.1} ms (seed {})\n",
                outcome.elapsed.as_secs_f64() * 1e3,
                args.exec.seed
            ));
            outcome.trace
        }
        BackendKind::Cuda => run_cuda_host(args, compiled, per_rank, ranks, node_size, summary)?,
    };
    let line = format!(
        "ok {}: ran to completion on every rank (host IR has no level-1 program, so there is \
         no reference to compare the outputs with)\n",
        host.name
    );
    Ok((Outcome { line, passed: true }, trace))
}

fn cpu_options(args: &RunArgs, ranks: usize) -> CpuOptions {
    CpuOptions {
        ranks: Some(ranks),
        config: CpuConfig {
            stream_pool: args.compile.streams,
            timeout: Duration::from_millis(args.exec.timeout_ms),
            race_check: !args.exec.no_race_check,
            ..CpuConfig::default()
        },
        trace: args.trace.is_some(),
    }
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this meshflow was built without the `cuda` feature; rebuild with \
                       `cargo build --release --features cuda` to use --backend cuda";

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _args: &RunArgs,
    _compiled: &Compiled,
    _inputs: &BTreeMap<String, TensorData>,
    _how: &Level1Run<'_>,
    _summary: &mut String,
) -> Result<GpuOutcome, CliError> {
    Err(CliError::Usage(NO_CUDA.to_string()))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda_host(
    _args: &RunArgs,
    _compiled: &Compiled,
    _per_rank: BTreeMap<usize, BTreeMap<String, TensorData>>,
    _ranks: usize,
    _node_size: Option<usize>,
    _summary: &mut String,
) -> Result<Option<Trace>, CliError> {
    Err(CliError::Usage(NO_CUDA.to_string()))
}

/// What a GPU run gives back (without the `cuda` feature there is none).
#[cfg(not(feature = "cuda"))]
struct GpuOutcome {
    outputs: Option<BTreeMap<String, TensorData>>,
    trace: Option<Trace>,
}

#[cfg(feature = "cuda")]
use super::run_cuda::GpuOutcome;

#[cfg(feature = "cuda")]
fn gpu_run(args: &RunArgs, ranks: usize, node_size: Option<usize>) -> super::run_cuda::GpuRun {
    super::run_cuda::GpuRun {
        ranks,
        node_size,
        streams: args.compile.streams,
        timeout: Duration::from_millis(args.exec.timeout_ms),
        trace: args.trace.is_some(),
        graph: args.graph,
        wire: args.exec.wire,
        transport: args.compile.transport,
        explain: args.explain,
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(
    args: &RunArgs,
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    how: &Level1Run<'_>,
    summary: &mut String,
) -> Result<GpuOutcome, CliError> {
    super::run_cuda::run(
        compiled,
        inputs,
        &gpu_run(args, how.ranks, how.node_size),
        how.launched,
        summary,
    )
}

#[cfg(feature = "cuda")]
fn run_cuda_host(
    args: &RunArgs,
    compiled: &Compiled,
    per_rank: BTreeMap<usize, BTreeMap<String, TensorData>>,
    ranks: usize,
    node_size: Option<usize>,
    summary: &mut String,
) -> Result<Option<Trace>, CliError> {
    super::run_cuda::run_host(
        compiled,
        per_rank,
        &gpu_run(args, ranks, node_size),
        summary,
    )
}

fn count_insts(host: &meshflow::ir::HostProgram) -> usize {
    let mut n = 0;
    host.walk(&mut |_, _| n += 1);
    n
}
