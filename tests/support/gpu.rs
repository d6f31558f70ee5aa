//! Helpers shared by the GPU tests: GPU counts and honest skips,
//! options (the runs of the MoE tests among them), host-text templates, and CPU-vs-GPU
//! comparisons.

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow::ir::{parse_host, DType, HostProgram};
use meshflow::runtime::cuda::{device_count, run_cuda, CudaConfig, CudaOptions, Transport};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_cpu, CpuConfig, CpuOptions, RunInputs, RunOutcome};

/// Number of GPUs, or why there are none.
pub fn gpus() -> Result<usize, String> {
    device_count().map_err(|e| e.to_string())
}

/// True (after printing `skipped: <why>` to stderr) when fewer than `n` GPUs are present.
pub fn skip_unless(n: usize, test: &str) -> bool {
    match gpus() {
        Ok(have) if have >= n => false,
        Ok(have) => {
            eprintln!("skipped: {test} needs {n} GPUs, this machine has {have}");
            true
        }
        Err(why) => {
            eprintln!("skipped: {test} needs {n} GPU(s): {why}");
            true
        }
    }
}

/// The rank counts to try: 1, 2 and 4, those the machine has.
pub fn rank_counts(test: &str) -> Vec<usize> {
    let have = gpus().unwrap_or(0);
    let all = [1usize, 2, 4];
    let skipped: Vec<usize> = all.iter().copied().filter(|&d| d > have).collect();
    if !skipped.is_empty() {
        eprintln!("skipped: {test} on {skipped:?} GPUs (this machine has {have})");
    }
    all.into_iter().filter(|&d| d <= have).collect()
}

/// Options for correctness runs.
pub fn cuda_options() -> CudaOptions {
    CudaOptions {
        ranks: None,
        config: CudaConfig {
            timeout: Duration::from_secs(60),
            ..CudaConfig::default()
        },
    }
}

/// The runs of the GPU MoE tests on `d` GPUs, as (transport forced, step recorded as a CUDA
/// graph): the automatic choice (NVLink for `d >= 2`), NCCL, and NVLink replayed from a graph;
/// on one GPU the automatic choice alone.
pub fn moe_runs(d: usize) -> &'static [(Option<Transport>, bool)] {
    if d >= 2 {
        &[(None, false), (Some(Transport::Nccl), false), (None, true)]
    } else {
        &[(None, false)]
    }
}

/// Options of one of the [`moe_runs`] on `d` GPUs (a graph run replays its step: two steps).
pub fn moe_run_options(d: usize, forced: Option<Transport>, graph: bool) -> CudaOptions {
    let mut o = cuda_options();
    o.ranks = Some(d);
    o.config.transport = forced;
    o.config.graph = graph;
    o.config.steps = if graph { 2 } else { 1 };
    o
}

/// `host` run on `d` CPU ranks with `inputs` (the reference of a GPU run); a failure panics
/// naming `label`.
pub fn run_on_cpu_ranks(
    host: &HostProgram,
    d: usize,
    inputs: BTreeMap<usize, BTreeMap<String, TensorData>>,
    label: &str,
) -> RunOutcome {
    let mut co = cpu_options();
    co.ranks = Some(d);
    run_cpu(host, RunInputs::PerRank(inputs), &co)
        .unwrap_or_else(|e| panic!("{label} on CPU ranks: {e}"))
}

/// CPU options (the reference implementation).
pub fn cpu_options() -> CpuOptions {
    CpuOptions {
        ranks: None,
        config: CpuConfig {
            timeout: Duration::from_secs(10),
            ..CpuConfig::default()
        },
        trace: false,
    }
}

