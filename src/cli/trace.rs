//! `meshflow trace FILE [--ranks N] [--param k=v]... [--backend sim|cuda] [-o out.json]
//! [--svg out.svg] [--streams P] [--decompose TENSOR=VARIANT]... [--seed S]`: lowers the
//! program, runs it once on every rank with random inputs and writes a Perfetto/Chrome trace
//! (JSON) and an SVG timeline (one row per rank and stream, boxes coloured by compute,
//! communication, copy and wait). On the sim backend the boxes are the host time of each
//! instruction; on GPUs (`--backend cuda`) they are device intervals from CUDA events, of a run
//! after two warm-up runs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use meshflow::passes::Decomposition;
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::launch::{run_sim, SimInputs, SimOptions};
use meshflow::runtime::sim::SimConfig;
use meshflow::runtime::trace::Trace;

use super::common::{print_out, CliError, ProgramArgs};
use super::run::BackendKind;

/// Arguments of `trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    backend: BackendKind,
    /// The Perfetto/Chrome trace (JSON).
    #[arg(
        short = 'o',
        long = "out",
        value_name = "FILE",
        default_value = "trace.json"
    )]
    out: PathBuf,
    /// The SVG timeline (default: the trace's path with `.svg`).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Size of the worker stream pool.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    #[command(flatten)]
    search: super::common::SearchArgs,
    /// Force a decomposition: `--decompose TENSOR=VARIANT` (repeatable; as `lower`).
    #[arg(long = "decompose", value_name = "TENSOR=VARIANT")]
    decompose: Vec<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Runs `trace`.
pub fn run(args: TraceArgs) -> Result<(), CliError> {
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
        num_streams: args.streams.max(1),
        decompositions,
        stream_schedule: args.search.schedule.schedule(),
        cost_model: args.search.cost_model()?,
        ..CompileOptions::default()
    };
    let compiled = compile(&program, &options)?;
    let world = compiled.host.world_size();
    let ranks = match args.program.ranks {
        Some(r) => usize::try_from(r)
            .ok()
            .filter(|&r| r >= world)
            .ok_or_else(|| CliError::Usage(format!("--ranks {r}: the program needs {world}")))?,
        None => world,
    };
    let inputs = random_inputs(&program, args.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let full = SimInputs::Full {
        program: &compiled.program,
        inputs: &inputs,
    };
    let (trace, pool) = match args.backend {
        BackendKind::Sim => {
            let sim = SimOptions {
                ranks: Some(ranks),
                config: SimConfig {
                    stream_pool: args.streams.max(1),
                    timeout: Duration::from_secs(30),
                    ..SimConfig::default()
                },
                trace: true,
            };
            let outcome =
                run_sim(&compiled.host, full, &sim).map_err(|e| CliError::Run(e.to_string()))?;
            (outcome.trace.unwrap_or_default(), None)
        }
        BackendKind::Cuda => (
            cuda_trace(&compiled.host, full, ranks, args.streams)?,
            Some(args.streams.max(1)),
        ),
    };
    let svg_path = args
        .svg
        .clone()
        .unwrap_or_else(|| args.out.with_extension("svg"));
    let write = |path: &PathBuf, text: String| {
        std::fs::write(path, text)
            .map_err(|source| CliError::Run(format!("cannot write `{}`: {source}", path.display())))
    };
    write(&args.out, trace.to_json())?;
    let title = format!(
        "{} on {ranks} {} ranks",
        program.name,
        match args.backend {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "GPU",
        }
    );
    write(&svg_path, trace.to_svg(&title, pool))?;
    print_out(&format!(
        "{} events; trace written to {}, timeline to {}\n",
        trace.events.len(),
        args.out.display(),
        svg_path.display()
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_trace(
    _host: &meshflow::ir::HostProgram,
    _inputs: SimInputs<'_>,
    _ranks: usize,
    _streams: usize,
) -> Result<Trace, CliError> {
    Err(CliError::Usage(
        "this meshflow was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda` to use --backend cuda"
            .to_string(),
    ))
}

#[cfg(feature = "cuda")]
fn cuda_trace(
    host: &meshflow::ir::HostProgram,
    inputs: SimInputs<'_>,
    ranks: usize,
    streams: usize,
) -> Result<Trace, CliError> {
    use meshflow::runtime::cuda::{run_cuda_timed, CudaConfig, CudaOptions};
    let options = CudaOptions {
        ranks: Some(ranks),
        config: CudaConfig {
            stream_pool: streams.max(1),
            timeout: Duration::from_secs(120),
            profile: true,
            ..CudaConfig::default()
        },
    };
    let run =
        run_cuda_timed(host, inputs, &options, 2, 1).map_err(|e| CliError::Run(e.to_string()))?;
    Ok(run.outcome.trace.unwrap_or_default())
}
