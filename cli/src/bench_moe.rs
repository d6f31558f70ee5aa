//! `meshflow bench moe [--ranks N] [--tokens T]... [--hidden H] [--top-k K] [--experts E]
//! [--transport nccl|nvlink]... [--wire native|fp8-token|fp8-block128]... [--warmup W]
//! [--iters I] [--path kernels|evaluator]... [--steps S] [--torch torch.json] [--json FILE]`:
//! MoE dispatch and combine latency on the GPUs of this machine (one thread per GPU), over the
//! NCCL transport (one grouped send/recv of `T`-row blocks per phase, counts on the device)
//! and the NVLink transport (one kernel per phase storing into peer-mapped memory, device-side
//! flags), along two paths: `kernels`, the kernels crate's transports driven directly, and
//! `evaluator`, the lowered `moe_layer` program's `moe_dispatch` and `moe_combine`
//! instructions run by the evaluator over the forced transport (see
//! `meshflow_bench::moe_eval`; the difference is the evaluator's overhead).
//! Each token travels once per destination rank; the weights travel with the dispatch.
//! Reported per case: the median over steps of the slowest rank, in µs, and the busiest rank's
//! deduplicated received bytes over that time in GB/s (DeepEP's way; see
//! `meshflow_kernels::moe::MoeTraffic`). With `--torch`, the PyTorch figures of
//! a baseline script's JSON (`--torch`, see `bench/README.md`) from the same machine are
//! printed next to ours.
//!
//! The evaluator path over NVLink gives two rows: the plain evaluator, and its steps recorded
//! as a CUDA graph and replayed (`nvlink+graph` in the tables, `"graph": true` in the JSON):
//! no host work between steps. Both paths time the same span per phase: from an event
//! recorded just before the phase's first device work to one just after its last (for the
//! evaluator, its profile's events around the `moe_dispatch` and `moe_combine`
//! instructions; in a graph, event record nodes given fresh events at every replay), per step
//! the slowest rank, the median over steps. The evaluator's work between the phases and
//! between steps is outside those spans: its rows also give `step_us`, the device time of a
//! whole step (idle time included when the host falls behind), and `host_us`, the host's time
//! to issue one step.
//!
//! `--json` writes a list of rows with the keys `path` (`kernels`, `evaluator`), `transport`, `dtype` (the
//! element type, or the FP8 wire), `world`, `tokens`, `dispatch_us`, `combine_us`,
//! `dispatch_gbps`, `combine_gbps`, `torch_dispatch_us`, `torch_combine_us` (null without
//! `--torch`), `device`, and also `wire`, `hidden`, `top_k`, `experts`, `capacity`,
//! `dispatch_bytes`, `combine_bytes` (the busiest rank's received bytes per phase, those of
//! the GB/s), `status_ok`, `graph` (steps replayed as a CUDA graph), `step_us` and `host_us`
//! (evaluator rows; null for the kernels' path).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use meshflow::passes::Transport;

use super::common::CliError;

/// How dispatch encodes token rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Wire {
    /// The rows as they are (bf16).
    Native,
    /// FP8 E4M3 with one scale per token.
    Fp8Token,
    /// FP8 E4M3 with one scale per 128 channels.
    Fp8Block128,
}

/// Which code runs dispatch and combine.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum MoePath {
    /// The kernels crate's transports, driven directly.
    Kernels,
    /// The lowered `moe_layer` program's instructions, run by the evaluator: each phase timed
    /// by events just before and after its instruction's device work (the span the kernels'
    /// path times), also inside a CUDA graph; plus the whole step's device time and the host's
    /// time to issue a step (`step_us`, `host_us`).
    Evaluator,
}