/// Parses host text after replacing every `$key` (longest keys first).
pub fn host(template: &str, vars: &[(&str, String)]) -> HostProgram {
    let mut vars = vars.to_vec();
    vars.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
    let mut text = template.to_string();
    for (k, v) in vars {
        text = text.replace(&format!("${k}"), &v);
    }
    parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// `[0, 1, .., d-1]`.
pub fn iota(d: usize) -> String {
    let v: Vec<String> = (0..d).map(|i| i.to_string()).collect();
    format!("[{}]", v.join(", "))
}

/// The tolerance of a comparison: f32 1e-5, bf16/f16 1e-2, integers exact.
pub fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::BF16 | DType::F16 => 1e-2,
        DType::I32 | DType::I64 => 0.0,
    }
}

/// Seeded random inputs per rank for every `in` tensor of `host`.
pub fn per_rank_inputs(
    host: &HostProgram,
    d: usize,
    seed: u64,
) -> BTreeMap<usize, BTreeMap<String, TensorData>> {
    (0..d)
        .map(|r| {
            let m = host
                .tensors
                .iter()
                .filter(|(_, t)| t.role == meshflow::ir::Role::Input)
                .enumerate()
                .map(|(i, (_, t))| {
                    let s = seed + 1000 * r as u64 + i as u64;
                    (
                        t.name.clone(),
                        TensorData::random(t.dtype, &t.shape, s).unwrap(),
                    )
                })
                .collect();
            (r, m)
        })
        .collect()
}

/// Runs `host` on `d` CPU ranks and on `d` GPUs with the same per-rank inputs and checks every
/// output of every rank (relative error within the dtype's tolerance). Returns the worst error.
pub fn cpu_vs_cuda(
    name: &str,
    host: &HostProgram,
    d: usize,
    inputs: BTreeMap<usize, BTreeMap<String, TensorData>>,
) -> f64 {
    cpu_vs_cuda_on(name, host, d, inputs, &|_| true)
}

/// [`cpu_vs_cuda`] checking only the outputs of the ranks `written` selects (rooted
/// collectives leave the others' outputs unwritten by design; the CPU backend's check for unwritten
/// outputs is then off).
pub fn cpu_vs_cuda_on(
    name: &str,
    host: &HostProgram,
    d: usize,
    inputs: BTreeMap<usize, BTreeMap<String, TensorData>>,
    written: &dyn Fn(usize) -> bool,
) -> f64 {
    cpu_vs_cuda_with(name, host, d, inputs, written, &cuda_options().config)
}

/// [`cpu_vs_cuda_on`] with the GPU run's backend settings (transport, copy stream, steps).
pub fn cpu_vs_cuda_with(
    name: &str,
    host: &HostProgram,
    d: usize,
    inputs: BTreeMap<usize, BTreeMap<String, TensorData>>,
    written: &dyn Fn(usize) -> bool,
    config: &CudaConfig,
) -> f64 {
    let mut so = cpu_options();
    so.ranks = Some(d);
    so.config.poison = (0..d).all(written);
    let want = run_cpu(host, RunInputs::PerRank(inputs.clone()), &so)
        .unwrap_or_else(|e| panic!("{name} on {d} CPU ranks: {e}"));
    let mut co = cuda_options();
    co.ranks = Some(d);
    co.config = config.clone();
    let got = run_cuda(host, RunInputs::PerRank(inputs), &co)
        .unwrap_or_else(|e| panic!("{name} on {d} GPUs: {e}"));
    let mut worst = 0f64;
    for (rank, outs) in want.outputs.iter().filter(|(r, _)| written(**r)) {
        for (t, w) in outs {
            let g = got
                .outputs
                .get(rank)
                .and_then(|o| o.get(t))
                .unwrap_or_else(|| panic!("{name}: rank {rank} has no output {t} on the GPU"));
            let err = g
                .rel_error(w)
                .unwrap_or_else(|e| panic!("{name}: rank {rank} output {t}: {e}"));
            assert!(
                err <= tol(w.dtype()),
                "{name} on {d} GPUs: rank {rank} output {t}: rel err {err:.3e} > {:.0e}",
                tol(w.dtype())
            );
            worst = worst.max(err);
        }
    }
    worst
}
