//! `meshflow trace FILE [program and compile options] [--backend cpu|cuda] [-o out.json]
//! [--svg out.svg] [--seed S]`: lowers the program (or takes host IR text as written),
//! runs it once on every rank with random inputs and writes a Perfetto/Chrome trace
//! (JSON) and an SVG timeline (one row per rank and stream, boxes coloured by compute,
//! communication, copy and wait). On the CPU backend the boxes are the host time of each
//! instruction; on GPUs (`--backend cuda`) they are device intervals from CUDA events, of a run
//! after two warm-up runs.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use meshflow::runtime::compare::{random_inputs, random_local_inputs};
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::ranks::{run_cpu, CpuOptions, RunInputs};
use meshflow::runtime::trace::Trace;

use super::common::{
    on_gpus, options, print_out, CliError, CompileArgs, Input, OutputFile, ProgramArgs,
};
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
    // Both outputs before anything else: a path that cannot be written fails here.
    let svg_path = args
        .svg
        .clone()
        .unwrap_or_else(|| args.out.with_extension("svg"));
    let json_file = OutputFile::create(&args.out, "trace")?;
    let svg_file = OutputFile::create(&svg_path, "timeline")?;
    let options = options(&args.program, Some(&args.compile))?.check(false);
    let input = args.program.load_any(&options)?;
    let options = if matches!(input, Input::Host(_)) {
        args.compile.refuse_for_host(&args.program.file)?;
        options
    } else if args.backend == BackendKind::Cuda {
        on_gpus(options)
    } else {
        options
    };
    let compiled = args.program.compile(input, &options)?;
    let host = compiled.host();
    let ranks = compiled.world_size();
    if host.world_size() == 0 {
        return Err(CliError::Usage(format!(
            "`{}` has no meshes, so no rank holds a tensor: there is nothing to trace",
            host.name
        )));
    }
    let streams = args.compile.streams;
    let full_inputs;
    let inputs = match compiled.level1() {
        Ok(level1) => {
            full_inputs =
                random_inputs(level1, args.seed).map_err(|e| CliError::Run(e.to_string()))?;
            RunInputs::Full {
                program: level1,
                inputs: &full_inputs,
            }
        }
        // Host IR text: random local inputs on every rank.
        Err(_) => RunInputs::PerRank(
            random_local_inputs(host, args.seed).map_err(|e| CliError::Run(e.to_string()))?,
        ),
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
            let outcome = run_cpu(host, inputs, &cpu).map_err(|e| CliError::Run(e.to_string()))?;
            (outcome.trace.unwrap_or_default(), None)
        }
        BackendKind::Cuda => (cuda_trace(host, inputs, ranks, streams)?, Some(streams)),
    };
    json_file.write(&trace.to_json_with_pool(pool))?;
    let title = format!(
        "{} on {ranks} {} ranks",
        host.name,
        match args.backend {
            BackendKind::Cpu => "CPU",
            BackendKind::Cuda => "GPU",
        }
    );
    svg_file.write(&trace.to_svg(&title, pool))?;
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
