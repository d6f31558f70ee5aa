//! `meshflow calibrate`: measures the machine and writes a [`Profile`], the document the
//! schedule search prices plans with (`--profile FILE`, [`Options::profile`]).
//!
//! Every figure comes from a small host program timed on the backend ([`Timer`]): the CPU
//! backend (ranks as threads; wall-clock time of whole runs, so its figures describe the CPU
//! backend, not a GPU) or GPUs (feature `cuda`; device time per step, CUDA events). Measured:
//!
//! - per transport, the time of each collective (`permute`, `broadcast`, `reduce`,
//!   `all_gather`, `reduce_scatter`, `all_reduce`) over message sizes, as `[bytes on the wire
//!   per rank, us]` points (see [`Collective`] for what the bytes are); a collective a
//!   transport cannot move falls back to the first transport;
//! - GEMM times by shape (bf16), and one f32 GEMM's throughput;
//! - per transport, the slowdown of a GEMM while a collective permute runs beside it, the
//!   GEMM launched first (`gemm_first`) and the transfer launched first (`transfer_first`):
//!   `(both − max(alone)) / min(alone)`, clamped to `[0, 1]`;
//! - the launch overhead of one compute op, the overhead of one stream-loop iteration, and
//!   the bandwidth of an element-wise add.
//!
//! Not measured: how much an add slows the GEMM it runs beside (kept from the built-in
//! profile, said in the notes).
//!
//! [`Options::profile`]: meshflow::Options::profile

use std::collections::BTreeMap;

use meshflow::ir::{DType, HostProgram};
use meshflow::passes::profile::{
    transport_key, Collective, GemmCosts, GemmPoint, HostCosts, MemoryCosts, Slowdown,
    TransportCosts, FORMAT,
};
use meshflow::runtime::data::TensorData;
use meshflow::{Profile, Transport};

use crate::programs::{gemm_alone_host, mesh_text, parse};

/// Local tensors by name, per rank.
pub type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

/// Why calibration failed.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// A measurement failed.
    #[error("{what}: {message}")]
    Run {
        /// What was measured.
        what: String,
        /// Why it failed.
        message: String,
    },
    /// Bad options.
    #[error("{0}")]
    Invalid(String),
}

/// Times host programs on one backend.
pub trait Timer {
    /// The number of ranks every program runs on.
    fn world(&self) -> usize;
    /// The transports to measure (`None`: the backend's own, the CPU backend's fabric).
    fn transports(&self) -> Vec<Option<Transport>>;
    /// The time of one run (one step) of `host`, µs: the median over iterations.
    fn time(
        &mut self,
        what: &str,
        host: &HostProgram,
        inputs: PerRank,
        transport: Option<Transport>,
    ) -> Result<f64, CalibrateError>;
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// The profile's name.
    pub name: String,
    /// The device, as the driver names it (or the CPU backend).
    pub device: String,
    /// Whether the figures describe this machine's GPUs (false: the CPU backend's).
    pub gpu: bool,
    /// Message sizes of the collectives, bytes per rank on the wire (approximately: the
    /// tensors are cut to whole bf16 elements and whole rows).
    pub sizes: Vec<u64>,
    /// bf16 GEMMs `(m, n, k)`.
    pub gemms: Vec<(u64, u64, u64)>,
    /// The f32 GEMM whose throughput is measured, `(m, n, k)`.
    pub gemm_f32: (u64, u64, u64),
    /// Elements of the element-wise add that measures memory bandwidth.
    pub add_elements: u64,
    /// Seed of the random inputs.
    pub seed: u64,
}

impl CalibrateOptions {
    /// Sizes for GPUs: 64 KiB to 256 MiB per rank, the committed profiles' GEMMs.
    pub fn gpu(device: &str, world: usize) -> CalibrateOptions {
        let base = Profile::default_builtin();
        let model = meshflow::passes::profile::device_model(device).unwrap_or("gpu".into());
        CalibrateOptions {
            name: format!("{model}x{world}"),
            device: device.to_string(),
            gpu: true,
            sizes: vec![64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20],
            gemms: base.gemm.half.iter().map(|g| (g.m, g.n, g.k)).collect(),
            gemm_f32: (4096, 4096, 4096),
            add_elements: 64 << 20,
            seed: 2024,
        }
    }