/// Arguments of `bench moe`.
#[derive(Debug, Args)]
pub struct MoeBenchArgs {
    /// Number of GPUs (the expert-parallel team); default: every GPU.
    #[arg(long)]
    ranks: Option<usize>,
    /// Tokens per rank (repeatable); default 128 and 4096.
    #[arg(long = "tokens")]
    tokens: Vec<usize>,
    /// Token width H.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token K.
    #[arg(long = "top-k", default_value_t = 8)]
    top_k: usize,
    /// Experts E (a multiple of the number of ranks).
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Transports (repeatable): `nvlink` (stores into peer-mapped memory) or `nccl` (grouped
    /// send/recv); default both.
    #[arg(long = "transport")]
    transports: Vec<Transport>,
    /// Dispatch wire formats (repeatable); default native and fp8-block128.
    #[arg(long = "wire", value_enum)]
    wires: Vec<Wire>,
    /// Untimed steps.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Paths (repeatable): `kernels` (the transports driven directly) or `evaluator` (the
    /// lowered program's instructions run by the evaluator); default both.
    #[arg(long = "path", value_enum)]
    paths: Vec<MoePath>,
    /// Evaluator path: host program steps per timed iteration (times are per step).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// PyTorch baselines (JSON written by `torch_baselines.py`) to print next to ours.
    #[arg(long, value_name = "FILE")]
    torch: Option<PathBuf>,
    /// Also write the results as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// PyTorch's dispatch and combine times for a case, from its baseline JSON.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn torch_figures(json: &str, t: usize, h: usize, k: usize, e: usize) -> Option<(f64, f64)> {
    let key = format!("\"moe_T{t}_H{h}_K{k}_E{e}\"");
    let rest = &json[json.find(&key)? + key.len()..];
    let field = |name: &str| -> Option<f64> {
        let f = format!("\"{name}\"");
        let after = &rest[rest.find(&f)? + f.len()..];
        let after = after.trim_start().strip_prefix(':')?.trim_start();
        let end = after
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e'))
            .unwrap_or(after.len());
        after[..end].parse().ok()
    };
    Some((field("torch_dispatch_us")?, field("torch_combine_us")?))
}

/// The name of a path in the rows and tables.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn path_name(p: MoePath) -> &'static str {
    match p {
        MoePath::Kernels => "kernels",
        MoePath::Evaluator => "evaluator",
    }
}

/// Runs `bench moe`.
#[cfg(not(feature = "cuda"))]
pub fn run(_args: MoeBenchArgs) -> Result<(), CliError> {
    Err(CliError::Usage(
        "this meshflow was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda` to run GPU benchmarks"
            .to_string(),
    ))
}

