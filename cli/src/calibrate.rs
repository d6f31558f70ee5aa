//! `meshflow calibrate [--backend cpu|cuda] [--ranks N] [--out FILE] [--name NAME] [--quick]
//! [--warmup W] [--iters I] [--steps S]`: measures this machine (collectives of every
//! transport over message sizes, GEMMs by shape, the slowdown of a GEMM beside a transfer,
//! launch and loop overheads, memory bandwidth; see `meshflow_bench::calibrate`) and writes a
//! profile (JSON) that `lower`, `run` and the embed API read (`--profile FILE`).
//!
//! `--backend cpu` (the default) measures the CPU backend (ranks as threads of this process):
//! those figures describe the CPU backend, not a GPU, and the profile says so (its first note,
//! and `provisional: true`). `--backend cuda` (feature `cuda`) measures the GPUs of this
//! machine, one rank per GPU in this process.

use std::path::PathBuf;

use clap::Args;
use meshflow_bench::calibrate::{calibrate, CalibrateOptions, CpuTimer};

use super::common::{print_out, CliError};
use super::run::BackendKind;

/// Arguments of `calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// The backend to measure.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Number of ranks (default: 2 on the CPU backend, every GPU with `--backend cuda`).
    #[arg(long)]
    ranks: Option<usize>,
    /// Where to write the profile.
    #[arg(long, value_name = "FILE", default_value = "meshflow-profile.json")]
    out: PathBuf,
    /// The profile's name (default: the GPU model and the rank count, e.g. `h100x2`).
    #[arg(long)]
    name: Option<String>,
    /// Fewer sizes and shapes (a rough profile in a fraction of the time).
    #[arg(long)]
    quick: bool,
    /// Untimed runs before each measurement.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed runs of each measurement (the median is kept).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Steps per timed run on GPUs (times are per step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

/// Runs `calibrate`.
pub fn run(args: CalibrateArgs) -> Result<(), CliError> {
    let failed =
        |e: meshflow_bench::calibrate::CalibrateError| CliError::Run(format!("calibrate: {e}"));
    let profile = match args.backend {
        BackendKind::Cpu => {
            let world = args.ranks.unwrap_or(2);
            let mut o = CalibrateOptions::cpu(world);
            if args.quick {
                o.sizes.truncate(2);
                o.gemms.truncate(2);
            }
            if let Some(n) = &args.name {
                o.name = n.clone();
            }
            let mut timer = CpuTimer {
                world,
                warmup: args.warmup,
                iterations: args.iters.max(1),
            };
            calibrate(&mut timer, &o).map_err(failed)?
        }
        BackendKind::Cuda => gpu(&args).map_err(failed)?,
    };
    let json = profile.to_json();
    std::fs::write(&args.out, format!("{json}\n")).map_err(|source| {
        CliError::Usage(format!("cannot write `{}`: {source}", args.out.display()))
    })?;
    let mut text = format!(
        "profile `{}` ({} ranks, {}) written to {}\n",
        profile.name,
        profile.world,
        profile.device,
        args.out.display()
    );
    for n in &profile.notes {
        text.push_str(&format!("  {n}\n"));
    }
    for g in &profile.gemm.half {
        text.push_str(&format!(
            "  GEMM {}x{}x{} bf16: {:.1} us ({:.1} TFLOP/s)\n",
            g.m,
            g.n,
            g.k,
            g.us,
            2.0 * (g.m * g.n * g.k) as f64 / g.us / 1e6
        ));
    }
    for (key, t) in &profile.transports {
        for (c, points) in &t.collectives {
            if let Some(&(bytes, us)) = points.last() {
                text.push_str(&format!(
                    "  {key} {c}: {us:.1} us for {bytes:.0} bytes ({:.1} GB/s)\n",
                    bytes / us / 1e3
                ));
            }
        }
    }
    text.push_str(&format!(
        "use it with: meshflow lower PROGRAM --profile {}\n",
        args.out.display()
    ));
    print_out(&text)
}

#[cfg(not(feature = "cuda"))]
fn gpu(
    _args: &CalibrateArgs,
) -> Result<meshflow::Profile, meshflow_bench::calibrate::CalibrateError> {
    Err(meshflow_bench::calibrate::CalibrateError::Invalid(
        "--backend cuda: this meshflow was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda`"
            .into(),
    ))
}

#[cfg(feature = "cuda")]
fn gpu(
    args: &CalibrateArgs,
) -> Result<meshflow::Profile, meshflow_bench::calibrate::CalibrateError> {
    use meshflow_bench::calibrate::{CalibrateError, GpuTimer};
    let have = meshflow::runtime::cuda::device_count()
        .map_err(|e| CalibrateError::Invalid(e.to_string()))?;
    let world = args.ranks.unwrap_or(have);
    if world > have {
        return Err(CalibrateError::Invalid(format!(
            "--ranks {world}: this machine has {have} GPU(s)"
        )));
    }
    let device = meshflow::kernels::Device::name_of(0)
        .map_err(|e| CalibrateError::Invalid(e.to_string()))?;
    let mut o = CalibrateOptions::gpu(&device, world);
    if args.quick {
        o.sizes = vec![1 << 20, 64 << 20];
        o.gemms.truncate(3);
    }
    if let Some(n) = &args.name {
        o.name = n.clone();
    }
    let mut timer = GpuTimer {
        world,
        warmup: args.warmup,
        iterations: args.iters.max(1),
        steps: args.steps.max(1),
    };
    calibrate(&mut timer, &o)
}