    /// Small sizes for the CPU backend (whose GEMMs run on the host's cores).
    pub fn cpu(world: usize) -> CalibrateOptions {
        CalibrateOptions {
            name: format!("cpu-backend-x{world}"),
            device: "meshflow CPU backend (host threads)".into(),
            gpu: false,
            sizes: vec![4 << 10, 64 << 10, 1 << 20],
            gemms: vec![(64, 64, 64), (128, 128, 128), (256, 128, 128)],
            gemm_f32: (128, 128, 128),
            add_elements: 1 << 16,
            seed: 2024,
        }
    }
}

const T: DType = DType::BF16;

/// One collective's host program on `d` ranks with `n` bf16 elements per rank in its message,
/// its inputs' shapes, and the bytes one rank puts on the wire.
fn collective_host(c: Collective, d: usize, n: u64) -> (HostProgram, Vec<(String, Vec<u64>)>, f64) {
    let du = d as u64;
    let mesh = mesh_text(d);
    let team = "team=slice(m0, DIDx)";
    let bytes = (n * 2) as f64;
    let frac = (du - 1) as f64 / du as f64;
    let (ins, outs, op, wire) = match c {
        Collective::Permute => (
            format!("{n}"),
            format!("{n}"),
            format!(
                "collective_permute(a -> b, {team}, send=(my(m0, DIDx) + 1) % {d}, recv=(my(m0, DIDx) + {}) % {d})",
                d - 1
            ),
            bytes,
        ),
        Collective::Broadcast => (
            format!("{n}"),
            format!("{n}"),
            format!("broadcast(a -> b, {team}, root=0)"),
            bytes,
        ),
        Collective::Reduce => (
            format!("{n}"),
            format!("{n}"),
            format!("reduce(a -> b, {team}, root=0, op=sum)"),
            bytes,
        ),
        Collective::AllGather => (
            format!("{n}"),
            format!("{}", n * du),
            format!("all_gather(a -> b, {team})"),
            bytes * du as f64 * frac,
        ),
        Collective::ReduceScatter => (
            format!("{}", n * du),
            format!("{n}"),
            format!("reduce_scatter(a -> b, {team}, op=sum)"),
            bytes * du as f64 * frac,
        ),
        Collective::AllReduce => (
            format!("{n}"),
            format!("{n}"),
            format!("all_reduce(a -> b, {team}, op=sum)"),
            2.0 * bytes * frac,
        ),
    };
    // Only the root of a reduce writes its output: there `b` is a temporary.
    let b = if c == Collective::Reduce {
        format!("  tensor b: bf16[{outs}] on m0\n  allocate b\n")
    } else {
        format!("  out b: bf16[{outs}] on m0\n")
    };
    let host = parse(&format!(
        "host calibrate_{key} {{\n  mesh m0 = {mesh}\n  in a: bf16[{ins}] on m0\n{b}  c0 = {op}\n  wait c0\n}}\n",
        key = c.key()
    ));
    let shape = vec![ins.parse().unwrap_or(n)];
    (host, vec![("a".into(), shape)], wire)
}

/// `count` element-wise adds of `n` elements on the main stream, or (`loop_`) in a stream
/// loop whose iterations alternate between two workers (each writing its own chunk of `c`).
fn adds_host(d: usize, n: u64, count: u64, loop_: bool) -> HostProgram {
    let (out, body) = if loop_ {
        (
            format!(
                "  out c: bf16[{}] on m0\n  tensor c_chunk: bf16[{n}] on m0\n",
                n * count
            ),
            format!(
                "  s0 = get_current_stream\n  for i0 in 0..{count} {{\n    set_current_stream worker(i0 % 2)\n    synchronize s0\n    c_chunk = shard_by_stream(c, axis=0, chunks={count}, index=i0)\n    add(a, b -> c_chunk)\n  }}\n  set_current_stream s0\n  for i1 in 0..2 {{\n    synchronize worker(i1)\n  }}\n"
            ),
        )
    } else {
        (
            format!("  out c: bf16[{n}] on m0\n"),
            "  add(a, b -> c)\n".repeat(count as usize),
        )
    };
    parse(&format!(
        "host calibrate_adds {{\n  mesh m0 = {}\n  in a: bf16[{n}] on m0\n  in b: bf16[{n}] on m0\n{out}{body}}}\n",
        mesh_text(d)
    ))
}

