//! The AG+GEMM and GEMM+RS cases of `meshflow bench agmm|rsmm|schedule` (feature `cuda`):
//! every program of a case (the communication and the GEMM alone for the bound, every
//! variant, the default lowering, the parts alone) becomes one [`Job`] of one measurement
//! session (see [`crate::session`]: set up once, checked once, timed in interleaved rounds).
//!
//! Variants that lower to the same host program (the printed host IR, the program's name
//! aside) over the same backend setup are timed once and reported under each name; the log
//! says which.

use std::collections::{BTreeMap, HashMap};

use meshflow::ir::{DeviceId, HostProgram};
use meshflow::runtime::data::TensorData;

use crate::gpu::{
    full_inputs, sampled_error, BenchError, BenchOptions, Block, Runner, Setup, CE, CE_COPY_STREAM,
    DTYPE, NCCL, NCCL_GRAPH, RING_PIECES,
};
use crate::programs::{
    agmm_lowered_over, default_lowered, gemm_alone_host, rs_alone_host, rsmm_lowered_over,
    rsmm_program, AgVariant, Gemm3, Parts, RsVariant,
};
use crate::session::{Job, Measured};
use crate::stats::{CaseResult, Timing, VariantResult};

/// What a job stands for in the case's report.
#[derive(Clone, Debug)]
enum Role {
    /// The communication alone (the bound).
    Comm,
    /// The GEMM alone (the bound).
    Gemm,
    /// A part timed alone (a table row).
    Part(String),
    /// A variant (a row of the schedule JSON).
    Variant(String),
}

/// A case being assembled: its jobs (one per distinct host program and setup), and every
/// reported entry with its job, or why it has none.
struct Case {
    tag: String,
    jobs: Vec<Job>,
    by_text: HashMap<(String, Setup), usize>,
    entries: Vec<(Role, Result<usize, String>)>,
}

impl Case {
    fn new(tag: String) -> Case {
        Case {
            tag,
            jobs: Vec::new(),
            by_text: HashMap::new(),
            entries: Vec::new(),
        }
    }

    /// Adds `host` as `role` (timed once per distinct program and setup).
    fn add(
        &mut self,
        role: Role,
        host: Result<HostProgram, BenchError>,
        setup: Setup,
        inputs: usize,
        check: bool,
    ) {
        let name = match &role {
            Role::Comm => format!("{}: communication alone", self.tag),
            Role::Gemm => format!("{}: GEMM alone", self.tag),
            Role::Part(n) | Role::Variant(n) => format!("{}: {n}", self.tag),
        };
        let job = host.map_err(|e| e.to_string()).map(|host| {
            let mut named = host.clone();
            named.name = "bench".into();
            let key = (named.to_string(), setup);
            if let Some(&j) = self.by_text.get(&key) {
                tracing::info!(
                    "bench: `{name}` lowers to the same host program as `{}`: timed once",
                    self.jobs[j].name
                );
                self.jobs[j].check |= check;
                return j;
            }
            self.jobs.push(Job {
                name,
                host,
                setup,
                inputs,
                check,
            });
            self.by_text.insert(key, self.jobs.len() - 1);
            self.jobs.len() - 1
        });
        self.entries.push((role, job));
    }

    /// The case's report from the jobs' figures (or the reason none were measured).
    fn result(
        self,
        base: CaseResult,
        measured: Result<Vec<Measured>, String>,
    ) -> Result<CaseResult, BenchError> {
        let mut c = base;
        let nan = || Timing::from_times(&[]);
        let (mut comm, mut gemm) = (nan(), nan());
        for (role, job) in &self.entries {
            let m = match (&measured, job) {
                (Ok(all), Ok(j)) => Ok(&all[*j]),
                (Err(e), _) | (_, Err(e)) => Err(e.clone()),
            };
            match role {
                Role::Comm => comm = m.map_or_else(|_| nan(), |m| Timing::from_times(&m.times_us)),
                Role::Gemm => gemm = m.map_or_else(|_| nan(), |m| Timing::from_times(&m.times_us)),
                Role::Part(name) => {
                    if let Ok(m) = m {
                        c.parts
                            .push((name.clone(), Timing::from_times(&m.times_us)));
                    }
                }
                Role::Variant(name) => c.variants.push(variant_result(name.clone(), m)),
            }
        }
        let bound = comm.us.max(gemm.us);
        tracing::info!(
            "bench: {}: {} alone {:.1} µs, GEMM alone {:.1} µs",
            self.tag,
            c.comm_name,
            comm.us,
            gemm.us
        );
        for v in &mut c.variants {
            v.ratio_to_bound = v.timing.us / bound;
            if v.failure.is_none() {
                tracing::info!(
                    "bench: {}: {}: {:.1} µs per step ({:.2} of the bound; rounds {:.1}..{:.1}), rel err {:.2e}",
                    self.tag,
                    v.name,
                    v.timing.us,
                    v.ratio_to_bound,
                    v.timing.min_us,
                    v.timing.max_us,
                    v.sampled_rel_err
                );
            }
        }
        c.comm = comm;
        c.gemm = gemm;
        c.bound_us = bound;
        Ok(c)
    }
}

