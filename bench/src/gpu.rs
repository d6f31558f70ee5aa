//! Measuring the benchmark cases on GPUs (feature `cuda`).

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow::ir::{DType, HostProgram, Program};

use crate::programs::permute_host;
use crate::programs::{
    agmm_lowered_over, default_lowered, gemm_alone_host, rs_alone_host, rsmm_lowered_over,
    rsmm_program, AgVariant, Gemm3, Lowered, Parts, RsVariant,
};
use crate::stats::{CaseResult, PermuteResult, Timing, VariantResult};
use crate::torch::TorchBaselines;
use meshflow::runtime::cuda::{
    device_count, run_cuda_timed, CopyStream, CudaConfig, CudaOptions, CudaRunError, Transport,
};
use meshflow::runtime::data::{SplitMix64, TensorData};
use meshflow::runtime::rendezvous::TorchrunEnv;
use meshflow::runtime::shard::{scatter_inputs, ShardError};
use meshflow::runtime::RunInputs;

use crate::launched::Launched;

/// Why a benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A GPU run failed.
    #[error("{what}: {source}")]
    Run {
        /// The program.
        what: String,
        /// Why.
        source: CudaRunError,
    },
    /// Inputs or outputs could not be cut or assembled.
    #[error("{what}: {source}")]
    Shard {
        /// The program.
        what: String,
        /// Why.
        source: ShardError,
    },
    /// Bad options or data.
    #[error("{0}")]
    Invalid(String),
    /// A program could not be lowered.
    #[error("{what}: {source}")]
    Lower {
        /// The program.
        what: String,
        /// Why.
        source: Box<meshflow::Error>,
    },
    /// A variant's sampled outputs differ from the reference.
    #[error("{variant}: sampled outputs differ from the reference (rel err {error:.3e} > 1e-2)")]
    Wrong {
        /// The variant.
        variant: String,
        /// The relative error.
        error: f64,
    },
}

/// Options of `meshflow bench`.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Ranks (GPUs); default: every GPU.
    pub ranks: Option<usize>,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Timed iterations (at least 1).
    pub iterations: usize,
    /// Host program steps per iteration, run back to back on warm GPUs (the time of an
    /// iteration is divided by it).
    pub steps: usize,
    /// Also time graph-recorded variants (one step recorded as a CUDA graph, replayed `steps`
    /// times; NCCL transport).
    pub graph: bool,
    /// Time only the graph-recorded variants (with the parts alone).
    pub graph_only: bool,
    /// The cases.
    pub shapes: Vec<Gemm3>,
    /// Worker streams.
    pub stream_pool: usize,
    /// Seed of the random inputs.
    pub seed: u64,
    /// PyTorch's figures from the same machine (ratios in the tables).
    pub torch: Option<TorchBaselines>,
    /// Sizes of `bench permute`, MiB per rank.
    pub permute_mib: Vec<u64>,
    /// Write profiled traces (Perfetto JSON and SVG timelines) of the AG+GEMM ring variants
    /// (ring, ring forward, bidirectional ring) here (in-process runs only).
    pub trace_dir: Option<std::path::PathBuf>,
    /// This process is one rank of a run started by `meshflow launch` (one process per GPU):
    /// its torchrun variables. Every process then runs the same benchmark, its own rank of
    /// each program; the ranks meet through the rendezvous, and rank 0 gets every figure.
    pub launched: Option<TorchrunEnv>,
    /// Also time each ring's communications alone and its compute alone (the `parts` of the
    /// tables; the bound needs only the collective and the GEMM alone).
    pub parts: bool,
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            ranks: None,
            warmup: 3,
            iterations: 10,
            steps: 10,
            graph: false,
            graph_only: false,
            shapes: vec![
                Gemm3 {
                    m: 16384,
                    k: 8192,
                    n: 8192,
                },
                Gemm3 {
                    m: 8192,
                    k: 8192,
                    n: 8192,
                },
            ],
            stream_pool: 2,
            seed: 2024,
            torch: None,
            permute_mib: vec![64, 256],
            trace_dir: None,
            launched: None,
            parts: true,
        }
    }
}

