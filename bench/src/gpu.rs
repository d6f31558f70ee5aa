//! Measuring the benchmark cases on GPUs (feature `cuda`).

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow::front::agree::{agree_profile, switch_warning};
use meshflow::ir::{DType, HostProgram, Program};

use crate::programs::{permute_host, Gemm3};
use crate::stats::{PermuteResult, Timing};
use crate::torch::TorchBaselines;
use meshflow::runtime::cuda::{
    device_count, run_cuda_timed, CopyStream, CudaConfig, CudaOptions, CudaRunError, Transport,
};
use meshflow::runtime::data::{SplitMix64, TensorData};
use meshflow::runtime::rendezvous::TorchrunEnv;
use meshflow::runtime::shard::{scatter_inputs, ShardError};
use meshflow::runtime::RunInputs;

use crate::launched::Launched;
use crate::session::{self, Checker, InputSets, Job, Rounds};

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
    /// Untimed iterations first (`agmm`, `rsmm`, `schedule`: untimed rounds after the check
    /// run, see [`crate::session`]).
    pub warmup: usize,
    /// Timed iterations, at least 1 (`agmm`, `rsmm`, `schedule`: timed rounds, every program
    /// of the case once per round, in turn; the median over rounds is reported).
    pub iterations: usize,
    /// Host program steps per iteration (round), run back to back on warm GPUs (the time of an
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
    /// How long a rank waits for a peer or the device (and the rendezvous of a launched run)
    /// before it gives up; a rank that makes no progress for longer is reported stalled, with
    /// the case, the program and the phase (see `session`).
    pub timeout: Duration,
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
            timeout: Duration::from_secs(300),
        }
    }
}

pub(crate) const DTYPE: DType = DType::BF16;
/// Row pieces per step of the GEMM+RS ring variant whose adds run under the next GEMM piece.
pub(crate) const RING_PIECES: u64 = 4;

/// How one variant runs on the backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Setup {
    pub transport: Transport,
    pub copy_stream: CopyStream,
    pub graph: bool,
}

pub(crate) const NCCL: Setup = Setup {
    transport: Transport::Nccl,
    copy_stream: CopyStream::Current,
    graph: false,
};
pub(crate) const CE: Setup = Setup {
    transport: Transport::CopyEngine,
    copy_stream: CopyStream::Current,
    graph: false,
};
pub(crate) const CE_COPY_STREAM: Setup = Setup {
    transport: Transport::CopyEngine,
    copy_stream: CopyStream::Dedicated,
    graph: false,
};
pub(crate) const NCCL_GRAPH: Setup = Setup {
    transport: Transport::Nccl,
    copy_stream: CopyStream::Current,
    graph: true,
};

pub(crate) struct Runner {
    pub opts: BenchOptions,
    pub world: usize,
    cuda: CudaOptions,
    /// One process per GPU: this rank's rendezvous.
    launched: Option<std::sync::Arc<Launched>>,
}

pub(crate) type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

/// A timed program: device time, last outputs.
struct Timed {
    timing: Timing,
    outcome: meshflow::runtime::RunOutcome,
}