/// A variant's report: its timing, or why it failed (NaN time) — a failed run, or outputs
/// that differ from the reference.
fn variant_result(name: String, m: Result<&Measured, String>) -> VariantResult {
    let failed = |why: String| {
        tracing::warn!("bench variant `{name}` failed: {why}");
        VariantResult {
            name: name.clone(),
            timing: Timing::from_times(&[]),
            ratio_to_bound: f64::NAN,
            sampled_rel_err: f64::NAN,
            host_us: None,
            failure: Some(why),
        }
    };
    match m {
        Err(e) => failed(e),
        Ok(m) if m.error.is_nan() || m.error > 1e-2 => failed(
            BenchError::Wrong {
                variant: name.clone(),
                error: m.error,
            }
            .to_string(),
        ),
        Ok(m) => {
            let host = Timing::from_times(&m.host_us).us;
            VariantResult {
                name: name.clone(),
                timing: Timing::from_times(&m.times_us),
                ratio_to_bound: f64::NAN,
                sampled_rel_err: m.error,
                host_us: host.is_finite().then_some(host),
                failure: None,
            }
        }
    }
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

/// The default lowering (no options: the schedule search's plan, over the transport it
/// planned for, priced with the profile of the GPU model this process runs on, as `meshflow
/// run --backend cuda` prices it), named `default: <plan>`. Returns the machine profile it was
/// priced with and why.
fn add_default(
    case: &mut Case,
    d: usize,
    s: Gemm3,
    streams: usize,
    rsmm: bool,
    inputs: usize,
    device: Option<&str>,
) -> Option<String> {
    match default_lowered(d, s, DTYPE, rsmm, streams, device) {
        Err(source) => {
            case.add(
                Role::Variant("default".into()),
                Err(BenchError::Lower {
                    what: format!("{}: default", case.tag),
                    source: Box::new(source),
                }),
                NCCL,
                inputs,
                true,
            );
            None
        }
        Ok(l) => {
            tracing::info!(
                "bench: {}: default: {}, priced with the profile {}",
                case.tag,
                l.plan,
                l.profile
            );
            let setup = match l.transport {
                Some(meshflow::Transport::Nccl) => NCCL,
                _ => CE,
            };
            case.add(
                Role::Variant(format!("default: {}", l.plan)),
                Ok(l.lowered.host),
                setup,
                inputs,
                true,
            );
            Some(l.profile)
        }
    }
}

/// The block of the output rank `rank` holds: `y` of AG+GEMM is split on columns, `z` of
/// GEMM+RS on rows.
fn block_of(rank: DeviceId, d: usize, s: Gemm3, rsmm: bool) -> Block {
    let du = d as u64;
    let r = rank as u64;
    if rsmm {
        Block {
            r0: r * s.m / du,
            rows: s.m / du,
            c0: 0,
            cols: s.n,
        }
    } else {
        Block {
            r0: 0,
            rows: s.m,
            c0: r * s.n / du,
            cols: s.n / du,
        }
    }
}

/// Measures `case` and builds its report.
fn finish(
    r: &Runner,
    case: Case,
    sets: &[crate::gpu::PerRank],
    full: &BTreeMap<String, TensorData>,
    s: Gemm3,
    rsmm: bool,
    base: CaseResult,
) -> Result<CaseResult, BenchError> {
    let d = r.world;
    let out = if rsmm { "z" } else { "y" };
    let seed = r.opts.seed ^ if rsmm { 9 } else { 7 };
    let checker = |rank: DeviceId, _job: usize, got: &BTreeMap<String, TensorData>| {
        let t = got
            .get(out)
            .ok_or_else(|| format!("rank {rank} holds no output `{out}`"))?;
        sampled_error(full, t, s, block_of(rank, d, s, rsmm), seed ^ rank as u64)
    };
    tracing::info!(
        "bench: {}: {} programs for {} rows, {} rounds of {} steps",
        case.tag,
        case.jobs.len(),
        case.entries.len(),
        r.opts.iterations,
        r.opts.steps
    );
    let measured = r.measure(&case.jobs, sets, &checker);
    if let Err(e) = &measured {
        tracing::warn!("bench: {}: {e}", case.tag);
    }
    case.result(base, measured)
}

fn base_case(
    r: &Runner,
    opts: &BenchOptions,
    bench: &'static str,
    comm_name: &'static str,
    s: Gemm3,
    device: &str,
) -> CaseResult {
    CaseResult {
        bench,
        shape: s,
        dtype: "bf16",
        world: r.world,
        device: device.to_string(),
        comm_name,
        comm: Timing::from_times(&[]),
        gemm: Timing::from_times(&[]),
        bound_us: f64::NAN,
        parts: Vec::new(),
        torch: opts.torch.as_ref().and_then(|t| t.case(bench, s)).cloned(),
        variants: Vec::new(),
        profile: None,
    }
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
        let tag = format!("agmm {}x{}x{} d={d}", s.m, s.k, s.n);
        tracing::info!("bench: {tag}: preparing inputs and programs");
        let full = full_inputs(s, opts.seed)?;
        let gpu_model = r.pricing_device(&tag)?;
        let lower = |v: AgVariant, parts: Parts, setup: Setup| {
            agmm_lowered_over(
                d,
                s,
                DTYPE,
                v,
                opts.stream_pool,
                parts,
                Some(setup.transport),
                gpu_model.as_deref(),
            )
            .map_err(|source| BenchError::Lower {
                what: format!("{tag}: {}", v.name()),
                source: Box::new(source),
            })
        };
        let collective_comm = lower(AgVariant::Collective, Parts::CommOnly, NCCL)?;
        // Input sets: 0, the sharded x and w; 1, the GEMM alone's operands.
        let sets = vec![
            r.scatter("agmm inputs", &collective_comm.program, &full)?,
            r.replicated(&[("a", &[s.m, s.k], 11), ("w", &[s.n / du, s.k], 12)])?,
        ];
        let mut case = Case::new(tag.clone());
        case.add(Role::Comm, Ok(collective_comm.host), NCCL, 0, false);
        let gemm = gemm_alone_host(d, s.m, s.k, s.n / du, DTYPE);
        case.add(Role::Gemm, Ok(gemm), NCCL, 1, false);
        if opts.parts && !opts.graph_only {
            for &(v, ring) in AG_RINGS.iter().filter(|(v, _)| ag_fits(*v, s, d)) {
                for (setup, transport) in [(NCCL, "NCCL"), (CE, "copy engine")] {
                    let name = format!("{ring} permutes alone ({transport})");
                    let host = lower(v, Parts::CommOnly, setup).map(|l| l.host);
                    case.add(Role::Part(name), host, setup, 0, false);
                }
                let host = lower(v, Parts::ComputeOnly, NCCL).map(|l| l.host);
                case.add(
                    Role::Part(format!("{ring} chunk GEMMs alone")),
                    host,
                    NCCL,
                    0,
                    false,
                );
            }
        }
        for (v, setup, name) in ag_variants(opts.graph, opts.graph_only) {
            if !ag_fits(v, s, d) {
                if d > 1 {
                    tracing::warn!("bench: {tag}: {name} skipped: M is not a multiple of 2d");
                }
                continue;
            }
            let host = lower(v, Parts::Both, setup).map(|l| l.host);
            case.add(Role::Variant(name.to_string()), host, setup, 0, true);
        }
        let profile = (!opts.graph_only && d > 1)
            .then(|| {
                add_default(
                    &mut case,
                    d,
                    s,
                    opts.stream_pool,
                    false,
                    0,
                    gpu_model.as_deref(),
                )
            })
            .flatten();
        if let Some(dir) = &opts.trace_dir {
            // The rings, and the pipeline's ring under the prefetch schedule (copy engine).
            let traced = AG_RINGS
                .iter()
                .map(|&(v, _)| (v, [(CE, "ce"), (NCCL, "nccl")].as_slice()))
                .chain([(AgVariant::RingPrefetch, [(CE, "ce")].as_slice())]);
            for (v, setups) in traced.filter(|(v, _)| ag_fits(*v, s, d)) {
                for &(setup, transport) in setups {
                    let l = lower(v, Parts::Both, setup)?;
                    let name = format!("agmm_{}x{}x{}_{}_{transport}", s.m, s.k, s.n, v.name());
                    if let Err(e) = r.trace(dir, &name, &l.host, sets[0].clone(), setup) {
                        tracing::warn!("{e}");
                    }
                }
            }
        }
        let mut base = base_case(&r, opts, "agmm", "all_gather", s, &device);
        base.profile = profile;
        cases.push(finish(&r, case, &sets, &full, s, false, base)?);
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
        tracing::info!("bench: {tag}: preparing inputs and programs");
        let full = full_inputs(s, opts.seed)?;
        // Input sets: 0, the sharded x and w (every variant's level-1 program annotates them
        // alike); 1, the reduce-scatter alone's `y`; 2, the GEMM alone's operands.
        let sets = vec![
            r.scatter("rsmm inputs", &rsmm_program(d, s, DTYPE), &full)?,
            r.replicated(&[("y", &[s.m, s.n], 21)])?,
            r.replicated(&[("a", &[s.m, s.k / du], 22), ("w", &[s.n, s.k / du], 23)])?,
        ];
        let mut case = Case::new(tag.clone());
        let rs = rs_alone_host(d, s.m, s.n, DTYPE);
        case.add(Role::Comm, Ok(rs.clone()), NCCL, 1, false);
        let gemm = gemm_alone_host(d, s.m, s.k / du, s.n, DTYPE);
        case.add(Role::Gemm, Ok(gemm), NCCL, 2, false);
        let gpu_model = r.pricing_device(&tag)?;
        let lower = |v: RsVariant, parts: Parts, setup: Setup| {
            rsmm_lowered_over(
                d,
                s,
                DTYPE,
                v,
                opts.stream_pool,
                parts,
                Some(setup.transport),
                gpu_model.as_deref(),
            )
            .map(|l| l.host)
            .map_err(|source| BenchError::Lower {
                what: format!("{tag}: {}", v.name()),
                source: Box::new(source),
            })
        };
        if d > 1 && opts.parts && !opts.graph_only {
            let name = "reduce_scatter alone (copy engine)".to_string();
            case.add(Role::Part(name), Ok(rs), CE, 1, false);
            let ring = [
                (Parts::CommOnly, NCCL, "ring permutes alone (NCCL)"),
                (Parts::CommOnly, CE, "ring permutes alone (copy engine)"),
                (Parts::ComputeOnly, NCCL, "ring chunk GEMMs and adds alone"),
            ];
            for (part, setup, name) in ring {
                let host = lower(RsVariant::Ring(1), part, setup);
                case.add(Role::Part(name.to_string()), host, setup, 0, false);
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
            // The ring accumulating in place (what the search picks on the committed
            // profiles: 2 pieces), forced, in 2 and in RING_PIECES pieces.
            for p in [2, pieces] {
                if (s.m / du).is_multiple_of(p) {
                    list.push((
                        RsVariant::RingAccumulate(p),
                        CE,
                        format!("ring accumulate pieces={p} (copy engine)"),
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
            let host = lower(v, Parts::Both, setup);
            case.add(Role::Variant(name), host, setup, 0, true);
        }
        let profile = (!opts.graph_only && d > 1)
            .then(|| {
                add_default(
                    &mut case,
                    d,
                    s,
                    opts.stream_pool,
                    true,
                    0,
                    gpu_model.as_deref(),
                )
            })
            .flatten();
        let mut base = base_case(&r, opts, "rsmm", "reduce_scatter", s, &device);
        base.profile = profile;
        cases.push(finish(&r, case, &sets, &full, s, true, base)?);
    }
    Ok(cases)
}