const DTYPE: DType = DType::BF16;
/// Row pieces per step of the GEMM+RS ring variant whose adds run under the next GEMM piece.
const RING_PIECES: u64 = 4;

/// How one variant runs on the backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Setup {
    transport: Transport,
    copy_stream: CopyStream,
    graph: bool,
}

const NCCL: Setup = Setup {
    transport: Transport::Nccl,
    copy_stream: CopyStream::Current,
    graph: false,
};
const CE: Setup = Setup {
    transport: Transport::CopyEngine,
    copy_stream: CopyStream::Current,
    graph: false,
};
const CE_COPY_STREAM: Setup = Setup {
    transport: Transport::CopyEngine,
    copy_stream: CopyStream::Dedicated,
    graph: false,
};
const NCCL_GRAPH: Setup = Setup {
    transport: Transport::Nccl,
    copy_stream: CopyStream::Current,
    graph: true,
};

struct Runner {
    opts: BenchOptions,
    world: usize,
    cuda: CudaOptions,
    /// One process per GPU: this rank's rendezvous.
    launched: Option<std::sync::Arc<Launched>>,
}

type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

/// A timed variant: device time, host time per step, last outputs.
struct Measured {
    timing: Timing,
    host_us: Option<f64>,
    outcome: meshflow::runtime::RunOutcome,
}

impl Runner {
    fn new(opts: &BenchOptions) -> Result<Runner, BenchError> {
        let timeout = Duration::from_secs(300);
        let launched = match &opts.launched {
            Some(env) => Some(Launched::connect(env, timeout)?),
            None => None,
        };
        let have = match &launched {
            Some(l) => l.world(),
            None => device_count().map_err(|source| BenchError::Run {
                what: "counting GPUs".into(),
                source,
            })?,
        };
        if let (Some(l), Some(n)) = (&launched, opts.ranks) {
            if n != l.world() {
                return Err(BenchError::Invalid(format!(
                    "--ranks {n}: this run was launched with {} processes (one rank each)",
                    l.world()
                )));
            }
        }
        let world = opts.ranks.unwrap_or(have);
        if world == 0 || opts.iterations == 0 {
            return Err(BenchError::Invalid(
                "need at least one rank and one iteration".into(),
            ));
        }
        Ok(Runner {
            opts: opts.clone(),
            world,
            cuda: CudaOptions {
                ranks: Some(world),
                config: CudaConfig {
                    stream_pool: opts.stream_pool.max(1),
                    timeout,
                    steps: opts.steps.max(1),
                    ..CudaConfig::default()
                },
            },
            launched,
        })
    }

    fn device_name(&self) -> String {
        let ordinal = self.launched.as_ref().map_or(0, |l| l.local_rank());
        meshflow::kernels::Device::name_of(ordinal).unwrap_or_else(|e| format!("unknown GPU ({e})"))
    }

    /// Times `host` with per-rank inputs on the backend set up as `setup`.
    fn time(
        &self,
        what: &str,
        host: &HostProgram,
        inputs: PerRank,
        setup: Setup,
    ) -> Result<Measured, BenchError> {
        tracing::info!("bench: {what}");
        let mut cuda = self.cuda.clone();
        cuda.config.transport = Some(setup.transport);
        cuda.config.copy_stream = setup.copy_stream;
        cuda.config.graph = setup.graph;
        if let Some(l) = &self.launched {
            let run = l.time(
                what,
                host,
                &inputs,
                &cuda.config,
                self.opts.warmup,
                self.opts.iterations,
            )?;
            return Ok(Measured {
                timing: Timing::from_times(&run.times_us),
                host_us: None,
                outcome: run.outcome,
            });
        }
        let run = run_cuda_timed(
            host,
            RunInputs::PerRank(inputs),
            &cuda,
            self.opts.warmup,
            self.opts.iterations,
        )
        .map_err(|source| BenchError::Run {
            what: what.to_owned(),
            source,
        })?;
        let host_us = Timing::from_times(&run.host_us).us;
        Ok(Measured {
            timing: Timing::from_times(&run.times_us),
            host_us: host_us.is_finite().then_some(host_us),
            outcome: run.outcome,
        })
    }

