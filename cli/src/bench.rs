//! `meshflow bench agmm|rsmm|schedule|permute [--json FILE] [--torch FILE] [--ranks N]
//! [--warmup W] [--iters I] [--steps S] [--graph] [--shape MxKxN]... [--mib M]... [--streams P]
//! [--skip-parts] [--seed S]`: GPU benchmarks of the overlapped column-parallel (all-gather +
//! GEMM) and row-parallel (GEMM + reduce-scatter) linear layers in bf16, next to the
//! communication and the GEMM timed alone, the bound max(comm, GEMM) and PyTorch's figures
//! (`--torch`, the JSON of PyTorch's baseline script); and the collective-permute bandwidth of
//! the copy engine against NCCL send/recv. Every variant is a lowered program, forced through
//! the options a user has (see `meshflow_bench::programs`). `schedule` runs `agmm` and `rsmm`
//! and writes the flat rows of `meshflow_bench::rows::schedule_rows` (`--json`); under
//! `meshflow launch` (one process per GPU) rank 0 prints and writes the results with `procs` =
//! the world size. Every time is per step of `--steps` steps of the host program run back to
//! back on warm GPUs (CUDA events; the median over iterations per rank, then the maximum over
//! ranks). `agmm`, `rsmm` and `schedule` set each case up once (backends, communicators,
//! inputs on the GPUs), check every variant's outputs once against the reference, then time
//! every program of the case in interleaved rounds (`--warmup` untimed and `--iters` timed
//! rounds, each program once per round); programs that lower to the same host program are
//! timed once. Prints one table per case; `--json` also writes the results. Exits with an error
//! when a variant failed (after printing the others).

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[cfg(feature = "cuda")]
use super::common::print_out;
use super::common::CliError;

/// Which benchmark.
#[derive(Debug, Subcommand)]
pub enum BenchCase {
    /// Column-parallel linear: all-gather + GEMM (collective, broadcast, ring, ring forward and
    /// bidirectional ring variants).
    Agmm(BenchArgs),
    /// Row-parallel linear: GEMM + reduce-scatter (collective, per-step reduce and ring
    /// variants).
    Rsmm(BenchArgs),
    /// `agmm` and `rsmm` together, written as one list of schedule rows (`--json`).
    Schedule(BenchArgs),
    /// Collective-permute bandwidth: copy engine against NCCL send/recv.
    Permute(BenchArgs),
    /// MoE dispatch and combine latency, NCCL and NVLink transports.
    Moe(super::bench_moe::MoeBenchArgs),
}

/// Arguments of `bench`.
#[derive(Debug, Args)]
pub struct BenchCommand {
    /// The benchmark.
    #[command(subcommand)]
    pub case: BenchCase,
}

/// Options shared by the benchmarks.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Also write the results as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Number of GPUs (ranks); default: every GPU.
    #[arg(long)]
    ranks: Option<usize>,
    /// PyTorch's figures: the JSON written by `bench/torch_baselines.py` (or its output).
    #[arg(long, value_name = "FILE")]
    torch: Option<PathBuf>,
    /// Untimed iterations (`agmm`, `rsmm`, `schedule`: untimed rounds over the case's programs).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed iterations (`agmm`, `rsmm`, `schedule`: rounds, every program of the case once per
    /// round, in turn); CUDA events; the median per rank, then the maximum over ranks.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Host program steps per iteration, back to back (times are per step).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Also time variants recorded as a CUDA graph and replayed (NCCL transport).
    #[arg(long)]
    graph: bool,
    /// Time only the CUDA-graph variants (and the parts alone).
    #[arg(long)]
    graph_only: bool,
    /// Sizes of `bench permute`, MiB per rank (repeatable; default 64 and 256).
    #[arg(long = "mib")]
    mib: Vec<u64>,
    /// Write profiled traces (Perfetto JSON + SVG timeline) of the three ring variants and of the
    /// prefetch-scheduled ring (`agmm`) here.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// A case `MxKxN` (repeatable); default: 16384x8192x8192 and 8192x8192x8192.
    #[arg(long = "shape", value_name = "MxKxN")]
    shapes: Vec<String>,
    /// Worker streams.
    #[arg(long, default_value_t = 2)]
    streams: usize,
    /// Skip timing each ring's communications alone and its compute alone (the tables'
    /// parts; the bound and every variant are still measured).
    #[arg(long)]
    skip_parts: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 2024)]
    seed: u64,
    /// Seconds a rank waits for a peer or the device before it gives up (`agmm`, `rsmm`,
    /// `schedule`: a rank that makes no progress for longer ends its case as an error naming
    /// the program and the phase).
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    timeout: u64,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn parse_shape(s: &str) -> Result<meshflow_bench::programs::Gemm3, CliError> {
    let parts: Vec<&str> = s.split(['x', 'X']).collect();
    let bad = || {
        CliError::Usage(format!(
            "--shape `{s}`: expected MxKxN, e.g. 8192x8192x8192"
        ))
    };
    let [m, k, n] = parts.as_slice() else {
        return Err(bad());
    };
    let p = |v: &str| {
        v.trim()
            .parse::<u64>()
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(bad)
    };
    Ok(meshflow_bench::programs::Gemm3 {
        m: p(m)?,
        k: p(k)?,
        n: p(n)?,
    })
}