/// Runs `bench moe`.
#[cfg(feature = "cuda")]
pub fn run(args: MoeBenchArgs) -> Result<(), CliError> {
    use meshflow::kernels::fp8::Fp8Scales;
    use meshflow::kernels::moe::{MoeWire, NcclMoe, NvlinkMoe};
    use meshflow::kernels::Device;
    use meshflow_bench::moe::{measure_moe, moe_table, MoeCase};
    use meshflow_bench::moe_eval::measure_moe_evaluator;
    use meshflow_bench::rows::{moe_row, rows_json};

    use super::common::print_out;

    let err = |e: meshflow::kernels::KernelError| CliError::Usage(format!("bench moe: {e}"));
    let mut devices = Device::all().map_err(err)?;
    if let Some(n) = args.ranks {
        if n == 0 || n > devices.len() {
            return Err(CliError::Usage(format!(
                "--ranks {n}: this machine has {} GPU(s)",
                devices.len()
            )));
        }
        devices.truncate(n);
    }
    if args.experts == 0 || !args.experts.is_multiple_of(devices.len()) {
        return Err(CliError::Usage(format!(
            "--experts {}: must be a positive multiple of the {} ranks",
            args.experts,
            devices.len()
        )));
    }
    let paths: Vec<MoePath> = if args.paths.is_empty() {
        vec![MoePath::Kernels, MoePath::Evaluator]
    } else {
        args.paths.clone()
    };
    let transports: Vec<Transport> = if args.transports.is_empty() {
        vec![Transport::Nvlink, Transport::Nccl]
    } else {
        args.transports.clone()
    };
    if let Some(t) = transports
        .iter()
        .find(|t| !matches!(t, Transport::Nvlink | Transport::Nccl))
    {
        return Err(CliError::Usage(format!(
            "--transport {t}: MoE dispatch and combine run over nvlink or nccl"
        )));
    }
    let torch = match &args.torch {
        Some(path) => Some(
            std::fs::read_to_string(path).map_err(|source| CliError::Read {
                path: path.clone(),
                source,
            })?,
        ),
        None => None,
    };
    let tokens = if args.tokens.is_empty() {
        vec![128, 4096]
    } else {
        args.tokens.clone()
    };
    let wires: Vec<MoeWire> = if args.wires.is_empty() {
        vec![MoeWire::Native, MoeWire::Fp8E4m3(Fp8Scales::Block128)]
    } else {
        args.wires
            .iter()
            .map(|w| match w {
                Wire::Native => MoeWire::Native,
                Wire::Fp8Token => MoeWire::Fp8E4m3(Fp8Scales::PerToken),
                Wire::Fp8Block128 => MoeWire::Fp8E4m3(Fp8Scales::Block128),
            })
            .collect()
    };
    let device = devices
        .first()
        .map_or(String::new(), |d| d.name().to_string());
    let mut all = Vec::new();
    let mut text = String::new();
    for &t in &tokens {
        let torch_us = torch
            .as_deref()
            .and_then(|j| torch_figures(j, t, args.hidden, args.top_k, args.experts));
        for &wire in &wires {
            let case = MoeCase {
                hidden: args.hidden,
                top_k: args.top_k,
                experts: args.experts,
                wire,
                iters: args.iters.max(1),
                warmup: args.warmup,
                ..MoeCase::deepseek(t)
            };
            let mut results = Vec::new();
            let mut paths_of = Vec::new();
            for path in &paths {
                for transport in &transports {
                    // The evaluator over NVLink also runs its steps as CUDA graph replays.
                    let graphs: &[bool] = match (path, transport) {
                        (MoePath::Evaluator, Transport::Nvlink) => &[false, true],
                        _ => &[false],
                    };
                    for &graph in graphs {
                        let r = match (path, transport) {
                            (MoePath::Evaluator, t) => {
                                measure_moe_evaluator(devices.len(), &case, *t, args.steps, graph)
                            }
                            (MoePath::Kernels, Transport::Nvlink) => {
                                measure_moe(&devices, &case, NvlinkMoe::team_with_wire)
                            }
                            (MoePath::Kernels, _) => {
                                measure_moe(&devices, &case, NcclMoe::team_with_wire)
                            }
                        }
                        .map_err(err)?;
                        results.push(r);
                        paths_of.push(*path);
                    }
                }
            }
            text.push_str(&format!(
                "MoE dispatch/combine, {} x {device}, T={t} tokens/rank, H={}, K={}, E={}, bf16, \
                 {} dispatch\n",
                devices.len(),
                args.hidden,
                args.top_k,
                args.experts,
                wire.name()
            ));
            for p in &paths {
                let mine: Vec<_> = results
                    .iter()
                    .zip(&paths_of)
                    .filter(|(_, q)| *q == p)
                    .map(|(r, _)| r.clone())
                    .collect();
                text.push_str(&format!("path: {}\n", path_name(*p)));
                text.push_str(&moe_table(&mine));
            }
            if let Some((d, c)) = torch_us {
                text.push_str(&format!(
                    "torch all_to_all_single (same machine): dispatch {d:.1} us, combine {c:.1} us\n"
                ));
                for (r, path) in results.iter().zip(&paths_of) {
                    text.push_str(&format!(
                        "  {} ({}) vs torch: dispatch {:.2}x faster, combine {:.2}x faster\n",
                        r.label(),
                        path_name(*path),
                        d / r.dispatch_us,
                        c / r.combine_us
                    ));
                }
            }
            text.push('\n');
            all.extend(
                results
                    .into_iter()
                    .zip(paths_of)
                    .map(|(r, path)| (t, r, torch_us, path)),
            );
        }
    }
    print_out(&text)?;
    if let Some(path) = &args.json {
        let rows: Vec<serde_json::Value> = all
            .iter()
            .map(|(t, r, torch_us, p)| {
                let (db, cb) = r.traffic.max_bytes();
                let dtype = match r.wire {
                    MoeWire::Native => r.shape.dtype.name().to_string(),
                    w => w.name().to_string(),
                };
                let extra = serde_json::json!({
                    "wire": r.wire.name(),
                    "hidden": r.shape.hidden,
                    "top_k": r.shape.top_k,
                    "experts": r.shape.experts,
                    "capacity": r.shape.capacity,
                    "dispatch_bytes": db,
                    "combine_bytes": cb,
                    "status_ok": r.status_ok,
                    "graph": r.graph,
                    "step_us": r.step_us,
                    "host_us": r.host_us,
                });
                moe_row(
                    path_name(*p),
                    r.transport,
                    &dtype,
                    r.shape.world,
                    *t,
                    (r.dispatch_us, r.combine_us),
                    (r.dispatch_gbps(), r.combine_gbps()),
                    *torch_us,
                    &device,
                    extra.as_object().cloned().unwrap_or_default(),
                )
            })
            .collect();
        std::fs::write(path, rows_json(&rows)).map_err(|source| {
            CliError::Usage(format!("cannot write `{}`: {source}", path.display()))
        })?;
        print_out(&format!("results written to {}\n", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::torch_figures;

    #[test]
    fn torch_figures_are_read_from_the_baseline_json() {
        let json = r#"{"world": 2, "moe_T128_H7168_K8_E256": {"torch_dispatch_us": 647.5, "torch_combine_us": 84.1, "bytes_per_rank_dispatch": 1}}"#;
        assert_eq!(torch_figures(json, 128, 7168, 8, 256), Some((647.5, 84.1)));
        assert_eq!(torch_figures(json, 4096, 7168, 8, 256), None);
    }
}