    /// The sampled relative error of output `out` of a measured run (see [`sampled_error`]).
    /// With one process per GPU only rank 0 holds every rank's outputs and checks them; the
    /// other ranks report nothing, and this returns 0 for them without a check.
    #[allow(clippy::too_many_arguments)]
    fn output_error(
        &self,
        what: &str,
        m: &Measured,
        program: &Program,
        full: &BTreeMap<String, TensorData>,
        out: &str,
        s: Gemm3,
        seed: u64,
    ) -> Result<f64, BenchError> {
        if self.launched.as_ref().is_some_and(|l| l.rank() != 0) {
            return Ok(0.0);
        }
        let got = m
            .outcome
            .gather(program)
            .map_err(|source| BenchError::Shard {
                what: what.to_owned(),
                source,
            })?;
        Ok(sampled_error(full, &got[out], s, seed))
    }

    /// One profiled step of `host` (after two warm-up runs), written as `dir/name.json` and
    /// `dir/name.svg`.
    fn trace(
        &self,
        dir: &std::path::Path,
        name: &str,
        host: &HostProgram,
        inputs: PerRank,
        setup: Setup,
    ) -> Result<(), BenchError> {
        if self.launched.is_some() {
            return Err(BenchError::Invalid(format!(
                "trace of {name}: traces are recorded in-process only (run without `meshflow launch`)"
            )));
        }
        let mut cuda = self.cuda.clone();
        cuda.config.transport = Some(setup.transport);
        cuda.config.copy_stream = setup.copy_stream;
        cuda.config.profile = true;
        cuda.config.steps = 1;
        let run =
            run_cuda_timed(host, RunInputs::PerRank(inputs), &cuda, 2, 1).map_err(|source| {
                BenchError::Run {
                    what: format!("trace of {name}"),
                    source,
                }
            })?;
        let trace = run.outcome.trace.unwrap_or_default();
        let io = |e: std::io::Error| BenchError::Invalid(format!("writing the trace {name}: {e}"));
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::write(dir.join(format!("{name}.json")), trace.to_json()).map_err(io)?;
        std::fs::write(
            dir.join(format!("{name}.svg")),
            trace.to_svg(name, Some(self.opts.stream_pool.max(1))),
        )
        .map_err(io)?;
        Ok(())
    }

    /// The same random tensor on every rank.
    fn replicated(&self, entries: &[(&str, &[u64], u64)]) -> Result<PerRank, BenchError> {
        let mut m = BTreeMap::new();
        for (name, shape, seed) in entries {
            let t = TensorData::random(DTYPE, shape, self.opts.seed ^ seed)
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            m.insert(name.to_string(), t);
        }
        Ok((0..self.world).map(|r| (r, m.clone())).collect())
    }

    fn scatter(
        &self,
        what: &str,
        l1: &Program,
        full: &BTreeMap<String, TensorData>,
    ) -> Result<PerRank, BenchError> {
        scatter_inputs(l1, full).map_err(|source| BenchError::Shard {
            what: what.to_owned(),
            source,
        })
    }
}

/// Random full inputs `x[M, K]`, `w[N, K]`.
fn full_inputs(s: Gemm3, seed: u64) -> Result<BTreeMap<String, TensorData>, BenchError> {
    let bad = |e: meshflow::runtime::data::DataError| BenchError::Invalid(e.to_string());
    Ok(BTreeMap::from([
        (
            "x".to_string(),
            TensorData::random(DTYPE, &[s.m, s.k], seed).map_err(bad)?,
        ),
        (
            "w".to_string(),
            TensorData::random(DTYPE, &[s.n, s.k], seed + 1).map_err(bad)?,
        ),
    ]))
}