/// Runs `bench`.
pub fn run(cmd: BenchCommand) -> Result<(), CliError> {
    let (name, args) = match cmd.case {
        BenchCase::Agmm(a) => ("agmm", a),
        BenchCase::Rsmm(a) => ("rsmm", a),
        BenchCase::Schedule(a) => ("schedule", a),
        BenchCase::Permute(a) => ("permute", a),
        BenchCase::Moe(a) => return super::bench_moe::run(a),
    };
    measure(name, &args)
}

#[cfg(not(feature = "cuda"))]
fn measure(_name: &str, _args: &BenchArgs) -> Result<(), CliError> {
    Err(CliError::Usage(
        "this meshflow was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda` to run GPU benchmarks"
            .to_string(),
    ))
}

#[cfg(feature = "cuda")]
fn measure(name: &str, args: &BenchArgs) -> Result<(), CliError> {
    use meshflow_bench::rows::{rows_json, schedule_rows};
    use meshflow_bench::{
        bench_agmm, bench_permute, bench_rsmm, permute_json, permute_table, results_json,
        BenchOptions, TorchBaselines,
    };

    let env = meshflow::runtime::rendezvous::TorchrunEnv::from_env()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let (procs, leader) = match &env {
        Some(e) => (e.world_size, e.rank == 0),
        None => (1, true),
    };

    let mut opts = BenchOptions {
        ranks: args.ranks,
        warmup: args.warmup,
        iterations: args.iters.max(1),
        steps: args.steps.max(1),
        graph: args.graph,
        graph_only: args.graph_only,
        stream_pool: args.streams.max(1),
        seed: args.seed,
        trace_dir: args.trace_dir.clone(),
        launched: env,
        parts: !args.skip_parts,
        timeout: std::time::Duration::from_secs(args.timeout.max(1)),
        ..BenchOptions::default()
    };
    if let Some(path) = &args.torch {
        let text = std::fs::read_to_string(path).map_err(|source| {
            CliError::Usage(format!("cannot read `{}`: {source}", path.display()))
        })?;
        opts.torch = Some(
            TorchBaselines::parse(&text)
                .map_err(|e| CliError::Usage(format!("`{}`: {e}", path.display())))?,
        );
    }
    if !args.shapes.is_empty() {
        opts.shapes = args
            .shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_, _>>()?;
    }
    if !args.mib.is_empty() {
        opts.permute_mib = args.mib.clone();
    }
    let failed =
        |e: meshflow_bench::BenchError| CliError::Usage(format!("bench {name} failed: {e}"));
    let (text, json, failures) = if name == "permute" {
        let (results, device) = bench_permute(&opts).map_err(failed)?;
        (permute_table(&results, &device), permute_json(&results), 0)
    } else {
        let cases = match name {
            "agmm" => bench_agmm(&opts),
            "rsmm" => bench_rsmm(&opts),
            _ => bench_agmm(&opts).and_then(|mut a| {
                a.extend(bench_rsmm(&opts)?);
                Ok(a)
            }),
        }
        .map_err(failed)?;
        let mut text = String::new();
        for c in &cases {
            text.push_str(&c.table());
            text.push('\n');
        }
        let failures = cases
            .iter()
            .flat_map(|c| &c.variants)
            .filter(|v| v.failure.is_some())
            .count();
        let json = if name == "schedule" {
            rows_json(&schedule_rows(&cases, procs))
        } else {
            results_json(&cases)
        };
        (text, json, failures)
    };
    if !leader {
        // One process per GPU: rank 0 reports for every rank.
        return Ok(());
    }
    print_out(&text)?;
    if let Some(path) = &args.json {
        std::fs::write(path, json).map_err(|source| {
            CliError::Usage(format!("cannot write `{}`: {source}", path.display()))
        })?;
        print_out(&format!("results written to {}\n", path.display()))?;
    }
    if failures > 0 {
        return Err(CliError::Usage(format!(
            "bench {name}: {failures} variant(s) failed (see the table)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        let g = parse_shape("16384x8192X4096").unwrap();
        assert_eq!((g.m, g.k, g.n), (16384, 8192, 4096));
        assert!(parse_shape("1x2").is_err());
        assert!(parse_shape("0x2x3").is_err());
    }
}