impl Runner {
    pub(crate) fn new(opts: &BenchOptions) -> Result<Runner, BenchError> {
        let timeout = opts.timeout;
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

    /// The GPU model every plan of case `tag` is priced for (the default's and the forced
    /// variants' choices left to the search alike, as `meshflow run --backend cuda` prices
    /// them): [`target_gpu_model`](meshflow::pipeline::target_gpu_model); with one process per
    /// GPU, the one the ranks agree on (rank 0's where their models differ, with a warning on
    /// the ranks that switch: see [`meshflow::front::agree`]), so that every rank lowers the
    /// same programs. `None` (the default profile, with a warning) when no GPU answers.
    pub(crate) fn pricing_device(&self, tag: &str) -> Result<Option<String>, BenchError> {
        let mine = match meshflow::pipeline::target_gpu_model() {
            Ok(name) => Some(name),
            Err(e) => {
                tracing::warn!("bench: {tag}: no GPU model to choose the profile by: {e}");
                None
            }
        };
        let Some(l) = &self.launched else {
            return Ok(mine);
        };
        let options = match &mine {
            Some(name) => meshflow::Options::new().device(name),
            None => meshflow::Options::new(),
        };
        let claim = options.profile_claim(l.rank());
        let store = l.scope();
        let agreed = agree_profile(store.as_ref(), &claim, l.world(), self.opts.timeout)
            .map_err(|e| BenchError::Invalid(format!("{tag}: {e}")))?;
        if let Some(warning) = switch_warning(&claim, &agreed) {
            tracing::warn!("bench: {tag}: {warning}");
        }
        Ok(agreed.device)
    }

    pub(crate) fn device_name(&self) -> String {
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
    ) -> Result<Timed, BenchError> {
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
            return Ok(Timed {
                timing: Timing::from_times(&run.times_us),
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
        Ok(Timed {
            timing: Timing::from_times(&run.times_us),
            outcome: run.outcome,
        })
    }

    /// Measures a case's `jobs` (see [`crate::session`]): in this process, or this rank of a
    /// run with one process per GPU.
    pub(crate) fn measure(
        &self,
        jobs: &[Job],
        sets: &InputSets,
        checker: Checker<'_>,
    ) -> Result<Vec<session::Measured>, String> {
        let rounds = Rounds {
            warmup: self.opts.warmup,
            rounds: self.opts.iterations.max(1),
            steps: self.opts.steps.max(1),
        };
        let config = &self.cuda.config;
        match &self.launched {
            Some(l) => session::measure_launched(l, jobs, sets, rounds, config, checker),
            None => session::measure_in_process(self.world, jobs, sets, rounds, config, checker),
        }
    }

    /// One profiled step of `host` (after two warm-up runs), written as `dir/name.json` and
    /// `dir/name.svg`.
    pub(crate) fn trace(
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
    pub(crate) fn replicated(
        &self,
        entries: &[(&str, &[u64], u64)],
    ) -> Result<PerRank, BenchError> {
        let mut m = BTreeMap::new();
        for (name, shape, seed) in entries {
            let t = TensorData::random(DTYPE, shape, self.opts.seed ^ seed)
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            m.insert(name.to_string(), t);
        }
        Ok((0..self.world).map(|r| (r, m.clone())).collect())
    }

    pub(crate) fn scatter(
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
pub(crate) fn full_inputs(s: Gemm3, seed: u64) -> Result<BTreeMap<String, TensorData>, BenchError> {
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

/// The block of the full output `out = x @ w^T` one rank holds: rows `r0..r0 + rows`, columns
/// `c0..c0 + cols`, row-major.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub r0: u64,
    pub rows: u64,
    pub c0: u64,
    pub cols: u64,
}

/// Relative error of 256 sampled elements of the block `b` of `out = x @ w^T` (held as `got`)
/// against an f64 CPU reference of the full inputs.
pub(crate) fn sampled_error(
    full: &BTreeMap<String, TensorData>,
    got: &TensorData,
    s: Gemm3,
    b: Block,
    seed: u64,
) -> Result<f64, String> {
    let (x, w) = match (full.get("x"), full.get("w")) {
        (Some(x), Some(w)) => (x, w),
        _ => return Err("the reference inputs `x` and `w` are missing".into()),
    };
    if got.shape() != [b.rows, b.cols] || b.r0 + b.rows > s.m || b.c0 + b.cols > s.n {
        return Err(format!(
            "the output is {}, expected [{}, {}] at rows {}.. and columns {}.. of [{}, {}]",
            got.type_string(),
            b.rows,
            b.cols,
            b.r0,
            b.c0,
            s.m,
            s.n
        ));
    }
    let k = s.k as usize;
    let mut rng = SplitMix64::new(seed);
    let (mut num, mut den) = (0f64, 0f64);
    for _ in 0..256 {
        let (li, lj) = (rng.below(b.rows) as usize, rng.below(b.cols) as usize);
        let (i, j) = (b.r0 as usize + li, b.c0 as usize + lj);
        let mut acc = 0f64;
        for kk in 0..k {
            let a = x.storage().get_f32(i * k + kk).unwrap_or(f32::NAN);
            let v = w.storage().get_f32(j * k + kk).unwrap_or(f32::NAN);
            acc += f64::from(a) * f64::from(v);
        }
        let g = f64::from(
            got.storage()
                .get_f32(li * b.cols as usize + lj)
                .unwrap_or(f32::NAN),
        );
        num += (g - acc) * (g - acc);
        den += acc * acc;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
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
