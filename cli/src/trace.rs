//! `meshflow trace FILE [program and compile options] [--backend cpu|cuda] [-o out.json]
//! [--svg out.svg] [--seed S]`: lowers the
//! program, runs it once on every rank with random inputs and writes a Perfetto/Chrome trace
//! (JSON) and an SVG timeline (one row per rank and stream, boxes coloured by compute,
//! communication, copy and wait). On the CPU backend the boxes are the host time of each
//! instruction; on GPUs (`--backend cuda`) they are device intervals from CUDA events, of a run
//! after two warm-up runs.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::ranks::{run_cpu, CpuOptions, RunInputs};
use meshflow::runtime::trace::Trace;

use super::common::{options, print_out, CliError, CompileArgs, ProgramArgs};
use super::run::BackendKind;

/// Arguments of `trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    program: ProgramArgs,
    #[command(flatten)]
    compile: CompileArgs,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
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
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Runs `trace`.
pub fn run(args: TraceArgs) -> Result<(), CliError> {
    let options = options(&args.program, Some(&args.compile))?.check(false);
    let program = args.program.load(&options)?;
    let compiled = meshflow::compile(&program, &options).map_err(|e| args.program.error(e))?;
    let level1 = compiled.level1().map_err(|e| args.program.error(e))?;
    let ranks = compiled.world_size();
    let streams = args.compile.streams;
    let inputs = random_inputs(&program, args.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let full = RunInputs::Full {
        program: level1,
        inputs: &inputs,
    };
    let (trace, pool) = match args.backend {
        BackendKind::Cpu => {
            let cpu = CpuOptions {
                ranks: Some(ranks),
                config: CpuConfig {
                    stream_pool: streams,
                    timeout: Duration::from_secs(30),
                    ..CpuConfig::default()
                },
                trace: true,
            };
            let outcome =
                run_cpu(compiled.host(), full, &cpu).map_err(|e| CliError::Run(e.to_string()))?;
            (outcome.trace.unwrap_or_default(), None)
        }
        BackendKind::Cuda => (
            cuda_trace(compiled.host(), full, ranks, streams)?,
            Some(streams),
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
            BackendKind::Cpu => "CPU",
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
    _inputs: RunInputs<'_>,
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
    inputs: RunInputs<'_>,
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