/// A GEMM `y[m, n] = x[m, k] w[n, k]^T` beside a collective permute of `p` elements on a
/// worker stream, the GEMM launched first or (`transfer_first`) after the transfer.
fn beside_host(d: usize, (m, n, k): (u64, u64, u64), p: u64, transfer_first: bool) -> HostProgram {
    let permute = format!(
        "  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % {d}, recv=(my(m0, DIDx) + {}) % {d})\n  wait c0\n",
        d - 1
    );
    let gemm = "  set_current_stream s0\n  linear(x, w -> y)\n";
    let worker = "  set_current_stream worker(0)\n";
    let body = if transfer_first {
        format!("{worker}  synchronize s0\n{permute}{gemm}")
    } else {
        format!("{worker}  synchronize s0\n{gemm}{worker}{permute}  set_current_stream s0\n")
    };
    parse(&format!(
        "host calibrate_beside {{\n  mesh m0 = {}\n  in x: bf16[{m}, {k}] on m0\n  in w: bf16[{n}, {k}] on m0\n  in a: bf16[{p}] on m0\n  out y: bf16[{m}, {n}] on m0\n  out b: bf16[{p}] on m0\n  s0 = get_current_stream\n{body}  synchronize worker(0)\n}}\n",
        mesh_text(d)
    ))
}

/// Random inputs of the given shapes, the same on every rank.
fn inputs(
    world: usize,
    shapes: &[(String, Vec<u64>)],
    dtype: DType,
    seed: u64,
) -> Result<PerRank, CalibrateError> {
    let mut m = BTreeMap::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let t = TensorData::random(dtype, shape, seed ^ i as u64)
            .map_err(|e| CalibrateError::Invalid(e.to_string()))?;
        m.insert(name.clone(), t);
    }
    Ok((0..world).map(|r| (r, m.clone())).collect())
}

fn shapes(list: &[(&str, &[u64])]) -> Vec<(String, Vec<u64>)> {
    list.iter()
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect()
}