/// Relative error of 256 sampled elements of `out = x @ w^T` against an f32 CPU reference.
fn sampled_error(
    full: &BTreeMap<String, TensorData>,
    out: &TensorData,
    s: Gemm3,
    seed: u64,
) -> f64 {
    let (x, w) = (&full["x"], &full["w"]);
    let (k, n) = (s.k as usize, s.n as usize);
    let mut rng = SplitMix64::new(seed);
    let (mut num, mut den) = (0f64, 0f64);
    for _ in 0..256 {
        let i = rng.below(s.m) as usize;
        let j = rng.below(s.n) as usize;
        let mut acc = 0f64;
        for kk in 0..k {
            let a = x.storage().get_f32(i * k + kk).unwrap_or(f32::NAN);
            let b = w.storage().get_f32(j * k + kk).unwrap_or(f32::NAN);
            acc += f64::from(a) * f64::from(b);
        }
        let got = f64::from(out.storage().get_f32(i * n + j).unwrap_or(f32::NAN));
        num += (got - acc) * (got - acc);
        den += acc * acc;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// A variant's result; a failed run or wrong outputs give a failed entry (NaN time, the
/// reason in its `failure`) so that the other variants are still measured.
fn variant_result(
    name: String,
    measured: Result<(Measured, f64), BenchError>,
    bound: f64,
) -> VariantResult {
    if let Ok((m, err)) = &measured {
        tracing::info!(
            "bench: {name}: {:.1} µs per step ({:.2} of the bound), host {:?} µs/step, rel err {err:.2e}",
            m.timing.us,
            m.timing.us / bound,
            m.host_us
        );
    }
    match measured {
        Ok((m, err)) if !err.is_nan() && err <= 1e-2 => VariantResult {
            ratio_to_bound: m.timing.us / bound,
            name,
            timing: m.timing,
            sampled_rel_err: err,
            host_us: m.host_us,
            failure: None,
        },
        Ok((_, err)) => failed(
            name.clone(),
            BenchError::Wrong {
                variant: name,
                error: err,
            },
        ),
        Err(e) => failed(name, e),
    }
}

fn failed(name: String, e: BenchError) -> VariantResult {
    tracing::warn!("bench variant `{name}` failed: {e}");
    VariantResult {
        name,
        timing: Timing::from_times(&[]),
        ratio_to_bound: f64::NAN,
        sampled_rel_err: f64::NAN,
        host_us: None,
        failure: Some(e.to_string()),
    }
}

/// The default lowering (no options: the schedule search's plan, over the transport it
/// planned for) of an AG+GEMM or (`rsmm`) GEMM+RS case, named `default: <plan>`.
fn default_variant(
    r: &Runner,
    tag: &str,
    s: Gemm3,
    full: &BTreeMap<String, TensorData>,
    per_rank: PerRank,
    bound: f64,
    rsmm: bool,
) -> VariantResult {
    let lowered = default_lowered(r.world, s, DTYPE, rsmm, r.opts.stream_pool);
    let (name, measured) = match lowered {
        Err(source) => (
            "default".to_string(),
            Err(BenchError::Lower {
                what: format!("{tag}: default"),
                source: Box::new(source),
            }),
        ),
        Ok((l, transport, plan)) => {
            let setup = match transport {
                Some(meshflow::Transport::Nccl) => NCCL,
                _ => CE,
            };
            let name = format!("default: {plan}");
            let what = format!("{tag}: {name}");
            let out = if rsmm { "z" } else { "y" };
            let seed = r.opts.seed ^ if rsmm { 9 } else { 7 };
            let measured = r.time(&what, &l.host, per_rank, setup).and_then(|m| {
                let err = r.output_error(&what, &m, &l.program, full, out, s, seed)?;
                Ok((m, err))
            });
            (name, measured)
        }
    };
    variant_result(name, measured, bound)
}

/// The rings whose permutes and chunk GEMMs are also timed alone: variant and name prefix.
const AG_RINGS: [(AgVariant, &str); 3] = [
    (AgVariant::Ring, "ring"),
    (AgVariant::RingForward, "ring forward"),
    (AgVariant::RingBidirectional, "bidirectional ring"),
];

/// Whether AG+GEMM `variant` can run `s` on `d` ranks (the bidirectional ring halves the
/// chunks of `M`).
fn ag_fits(variant: AgVariant, s: Gemm3, d: usize) -> bool {
    match variant {
        AgVariant::Collective => true,
        _ if d == 1 => false,
        AgVariant::RingBidirectional => s.m.is_multiple_of(2 * d as u64),
        _ => true,
    }
}

/// The AG+GEMM variants: schedule, backend setup, name.
fn ag_variants(graph: bool, graph_only: bool) -> Vec<(AgVariant, Setup, &'static str)> {
    let mut v = vec![
        (AgVariant::Collective, NCCL, "collective (NCCL all_gather)"),
        (AgVariant::Broadcast, NCCL, "broadcast (NCCL)"),
        (AgVariant::Broadcast, CE, "broadcast (copy engine)"),
        (AgVariant::Ring, NCCL, "ring (NCCL send/recv)"),
        (AgVariant::Ring, CE, "ring (copy engine)"),
        (
            AgVariant::Ring,
            CE_COPY_STREAM,
            "ring (copy engine, copy stream)",
        ),
        (
            AgVariant::RingForward,
            NCCL,
            "ring forward (NCCL send/recv)",
        ),
        (AgVariant::RingForward, CE, "ring forward (copy engine)"),
        (
            AgVariant::RingPrefetch,
            CE,
            "ring, prefetch schedule (copy engine)",
        ),
        (
            AgVariant::RingBidirectional,
            NCCL,
            "bidirectional ring (NCCL send/recv)",
        ),
        (
            AgVariant::RingBidirectional,
            CE,
            "bidirectional ring (copy engine)",
        ),
    ];
    if graph_only {
        v.clear();
    }
    if graph || graph_only {
        v.push((
            AgVariant::Collective,
            NCCL_GRAPH,
            "collective (NCCL all_gather, CUDA graph)",
        ));
        v.push((
            AgVariant::Ring,
            NCCL_GRAPH,
            "ring (NCCL send/recv, CUDA graph)",
        ));
    }
    v
}

/// `meshflow bench agmm`: column-parallel linear (all-gather + GEMM) in bf16.
pub fn bench_agmm(opts: &BenchOptions) -> Result<Vec<CaseResult>, BenchError> {
    let r = Runner::new(opts)?;
    let d = r.world;
    let du = d as u64;
    let device = r.device_name();
    let mut cases = Vec::new();
    for &s in &opts.shapes {
        if s.m % du != 0 || s.n % du != 0 {
            return Err(BenchError::Invalid(format!(
                "M={} and N={} must be multiples of d={d}",
                s.m, s.n
            )));
        }
        let full = full_inputs(s, opts.seed)?;
        let tag = format!("agmm {}x{}x{} d={d}", s.m, s.k, s.n);
        let lower_over =
            |v: AgVariant, parts: Parts, setup: Setup| -> Result<Lowered, BenchError> {
                agmm_lowered_over(
                    d,
                    s,
                    DTYPE,
                    v,
                    opts.stream_pool,
                    parts,
                    Some(setup.transport),
                )
                .map_err(|source| BenchError::Lower {
                    what: format!("{tag}: {}", v.name()),
                    source: Box::new(source),
                })
            };
        let lower = |v: AgVariant, parts: Parts| lower_over(v, parts, NCCL);
        let collective_comm = lower(AgVariant::Collective, Parts::CommOnly)?;
        let per_rank = r.scatter("agmm inputs", &collective_comm.program, &full)?;
        let comm = r
            .time(
                &format!("{tag}: all_gather alone"),
                &collective_comm.host,
                per_rank.clone(),
                NCCL,
            )?
            .timing;
        let gemm_in = r.replicated(&[("a", &[s.m, s.k], 11), ("w", &[s.n / du, s.k], 12)])?;
        let gemm = r
            .time(
                &format!("{tag}: GEMM alone"),
                &gemm_alone_host(d, s.m, s.k, s.n / du, DTYPE),
                gemm_in,
                NCCL,
            )?
            .timing;
        let bound = comm.us.max(gemm.us);
        tracing::info!(
            "bench: {tag}: all_gather alone {:.1} µs, GEMM alone {:.1} µs",
            comm.us,
            gemm.us
        );
        let mut parts = Vec::new();
        let timed_alone =
            |(v, _): &&(AgVariant, &str)| opts.parts && !opts.graph_only && ag_fits(*v, s, d);
        for &(v, ring) in AG_RINGS.iter().filter(timed_alone) {
            for (setup, transport) in [(NCCL, "NCCL"), (CE, "copy engine")] {
                let ring_comm = lower_over(v, Parts::CommOnly, setup)?;
                let name = format!("{ring} permutes alone ({transport})");
                if let Ok(m) = r.time(
                    &format!("{tag}: {name}"),
                    &ring_comm.host,
                    per_rank.clone(),
                    setup,
                ) {
                    tracing::info!("bench: {tag}: {name} {:.1} µs", m.timing.us);
                    parts.push((name, m.timing));
                }
            }
            let ring_gemm = lower(v, Parts::ComputeOnly)?;
            let name = format!("{ring} chunk GEMMs alone");
            if let Ok(m) = r.time(
                &format!("{tag}: {name}"),
                &ring_gemm.host,
                per_rank.clone(),
                NCCL,
            ) {
                parts.push((name, m.timing));
            }
        }
        let mut variants = Vec::new();
        for (v, setup, name) in ag_variants(opts.graph, opts.graph_only) {
            if !ag_fits(v, s, d) {
                if d > 1 {
                    tracing::warn!("bench: {tag}: {name} skipped: M is not a multiple of 2d");
                }
                continue;
            }
            let what = format!("{tag}: {name}");
            let measured = lower_over(v, Parts::Both, setup).and_then(|l| {
                let m = r.time(&what, &l.host, per_rank.clone(), setup)?;
                let err = r.output_error(&what, &m, &l.program, &full, "y", s, opts.seed ^ 7)?;
                Ok((m, err))
            });
            variants.push(variant_result(name.to_string(), measured, bound));
        }
        if !opts.graph_only && d > 1 {
            variants.push(default_variant(
                &r,
                &tag,
                s,
                &full,
                per_rank.clone(),
                bound,
                false,
            ));
        }
        if let Some(dir) = &opts.trace_dir {
            // The rings, and the pipeline's ring under the prefetch schedule (copy engine).
            let traced = AG_RINGS
                .iter()
                .map(|&(v, _)| (v, [(CE, "ce"), (NCCL, "nccl")].as_slice()))
                .chain([(AgVariant::RingPrefetch, [(CE, "ce")].as_slice())]);
            for (v, setups) in traced.filter(|(v, _)| ag_fits(*v, s, d)) {
                for &(setup, transport) in setups {
                    let l = lower_over(v, Parts::Both, setup)?;
                    let name = format!("agmm_{}x{}x{}_{}_{transport}", s.m, s.k, s.n, v.name());
                    if let Err(e) = r.trace(dir, &name, &l.host, per_rank.clone(), setup) {
                        tracing::warn!("{e}");
                    }
                }
            }
        }
        cases.push(CaseResult {
            bench: "agmm",
            shape: s,
            dtype: "bf16",
            world: d,
            device: device.clone(),
            comm_name: "all_gather",
            comm,
            gemm,
            bound_us: bound,
            parts,
            torch: opts.torch.as_ref().and_then(|t| t.case("agmm", s)).cloned(),
            variants,
        });
    }
    Ok(cases)
}

/// `meshflow bench rsmm`: row-parallel linear (GEMM + reduce-scatter over rows) in bf16.
pub fn bench_rsmm(opts: &BenchOptions) -> Result<Vec<CaseResult>, BenchError> {
    let r = Runner::new(opts)?;
    let d = r.world;
    let du = d as u64;
    let device = r.device_name();
    let mut cases = Vec::new();
    for &s in &opts.shapes {
        if s.k % du != 0 || s.m % du != 0 {
            return Err(BenchError::Invalid(format!(
                "M={} and K={} must be multiples of d={d}",
                s.m, s.k
            )));
        }
        let tag = format!("rsmm {}x{}x{} d={d}", s.m, s.k, s.n);
        let full = full_inputs(s, opts.seed)?;
        let rs_in = r.replicated(&[("y", &[s.m, s.n], 21)])?;
        let comm = r
            .time(
                &format!("{tag}: reduce_scatter alone"),
                &rs_alone_host(d, s.m, s.n, DTYPE),
                rs_in,
                NCCL,
            )?
            .timing;
        let gemm_in = r.replicated(&[("a", &[s.m, s.k / du], 22), ("w", &[s.n, s.k / du], 23)])?;
        let gemm = r
            .time(
                &format!("{tag}: GEMM alone"),
                &gemm_alone_host(d, s.m, s.k / du, s.n, DTYPE),
                gemm_in,
                NCCL,
            )?
            .timing;
        let bound = comm.us.max(gemm.us);
        let mut variants = Vec::new();
        let mut parts = Vec::new();
        if d > 1 && opts.parts && !opts.graph_only {
            let rs_in = r.replicated(&[("y", &[s.m, s.n], 21)])?;
            if let Ok(m) = r.time(
                &format!("{tag}: reduce_scatter alone (copy engine)"),
                &rs_alone_host(d, s.m, s.n, DTYPE),
                rs_in,
                CE,
            ) {
                tracing::info!(
                    "bench: {tag}: reduce_scatter alone (copy engine) {:.1} µs",
                    m.timing.us
                );
                parts.push(("reduce_scatter alone (copy engine)".to_string(), m.timing));
            }
            let lower = |parts: Parts, setup: Setup| {
                rsmm_lowered_over(
                    d,
                    s,
                    DTYPE,
                    RsVariant::Ring(1),
                    opts.stream_pool,
                    parts,
                    Some(setup.transport),
                )
            };
            let ring = [
                (Parts::CommOnly, NCCL, "ring permutes alone (NCCL)"),
                (Parts::CommOnly, CE, "ring permutes alone (copy engine)"),
                (Parts::ComputeOnly, NCCL, "ring chunk GEMMs and adds alone"),
            ];
            for (part, setup, name) in ring {
                let Ok(l) = lower(part, setup) else { continue };
                let per_rank = r.scatter("rsmm inputs", &l.program, &full)?;
                if let Ok(m) = r.time(&format!("{tag}: {name}"), &l.host, per_rank, setup) {
                    tracing::info!("bench: {tag}: {name} {:.1} µs", m.timing.us);
                    parts.push((name.to_string(), m.timing));
                }
            }
        }
        let mut list = vec![
            (RsVariant::Collective, NCCL, "collective (NCCL)".to_string()),
            (
                RsVariant::Collective,
                CE,
                "collective (copy engine)".to_string(),
            ),
        ];
        if opts.graph_only {
            list.clear();
        }
        if d > 1 && !opts.graph_only {
            list.push((RsVariant::Reduce, NCCL, "reduce (NCCL)".to_string()));
            list.push((RsVariant::Reduce, CE, "reduce (copy engine)".to_string()));
            list.push((
                RsVariant::Ring(1),
                NCCL,
                "ring (NCCL send/recv)".to_string(),
            ));
            list.push((RsVariant::Ring(1), CE, "ring (copy engine)".to_string()));
            let pieces = RING_PIECES;
            if (s.m / du).is_multiple_of(pieces) && opts.stream_pool >= 2 {
                for (setup, transport) in [(NCCL, "NCCL send/recv"), (CE, "copy engine")] {
                    list.push((
                        RsVariant::Ring(pieces),
                        setup,
                        format!("ring pieces={pieces} ({transport})"),
                    ));
                }
            }
        }
        if opts.graph || opts.graph_only {
            list.push((
                RsVariant::Collective,
                NCCL_GRAPH,
                "collective (NCCL, CUDA graph)".to_string(),
            ));
        }
        for (v, setup, name) in list {
            let what = format!("{tag}: {name}");
            let measured = rsmm_lowered_over(
                d,
                s,
                DTYPE,
                v,
                opts.stream_pool,
                Parts::Both,
                Some(setup.transport),
            )
            .map_err(|source| BenchError::Lower {
                what: what.clone(),
                source: Box::new(source),
            })
            .and_then(|l| {
                let per_rank = r.scatter("rsmm inputs", &l.program, &full)?;
                let m = r.time(&what, &l.host, per_rank, setup)?;
                let err = r.output_error(&what, &m, &l.program, &full, "z", s, opts.seed ^ 9)?;
                Ok((m, err))
            });
            variants.push(variant_result(name, measured, bound));
        }
        if !opts.graph_only && d > 1 {
            let per_rank = r.scatter("rsmm inputs", &rsmm_program(d, s, DTYPE), &full)?;
            variants.push(default_variant(&r, &tag, s, &full, per_rank, bound, true));
        }
        cases.push(CaseResult {
            bench: "rsmm",
            shape: s,
            dtype: "bf16",
            world: d,
            device: device.clone(),
            comm_name: "reduce_scatter",
            comm,
            gemm,
            bound_us: bound,
            parts,
            torch: opts.torch.as_ref().and_then(|t| t.case("rsmm", s)).cloned(),
            variants,
        });
    }
    Ok(cases)
}

/// `meshflow bench permute`: a collective permute (every rank sends to rank + 1) of
/// `opts.permute_mib` MiB per rank, NCCL send/recv against the copy engine; outputs are checked
/// against the inputs. Returns the results and the GPU name.
pub fn bench_permute(opts: &BenchOptions) -> Result<(Vec<PermuteResult>, String), BenchError> {
    let r = Runner::new(opts)?;
    let d = r.world;
    if d < 2 {
        return Err(BenchError::Invalid(
            "bench permute needs at least 2 GPUs".into(),
        ));
    }
    let mut out = Vec::new();
    for &mib in &opts.permute_mib {
        let n = (mib << 20) / 2;
        let host = permute_host(d, n, DTYPE);
        let inputs: PerRank = (0..d)
            .map(|rank| {
                TensorData::random(DTYPE, &[n], opts.seed + rank as u64)
                    .map(|t| (rank, BTreeMap::from([("a".to_string(), t)])))
                    .map_err(|e| BenchError::Invalid(e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let mut timings = Vec::new();
        for (setup, name) in [(NCCL, "NCCL"), (CE, "copy engine")] {
            let what = format!("permute {mib} MiB ({name})");
            let m = r.time(&what, &host, inputs.clone(), setup)?;
            for rank in 0..d {
                let from = (rank + d - 1) % d;
                let got = m.outcome.outputs.get(&rank).and_then(|o| o.get("b"));
                let want = inputs.get(&from).and_then(|o| o.get("a"));
                let same = matches!((got, want), (Some(g), Some(w)) if g == w);
                if !same {
                    return Err(BenchError::Wrong {
                        variant: format!("{what}: rank {rank}"),
                        error: f64::NAN,
                    });
                }
            }
            timings.push(m.timing);
        }
        let copy_engine = timings.pop().unwrap_or_else(|| Timing::from_times(&[]));
        let nccl = timings.pop().unwrap_or_else(|| Timing::from_times(&[]));
        out.push(PermuteResult {
            bytes: mib << 20,
            world: d,
            nccl,
            copy_engine,
            torch_us: opts
                .torch
                .as_ref()
                .and_then(|t| t.sendrecv.get(&mib))
                .map(|x| x.0),
        });
    }
    Ok((out, r.device_name()))
}
