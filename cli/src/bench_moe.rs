//! `meshflow bench moe [--ranks N] [--tokens T]... [--hidden H] [--top-k K] [--experts E]
//! [--transport nccl|nvlink]... [--wire native|fp8-token|fp8-block128]... [--warmup W]
//! [--iters I] [--torch torch.json] [--json FILE]`: MoE dispatch and combine latency of the
//! kernels crate's transports on the GPUs of this machine (one thread per GPU): the NCCL
//! transport (one grouped send/recv of `T`-row blocks per phase, counts on the device) and the
//! NVLink transport (one kernel per phase storing into peer-mapped memory, device-side flags).
//! Each token travels once per destination rank; the weights travel with the dispatch.
//! Reported per case: the median over steps of the slowest rank, in µs, and the busiest rank's
//! deduplicated received bytes over that time in GB/s (DeepEP's way; see
//! `meshflow_kernels::moe::MoeTraffic`). With `--torch`, the PyTorch figures of
//! a baseline script's JSON (`--torch`, see `bench/README.md`) from the same machine are
//! printed next to ours.
//!
//! `--json` writes a list of rows with the keys `path` (`kernels`), `transport`, `dtype` (the
//! element type, or the FP8 wire), `world`, `tokens`, `dispatch_us`, `combine_us`,
//! `dispatch_gbps`, `combine_gbps`, `torch_dispatch_us`, `torch_combine_us` (null without
//! `--torch`), `device`, and also `wire`, `hidden`, `top_k`, `experts`, `capacity`,
//! `dispatch_bytes`, `combine_bytes`, `status_ok`.

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
            let results = transports
                .iter()
                .map(|transport| match transport {
                    Transport::Nvlink => measure_moe(&devices, &case, NvlinkMoe::team_with_wire),
                    _ => measure_moe(&devices, &case, NcclMoe::team_with_wire),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?;
            text.push_str(&format!(
                "MoE dispatch/combine, {} x {device}, T={t} tokens/rank, H={}, K={}, E={}, bf16, \
                 {} dispatch\n",
                devices.len(),
                args.hidden,
                args.top_k,
                args.experts,
                wire.name()
            ));
            text.push_str(&moe_table(&results));
            if let Some((d, c)) = torch_us {
                text.push_str(&format!(
                    "torch all_to_all_single (same machine): dispatch {d:.1} us, combine {c:.1} us\n"
                ));
                for r in &results {
                    text.push_str(&format!(
                        "  {} vs torch: dispatch {:.2}x faster, combine {:.2}x faster\n",
                        r.transport,
                        d / r.dispatch_us,
                        c / r.combine_us
                    ));
                }
            }
            text.push('\n');
            all.extend(results.into_iter().map(|r| (t, r, torch_us)));
        }
    }
    print_out(&text)?;
    if let Some(path) = &args.json {
        let num = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.1}"));
        let rows: Vec<String> = all
            .iter()
            .map(|(t, r, torch_us)| {
                let (db, cb) = r.traffic.max_bytes();
                let dtype = match r.wire {
                    MoeWire::Native => r.shape.dtype.name().to_string(),
                    w => w.name().to_string(),
                };
                format!(
                    "  {{\"path\": \"kernels\", \"transport\": \"{}\", \"dtype\": \"{dtype}\", \
                     \"world\": {}, \"tokens\": {t}, \"dispatch_us\": {:.1}, \"combine_us\": {:.1}, \
                     \"dispatch_gbps\": {:.1}, \"combine_gbps\": {:.1}, \"torch_dispatch_us\": {}, \
                     \"torch_combine_us\": {}, \"device\": \"{device}\", \"wire\": \"{}\", \
                     \"hidden\": {}, \"top_k\": {}, \"experts\": {}, \"capacity\": {}, \
                     \"dispatch_bytes\": {db}, \"combine_bytes\": {cb}, \"status_ok\": {}}}",
                    r.transport,
                    r.shape.world,
                    r.dispatch_us,
                    r.combine_us,
                    r.dispatch_gbps(),
                    r.combine_gbps(),
                    num(torch_us.map(|x| x.0)),
                    num(torch_us.map(|x| x.1)),
                    r.wire.name(),
                    r.shape.hidden,
                    r.shape.top_k,
                    r.shape.experts,
                    r.shape.capacity,
                    r.status_ok
                )
            })
            .collect();
        std::fs::write(path, format!("[\n{}\n]\n", rows.join(",\n"))).map_err(|source| {
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