/// Measures the machine behind `timer` and returns its profile (checked).
pub fn calibrate(timer: &mut dyn Timer, o: &CalibrateOptions) -> Result<Profile, CalibrateError> {
    let d = timer.world();
    if d < 2 {
        return Err(CalibrateError::Invalid(format!(
            "calibrate needs at least 2 ranks to measure transports ({d} given)"
        )));
    }
    if o.sizes.is_empty() || o.gemms.is_empty() {
        return Err(CalibrateError::Invalid(
            "calibrate needs message sizes and GEMM shapes".into(),
        ));
    }
    let base = Profile::default_builtin();
    let mut notes = vec![if o.gpu {
        format!(
            "Measured by `meshflow calibrate` on {d}x {}: device time per step (CUDA events), the median over iterations, the slowest rank.",
            o.device
        )
    } else {
        format!(
            "Measured by `meshflow calibrate` on the CPU backend ({d} ranks as threads of one process): wall-clock time of whole runs. These are CPU figures, NOT GPU figures: use them to price plans for the CPU backend only."
        )
    }];

    // GEMMs.
    let mut half = Vec::new();
    for &(m, n, k) in &o.gemms {
        let what = format!("GEMM {m}x{n}x{k} bf16");
        let ins = inputs(d, &shapes(&[("a", &[m, k]), ("w", &[n, k])]), T, o.seed)?;
        let us = timer.time(&what, &gemm_alone_host(d, m, k, n, T), ins, None)?;
        tracing::info!("calibrate: {what}: {us:.1} us");
        half.push(GemmPoint { m, n, k, us });
    }
    let (m, n, k) = o.gemm_f32;
    let ins = inputs(
        d,
        &shapes(&[("a", &[m, k]), ("w", &[n, k])]),
        DType::F32,
        o.seed,
    )?;
    let f32_us = timer.time(
        "GEMM f32",
        &gemm_alone_host(d, m, k, n, DType::F32),
        ins,
        None,
    )?;
    let tflops_f32 = 2.0 * (m * n * k) as f64 / f32_us / 1e6;

    // Host overheads and memory bandwidth.
    let tiny = inputs(d, &shapes(&[("a", &[256]), ("b", &[256])]), T, o.seed)?;
    let count = 32;
    let straight = timer.time("adds", &adds_host(d, 256, count, false), tiny.clone(), None)?;
    let looped = timer.time("loop of adds", &adds_host(d, 256, count, true), tiny, None)?;
    let launch_us = (straight / count as f64).max(0.1);
    let loop_step_us = ((looped - straight) / count as f64).max(0.1);
    let e = o.add_elements;
    let big = inputs(d, &shapes(&[("a", &[e]), ("b", &[e])]), T, o.seed)?;
    let add_us = timer.time("large add", &adds_host(d, e, 1, false), big, None)?;
    let hbm_gb_s = (3 * 2 * e) as f64 / add_us / 1e3;

    // Collectives and slowdowns per transport.
    let transports = timer.transports();
    let mut costs = BTreeMap::new();
    let first_key = transport_key(
        transports
            .first()
            .copied()
            .flatten()
            .unwrap_or(Transport::Nccl),
    );
    let mut failures = Vec::new();
    for t in transports {
        let key = transport_key(t.unwrap_or(Transport::Nccl));
        let mut collectives = BTreeMap::new();
        for c in Collective::ALL {
            let mut points = Vec::new();
            for &size in &o.sizes {
                let n = (size / 2).div_ceil(d as u64).max(1) * d as u64;
                let (host, shapes, wire) = collective_host(c, d, n);
                let what = format!("{key} {} of {n} bf16", c.key());
                let ins = inputs(d, &shapes, T, o.seed)?;
                match timer.time(&what, &host, ins, t) {
                    Ok(us) => {
                        tracing::info!("calibrate: {what}: {us:.1} us");
                        points.push((wire, us));
                    }
                    Err(e) => {
                        tracing::warn!("calibrate: {e}");
                        failures.push(e.to_string());
                        break;
                    }
                }
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            points.dedup_by(|a, b| a.0 <= b.0);
            if !points.is_empty() {
                collectives.insert(c.key().to_string(), points);
            }
        }
        if collectives.is_empty() {
            notes.push(format!("{key}: no collective ran; left out"));
            continue;
        }
        let gemm_slowdown = slowdown(timer, o, d, &half, collectives.get("permute"), t)?;
        let missing: Vec<&str> = Collective::PRICED
            .iter()
            .map(|c| c.key())
            .filter(|c| !collectives.contains_key(*c))
            .collect();
        let falls_back_to = (key != first_key && !missing.is_empty()).then(|| {
            notes.push(format!(
                "{key} does not move {}: those go over {first_key}",
                missing.join(", ")
            ));
            first_key.to_string()
        });
        costs.insert(
            key.to_string(),
            TransportCosts {
                falls_back_to,
                gemm_slowdown,
                gemm_overlap: 0.0,
                collectives,
            },
        );
    }
    notes.push(
        "memory.concurrent_add_slowdown: not measured, kept from the built-in profile.".into(),
    );
    notes.push(
        "gemm_overlap: not measured (0: GEMMs on different worker streams run one after the \
         other); fit it to the per-iteration rows of `meshflow bench schedule` (docs/schedule-search.md)."
            .into(),
    );
    let mut profile = Profile {
        format: FORMAT,
        name: o.name.clone(),
        device: o.device.clone(),
        world: d as u64,
        provisional: !o.gpu,
        notes,
        host: HostCosts {
            launch_us,
            loop_step_us,
        },
        memory: MemoryCosts {
            hbm_gb_s,
            concurrent_add_slowdown: base.memory.concurrent_add_slowdown,
        },
        gemm: GemmCosts { half, tflops_f32 },
        transports: costs,
    };
    tidy(&mut profile);
    profile.check().map_err(|e| CalibrateError::Run {
        what: "the measured profile".into(),
        message: format!("{e} (failed measurements: {})", failures.join("; ")),
    })?;
    Ok(profile)
}

/// `x` to 7 significant digits (what the JSON keeps exactly).
fn sig7(x: f64) -> f64 {
    format!("{x:.6e}").parse().unwrap_or(x)
}

/// Every figure of `p` to 7 significant digits, so that the written profile reads back equal.
fn tidy(p: &mut Profile) {
    p.host.launch_us = sig7(p.host.launch_us);
    p.host.loop_step_us = sig7(p.host.loop_step_us);
    p.memory.hbm_gb_s = sig7(p.memory.hbm_gb_s);
    p.gemm.tflops_f32 = sig7(p.gemm.tflops_f32);
    for g in &mut p.gemm.half {
        g.us = sig7(g.us);
    }
    for t in p.transports.values_mut() {
        t.gemm_slowdown.gemm_first = sig7(t.gemm_slowdown.gemm_first);
        t.gemm_slowdown.transfer_first = sig7(t.gemm_slowdown.transfer_first);
        for points in t.collectives.values_mut() {
            for (b, us) in points.iter_mut() {
                *b = sig7(*b);
                *us = sig7(*us);
            }
        }
    }
}

/// The GEMM slowdown beside a permute over `t`: the largest GEMM measured, beside the permute
/// whose time alone is nearest half the GEMM's.
fn slowdown(
    timer: &mut dyn Timer,
    o: &CalibrateOptions,
    d: usize,
    half: &[GemmPoint],
    permute: Option<&Vec<(f64, f64)>>,
    t: Option<Transport>,
) -> Result<Slowdown, CalibrateError> {
    let (Some(g), Some(points)) = (half.iter().max_by(|a, b| a.us.total_cmp(&b.us)), permute)
    else {
        return Ok(Slowdown {
            gemm_first: 0.0,
            transfer_first: 0.0,
        });
    };
    let Some(&(bytes, comm_us)) = points.iter().min_by(|a, b| {
        (a.1 - g.us / 2.0)
            .abs()
            .total_cmp(&(b.1 - g.us / 2.0).abs())
    }) else {
        return Ok(Slowdown {
            gemm_first: 0.0,
            transfer_first: 0.0,
        });
    };
    let p = ((bytes / 2.0) as u64).max(1);
    let mut fraction = |transfer_first: bool| -> Result<f64, CalibrateError> {
        let ins = inputs(
            d,
            &shapes(&[("x", &[g.m, g.k]), ("w", &[g.n, g.k]), ("a", &[p])]),
            T,
            o.seed,
        )?;
        let what = format!(
            "GEMM {}x{}x{} beside a permute of {p} bf16 ({})",
            g.m,
            g.n,
            g.k,
            if transfer_first {
                "transfer first"
            } else {
                "GEMM first"
            }
        );
        let both = timer.time(
            &what,
            &beside_host(d, (g.m, g.n, g.k), p, transfer_first),
            ins,
            t,
        )?;
        let f = (both - g.us.max(comm_us)) / g.us.min(comm_us).max(f64::MIN_POSITIVE);
        tracing::info!("calibrate: {what}: {both:.1} us, slowdown {f:.2}");
        Ok(f.clamp(0.0, 1.0))
    };
    Ok(Slowdown {
        gemm_first: fraction(false)?,
        transfer_first: fraction(true)?,
    })
}

/// Times host programs on the CPU backend: the median wall-clock time of whole runs.
pub struct CpuTimer {
    /// Ranks (threads).
    pub world: usize,
    /// Untimed runs first.
    pub warmup: usize,
    /// Timed runs.
    pub iterations: usize,
}

impl Timer for CpuTimer {
    fn world(&self) -> usize {
        self.world
    }

    fn transports(&self) -> Vec<Option<Transport>> {
        vec![None]
    }

    fn time(
        &mut self,
        what: &str,
        host: &HostProgram,
        inputs: PerRank,
        _transport: Option<Transport>,
    ) -> Result<f64, CalibrateError> {
        use meshflow::runtime::{run_cpu, CpuOptions, RunInputs};
        let options = CpuOptions {
            ranks: Some(self.world),
            ..CpuOptions::default()
        };
        let mut times = Vec::new();
        for i in 0..self.warmup + self.iterations.max(1) {
            let run = run_cpu(host, RunInputs::PerRank(inputs.clone()), &options).map_err(|e| {
                CalibrateError::Run {
                    what: what.to_string(),
                    message: e.to_string(),
                }
            })?;
            if i >= self.warmup {
                times.push(run.elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok(crate::stats::median(&times).max(0.01))
    }
}

/// Times host programs on the GPUs of this process (one thread per GPU, feature `cuda`):
/// device time per step of `steps` steps back to back (CUDA events), the median over
/// iterations per rank, then the slowest rank.
#[cfg(feature = "cuda")]
pub struct GpuTimer {
    /// Ranks (GPUs).
    pub world: usize,
    /// Untimed runs first.
    pub warmup: usize,
    /// Timed runs.
    pub iterations: usize,
    /// Steps per run.
    pub steps: usize,
}

#[cfg(feature = "cuda")]
impl Timer for GpuTimer {
    fn world(&self) -> usize {
        self.world
    }

    fn transports(&self) -> Vec<Option<Transport>> {
        vec![Some(Transport::Nccl), Some(Transport::CopyEngine)]
    }

    fn time(
        &mut self,
        what: &str,
        host: &HostProgram,
        inputs: PerRank,
        transport: Option<Transport>,
    ) -> Result<f64, CalibrateError> {
        use meshflow::runtime::cuda::{run_cuda_timed, CudaConfig, CudaOptions};
        use meshflow::runtime::RunInputs;
        let options = CudaOptions {
            ranks: Some(self.world),
            config: CudaConfig {
                transport,
                steps: self.steps.max(1),
                timeout: std::time::Duration::from_secs(120),
                ..CudaConfig::default()
            },
        };
        let run = run_cuda_timed(
            host,
            RunInputs::PerRank(inputs),
            &options,
            self.warmup,
            self.iterations.max(1),
        )
        .map_err(|e| CalibrateError::Run {
            what: what.to_string(),
            message: e.to_string(),
        })?;
        let us = crate::stats::Timing::from_times(&run.times_us).us;
        if us.is_finite() && us > 0.0 {
            Ok(us)
        } else {
            Err(CalibrateError::Run {
                what: what.to_string(),
                message: "no device time was recorded".into(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_backend_calibrates_to_a_profile_the_search_reads() {
        let mut timer = CpuTimer {
            world: 2,
            warmup: 0,
            iterations: 1,
        };
        let o = CalibrateOptions {
            sizes: vec![1 << 10, 8 << 10],
            gemms: vec![(16, 16, 16), (32, 16, 16)],
            gemm_f32: (16, 16, 16),
            add_elements: 1 << 10,
            ..CalibrateOptions::cpu(2)
        };
        let p = calibrate(&mut timer, &o).unwrap();
        assert!(p.provisional, "CPU figures are not GPU figures");
        assert!(p.notes[0].contains("NOT GPU figures"), "{:?}", p.notes);
        let back = Profile::from_json(&p.to_json()).unwrap();
        assert_eq!(back, p);
        let nccl = &p.transports["nccl"];
        for c in Collective::ALL {
            let points = &nccl.collectives[c.key()];
            assert_eq!(points.len(), 2, "{}", c.key());
        }
        // The wire bytes follow the collective's definition: 2 ranks, 1 KiB messages.
        assert_eq!(nccl.collectives["permute"][0].0, 1024.0);
        assert_eq!(nccl.collectives["all_gather"][0].0, 1024.0);
        assert_eq!(nccl.collectives["all_reduce"][0].0, 1024.0);
        assert_eq!(p.gemm.half.len(), 2);
        // The profile prices plans: a program compiles with it.
        let options = meshflow::Options::new().profile(p);
        let program = crate::programs::rsmm_searched_program(
            2,
            crate::programs::Gemm3 { m: 8, k: 8, n: 8 },
            DType::F32,
        );
        meshflow::compile(&program, &options).unwrap();
    }

    #[test]
    fn one_rank_is_refused() {
        let mut timer = CpuTimer {
            world: 1,
            warmup: 0,
            iterations: 1,
        };
        let e = calibrate(&mut timer, &CalibrateOptions::cpu(1)).unwrap_err();
        assert!(e.to_string().contains("at least 2 ranks"), "{e}");
    }
}
