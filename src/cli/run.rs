//! `meshflow run FILE [--ranks N] [--param k=v]... [--backend sim|cuda] [--seed S]
//! [--trace out.json] [--streams N] [--schedule S] [--profile NAME|FILE] [--transport T]
//! [--timeout-ms T] [--no-race-check] [--nodes M] [--wire tcp|ibverbs|auto] [--graph]
//! [--explain]`: lowers the
//! program, checks the host program across ranks, runs it on every rank with random inputs,
//! compares the gathered outputs with an unsharded reference, and prints a summary whose last
//! line starts with `ok` or `mismatch`. Exits 0 only when every output matches. With `--nodes M`
//! (or `MESHFLOW_NODE_SIZE`) the sim ranks run in M processes linked by the host proxy (see
//! [`node`](super::node)); GPU ranks (`--backend cuda`) stay in this process (or the processes
//! of `meshflow launch`) and reach the ranks of other nodes through their host proxies.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use meshflow::check::check_program;
use meshflow::kernels::proxy::WireChoice;
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::launch::{run_sim, SimInputs, SimOptions};
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::sim::SimConfig;

use super::common::{print_out, CliError, ProgramArgs};

/// Where the ranks run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The embedded CPU backend: one thread per rank, host memory.
    Sim,
    /// GPUs over CUDA and NCCL (needs the `cuda` feature).
    Cuda,
}

/// Arguments of `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    backend: BackendKind,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write a Chrome/Perfetto trace (one track per rank and stream).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Size of the worker stream pool.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    #[command(flatten)]
    search: super::common::SearchArgs,
    /// How long a rank waits for a peer before the run fails, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Do not check stream ordering (races) while running (sim backend).
    #[arg(long)]
    no_race_check: bool,
    /// Split the ranks into this many nodes linked by the host proxy over TCP (default:
    /// `MESHFLOW_NODE_SIZE` ranks per node when set, else one node). Sim ranks run in one
    /// process per node; GPU ranks move collective permutes and MoE rows between nodes
    /// through the proxy.
    #[arg(long)]
    nodes: Option<usize>,
    /// The wire of the host proxy between nodes: `tcp`, `ibverbs` (needs a build with
    /// `--features rdma` and an RDMA device on every rank) or `auto` (ibverbs where every rank
    /// can, else TCP; the run says which and why).
    #[arg(long, default_value = "tcp")]
    wire: WireChoice,
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
    let program = args.program.load()?;
    let options = CompileOptions {
        num_streams: args.streams.max(1),
        stream_schedule: args.search.schedule.schedule(),
        cost_model: args.search.cost_model()?,
        ..CompileOptions::default()
    };
    let started = Instant::now();
    let compiled = compile(&program, &options)?;
    let world = compiled.host.world_size();
    let ranks = match args.program.ranks {
        Some(r) => usize::try_from(r)
            .map_err(|_| CliError::Usage(format!("--ranks {r}: must be positive")))?,
        None => world,
    };
    if ranks < world {
        return Err(CliError::Usage(format!(
            "the program's meshes use {world} devices but only {ranks} ranks were requested"
        )));
    }
    let mut summary = format!(
        "{}: lowered in {:.1} ms ({} host instructions)\n",
        program.name,
        started.elapsed().as_secs_f64() * 1e3,
        count_insts(&compiled.host)
    );
    let report = check_program(&compiled.host, ranks)
        .map_err(|e| CliError::Usage(format!("the cross-rank check rejects the program:\n{e}")))?;
    summary.push_str(&format!("cross-rank check: {report}\n"));
    if ranks > world {
        summary.push_str(&format!(
            "note: ranks {world}..{ranks} hold no tensor of this program and stay idle\n"
        ));
    }
    if args.graph && args.backend == BackendKind::Sim {
        return Err(CliError::Usage(
            "--graph records CUDA graphs: it needs --backend cuda (the sim backend has none)"
                .into(),
        ));
    }
    let nodes = super::node::nodes_of(ranks, args.nodes)?;
    if args.explain && args.backend == BackendKind::Sim {
        summary.push_str(if nodes > 1 {
            "transports: the sim backend moves communications through its in-process fabric, \
             and between node processes through the host proxy (see its wire below)\n"
        } else {
            "transports: the sim backend moves communications through its in-process fabric\n"
        });
    }
    if nodes > 1 && args.backend == BackendKind::Sim {
        if args.search.schedule != super::common::ScheduleArg::Auto
            || args.search.profile.is_some()
            || args.search.transport.is_some()
        {
            return Err(CliError::Usage(
                "--schedule, --profile and --transport are not passed to the node processes of a \
                 multi-process sim run yet; run without --nodes"
                    .into(),
            ));
        }
        if args.trace.is_some() {
            summary.push_str("note: --trace is not recorded in multi-process runs\n");
        }
        let sim = super::node::SimArgs {
            seed: args.seed,
            streams: args.streams,
            timeout_ms: args.timeout_ms,
            no_race_check: args.no_race_check,
            wire: args.wire,
        };
        return super::node::launch(&args.program, &sim, ranks, nodes, &summary);
    }
    let inputs = random_inputs(&program, args.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let got = match args.backend {
        BackendKind::Sim => {
            let sim = SimOptions {
                ranks: Some(ranks),
                config: SimConfig {
                    stream_pool: args.streams.max(1),
                    timeout: Duration::from_millis(args.timeout_ms),
                    race_check: !args.no_race_check,
                    ..SimConfig::default()
                },
                trace: args.trace.is_some(),
            };
            let outcome = run_sim(
                &compiled.host,
                SimInputs::Full {
                    program: &compiled.program,
                    inputs: &inputs,
                },
                &sim,
            )
            .map_err(|e| CliError::Run(e.to_string()))?;
            summary.push_str(&format!(
                "ran on {ranks} sim ranks in {:.1} ms (seed {})\n",
                outcome.elapsed.as_secs_f64() * 1e3,
                args.seed
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
                .gather(&compiled.program)
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
    _compiled: &meshflow::pipeline::Compiled,
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
    compiled: &meshflow::pipeline::Compiled,
    inputs: &std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>,
    ranks: usize,
    node_size: Option<usize>,
    summary: &mut String,
) -> Result<Option<std::collections::BTreeMap<String, meshflow::runtime::data::TensorData>>, CliError>
{
    let how = super::run_cuda::GpuRun {
        ranks,
        node_size,
        streams: args.streams,
        timeout: Duration::from_millis(args.timeout_ms),
        trace: args.trace.as_deref(),
        graph: args.graph,
        wire: args.wire,
        transport: args.search.transport,
        explain: args.explain,
    };
    super::run_cuda::run(compiled, inputs, &how, summary)
}

fn count_insts(host: &meshflow::ir::HostProgram) -> usize {
    let mut n = 0;
    host.walk(&mut |_, _| n += 1);
    n
}
