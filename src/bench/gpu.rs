//! Measuring the benchmark cases on GPUs (feature `cuda`).

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow_ir::{DType, HostProgram, Program};

use super::programs::{
    agmm_lowered, gemm_alone_host, rs_alone_host, rsmm_lowered, AgVariant, Gemm3, Lowered, Parts,
    RsVariant,
};
use super::stats::{CaseResult, Timing, VariantResult};
use crate::runtime::cuda::{
    device_count, run_cuda_timed, CudaConfig, CudaLaunchError, CudaOptions,
};
use crate::runtime::data::{SplitMix64, TensorData};
use crate::runtime::shard::{scatter_inputs, ShardError};
use crate::runtime::SimInputs;

/// Why a benchmark failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BenchError {
    /// A GPU run failed.
    #[error("{what}: {source}")]
    Run {
        /// The program.
        what: String,
        /// Why.
        source: CudaLaunchError,
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
        source: crate::pipeline::PipelineError,
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
    /// The cases.
    pub shapes: Vec<Gemm3>,
    /// Chunk counts of the chunked GEMM+RS variant.
    pub chunks: Vec<u64>,
    /// Worker streams.
    pub stream_pool: usize,
    /// Seed of the random inputs.
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            ranks: None,
            warmup: 5,
            iterations: 20,
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
            chunks: vec![4],
            stream_pool: 4,
            seed: 2024,
        }
    }
}

const DTYPE: DType = DType::BF16;

struct Runner {
    opts: BenchOptions,
    world: usize,
    cuda: CudaOptions,
}

type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

impl Runner {
    fn new(opts: &BenchOptions) -> Result<Runner, BenchError> {
        let have = device_count().map_err(|source| BenchError::Run {
            what: "counting GPUs".into(),
            source,
        })?;
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
                    timeout: Duration::from_secs(300),
                    ..CudaConfig::default()
                },
            },
        })
    }

    fn device_name(&self) -> String {
        meshflow_kernels::Device::new(0)
            .map(|d| d.name().to_owned())
            .unwrap_or_else(|e| format!("unknown GPU ({e})"))
    }

    /// Times `host` with per-rank inputs; returns the timing and the last outputs.
    fn time(
        &self,
        what: &str,
        host: &HostProgram,
        inputs: PerRank,
    ) -> Result<(Timing, crate::runtime::RunOutcome), BenchError> {
        tracing::info!("bench: {what}");
        let run = run_cuda_timed(
            host,
            SimInputs::PerRank(inputs),
            &self.cuda,
            self.opts.warmup,
            self.opts.iterations,
        )
        .map_err(|source| BenchError::Run {
            what: what.to_owned(),
            source,
        })?;
        Ok((Timing::from_times(&run.times_us), run.outcome))
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
    let bad = |e: crate::runtime::data::DataError| BenchError::Invalid(e.to_string());
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

fn finish_variant(
    name: String,
    timing: Timing,
    bound: f64,
    err: f64,
) -> Result<VariantResult, BenchError> {
    if err.is_nan() || err > 1e-2 {
        return Err(BenchError::Wrong {
            variant: name,
            error: err,
        });
    }
    Ok(VariantResult {
        ratio_to_bound: timing.us / bound,
        name,
        timing,
        sampled_rel_err: err,
    })
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
        let lower = |v: AgVariant, parts: Parts| -> Result<Lowered, BenchError> {
            agmm_lowered(d, s, DTYPE, v, opts.stream_pool, parts).map_err(|source| {
                BenchError::Lower {
                    what: format!("{tag}: {}", v.name()),
                    source,
                }
            })
        };
        let collective_comm = lower(AgVariant::Collective, Parts::CommOnly)?;
        let per_rank = r.scatter("agmm inputs", &collective_comm.program, &full)?;
        let (comm, _) = r.time(
            &format!("{tag}: all_gather alone"),
            &collective_comm.host,
            per_rank.clone(),
        )?;
        let gemm_in = r.replicated(&[("a", &[s.m, s.k], 11), ("w", &[s.n / du, s.k], 12)])?;
        let (gemm, _) = r.time(
            &format!("{tag}: GEMM alone"),
            &gemm_alone_host(d, s.m, s.k, s.n / du, DTYPE),
            gemm_in,
        )?;
        let bound = comm.us.max(gemm.us);
        let mut variants = Vec::new();
        for v in AgVariant::ALL {
            let what = format!("{tag}: {}", v.name());
            let l = lower(v, Parts::Both)?;
            let (timing, outcome) = r.time(&what, &l.host, per_rank.clone())?;
            let out = outcome
                .gather(&l.program)
                .map_err(|source| BenchError::Shard {
                    what: what.clone(),
                    source,
                })?;
            let err = sampled_error(&full, &out["y"], s, opts.seed ^ 7);
            variants.push(finish_variant(v.name().to_string(), timing, bound, err)?);
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
        let (comm, _) = r.time(
            &format!("{tag}: reduce_scatter alone"),
            &rs_alone_host(d, s.m, s.n, DTYPE),
            rs_in,
        )?;
        let gemm_in = r.replicated(&[("a", &[s.m, s.k / du], 22), ("w", &[s.n, s.k / du], 23)])?;
        let (gemm, _) = r.time(
            &format!("{tag}: GEMM alone"),
            &gemm_alone_host(d, s.m, s.k / du, s.n, DTYPE),
            gemm_in,
        )?;
        let bound = comm.us.max(gemm.us);
        let mut variants = Vec::new();
        let mut list = vec![RsVariant::Collective];
        for &c in &opts.chunks {
            if c > 0 && s.m % (c * du) == 0 {
                list.push(RsVariant::Chunked(c));
            } else {
                return Err(BenchError::Invalid(format!(
                    "M={} is not a multiple of {c} chunks x d={d}",
                    s.m
                )));
            }
        }
        for v in list {
            let what = format!("{tag}: {}", v.name());
            let l =
                rsmm_lowered(d, s, DTYPE, v, opts.stream_pool, Parts::Both).map_err(|source| {
                    BenchError::Lower {
                        what: what.clone(),
                        source,
                    }
                })?;
            let per_rank = r.scatter("rsmm inputs", &l.program, &full)?;
            let (timing, outcome) = r.time(&what, &l.host, per_rank)?;
            let out = outcome
                .gather(&l.program)
                .map_err(|source| BenchError::Shard {
                    what: what.clone(),
                    source,
                })?;
            let err = sampled_error(&full, &out["z"], s, opts.seed ^ 9);
            variants.push(finish_variant(v.name(), timing, bound, err)?);
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
            variants,
        });
    }
    Ok(cases)
}
