//! The benchmarked programs: level-1 programs built with [`ProgramBuilder`], each variant
//! lowered with the [pipeline](meshflow::pipeline) and forced through the same [`Options`] a
//! user has (a decomposition, pieces per ring step, a stream schedule, a transport), so that
//! every benchmarked schedule is one the compiler can emit.
//!
//! - Column-parallel linear (AG+GEMM): `x[M, K]` and `w[N, K]` split on rows over `d` ranks,
//!   `y = x @ w^T` split on columns; the gathered `ag` is left unannotated. Variants (the
//!   decomposition of `ag`): one `all_gather` then one GEMM (`collective`), a stream loop of
//!   broadcasts rooted at the loop index (`broadcast`), a ring of collective permutes to
//!   distance `i` at step `i` (`ring`, per-iteration or prefetch schedule), a ring that forwards
//!   each chunk to the next rank (`ring_forward`) and one that sends half of each chunk each
//!   way (`ring_bidirectional`).
//! - Row-parallel linear (GEMM+RS): `x[M, K]` and `w[N, K]` split on `K`; the partial products
//!   `y` are reduce-scattered over rows. Variants (the decomposition of `y`): one GEMM then one
//!   `reduce_scatter` (`collective`), a stream loop of reduces rooted at the loop index
//!   (`reduce`), or running sums passed around a ring of neighbours (`ring`, each step cut into
//!   `pieces`).
//!
//! On one rank nothing moves: every variant lowers to the local GEMM (nothing is forced).
//!
//! Every host program can be cut down to only its communications or only its compute
//! ([`Parts`], [`keep_parts`]), to time each part of the same schedule on its own.

use meshflow::ir::{
    parse_host, Block, DType, DeviceMesh, HostProgram, InstKind, ParallelType, Program,
    ProgramBuilder,
};

use meshflow::pipeline::StreamSchedule;
use meshflow::{compile, Decomposition, Error, Options, Transport};

/// A program and the host program it lowers to.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The level-1 program (after the pipeline's propagation: its layouts cut the inputs).
    pub program: Program,
    /// The host program.
    pub host: HostProgram,
}

/// Sizes of a GEMM case (full, unsharded sizes).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Gemm3 {
    /// Rows of `x` and of the output.
    pub m: u64,
    /// Contraction extent.
    pub k: u64,
    /// Columns of the output.
    pub n: u64,
}

/// Which parts of a variant's host program to emit.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Parts {
    /// Communication and compute (the real program).
    Both,
    /// Only the communications (and their waits).
    CommOnly,
    /// Only the compute ops.
    ComputeOnly,
}

/// An AG+GEMM variant.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum AgVariant {
    /// One all-gather, then one GEMM.
    Collective,
    /// A stream loop of `d` broadcasts (root = loop index), each followed by its chunk's GEMM.
    Broadcast,
    /// A stream loop of `d` collective permutes (a ring), each followed by its chunk's GEMM.
    Ring,
    /// A ring of neighbours: each step forwards the chunk received last step to rank + 1
    /// while GEMM'ing it ([`Decomposition::RingForward`]).
    RingForward,
    /// A ring of neighbours in both directions: half of each chunk travels to rank + 1, the
    /// other half to rank − 1 ([`Decomposition::RingBidirectional`]).
    RingBidirectional,
    /// [`AgVariant::Ring`] lowered with [`StreamSchedule::Prefetch`]: GEMMs on the main
    /// stream, each permute one step ahead on a worker.
    RingPrefetch,
    /// The gathered `ag` left to the schedule search (the default lowering, no options).
    Default,
}

impl AgVariant {
    /// Every variant.
    pub const ALL: [AgVariant; 7] = [
        AgVariant::Collective,
        AgVariant::Broadcast,
        AgVariant::Ring,
        AgVariant::RingForward,
        AgVariant::RingBidirectional,
        AgVariant::RingPrefetch,
        AgVariant::Default,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            AgVariant::Collective => "collective",
            AgVariant::Broadcast => "broadcast",
            AgVariant::Ring => "ring",
            AgVariant::RingForward => "ring_forward",
            AgVariant::RingBidirectional => "ring_bidirectional",
            AgVariant::RingPrefetch => "ring_prefetch",
            AgVariant::Default => "default",
        }
    }
}

/// A GEMM+RS variant.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum RsVariant {
    /// One GEMM, then one reduce-scatter.
    Collective,
    /// A ring of neighbours: running sums of row chunks travel to rank + 1 under the next
    /// chunk's GEMM ([`Decomposition::RingForward`] of the partial sums); each step's GEMM and
    /// add are cut into this many row pieces ([`Options::pieces`]), the add of a piece running
    /// on a worker under the GEMM of the next one (1: one GEMM, then one add). Forced not to
    /// accumulate in place ([`Options::accumulate`] off).
    Ring(u64),
    /// [`RsVariant::Ring`] accumulating in place ([`Options::accumulate`] on): the running sum
    /// lands in the step's accumulator and the chunk GEMM adds onto it (`linear_accumulate`),
    /// each of this many pieces moving on as soon as it is computed.
    RingAccumulate(u64),
    /// A stream loop of reduces rooted at the loop index ([`Decomposition::StreamReduce`]).
    Reduce,
    /// The partial sums `y` left to the schedule search (the default lowering, no options).
    Default,
}

impl RsVariant {
    /// Its name (`collective`, `chunked s=4`, `ring`, `ring pieces=4`).
    pub fn name(self) -> String {
        match self {
            RsVariant::Collective => "collective".into(),
            RsVariant::Ring(1) => "ring".into(),
            RsVariant::Ring(p) => format!("ring pieces={p}"),
            RsVariant::RingAccumulate(p) => format!("ring accumulate pieces={p}"),
            RsVariant::Reduce => "reduce".into(),
            RsVariant::Default => "default".into(),
        }
    }
}

pub(crate) fn mesh_text(d: usize) -> String {
    let v: Vec<String> = (0..d).map(|i| i.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn built(b: ProgramBuilder) -> Program {
    b.build()
        .expect("the bench programs are well formed by construction")
}

/// Level-1 column-parallel linear over `d` ranks, named after `variant`; the gathered `ag`
/// is unannotated, so its decomposition is the schedule search's or the options' (see
/// [`agmm_lowered`]).
pub fn agmm_program(d: usize, s: Gemm3, dtype: DType, variant: AgVariant) -> Program {
    let du = d as u64;
    let mut b = ProgramBuilder::new(format!("agmm_{}", variant.name()));
    let mesh = DeviceMesh::iota(vec![d], 0).expect("a 1-D mesh of d devices");
    let m = b.mesh("m0", mesh).expect("first mesh");
    let x = b.input("x", dtype, &[s.m, s.k], m).expect("x");
    let w = b.input("w", dtype, &[s.n, s.k], m).expect("w");
    b.schedule(x)
        .outer_split(0, du)
        .parallelize(0, ParallelType::DIDx);
    b.schedule(w)
        .outer_split(0, du)
        .parallelize(0, ParallelType::DIDx);
    let ag = b.set(x).expect("set");
    b.rename(ag, "ag").expect("fresh name");
    let y = b.linear(ag, w).expect("linear");
    b.rename(y, "y").expect("fresh name");
    // y's sharding (columns over DIDx, and the Stream split of the loop) is left to
    // propagation, which then fuses the GEMM into the communication loop.
    b.output(y);
    built(b)
}

/// Level-1 row-parallel linear with a reduce-scatter over rows, every tensor annotated.
pub fn rsmm_program(d: usize, s: Gemm3, dtype: DType) -> Program {
    rsmm_program_with(d, s, dtype, true)
}

/// [`rsmm_program`] with the partial sums `y` unannotated (propagation makes them partial), so
/// that the schedule search decides how they are reduce-scattered.
pub fn rsmm_searched_program(d: usize, s: Gemm3, dtype: DType) -> Program {
    rsmm_program_with(d, s, dtype, false)
}

fn rsmm_program_with(d: usize, s: Gemm3, dtype: DType, annotate_y: bool) -> Program {
    let du = d as u64;
    let mut b = ProgramBuilder::new("rsmm");
    let mesh = DeviceMesh::iota(vec![d], 0).expect("a 1-D mesh of d devices");
    let m = b.mesh("m0", mesh).expect("first mesh");
    let x = b.input("x", dtype, &[s.m, s.k], m).expect("x");
    let w = b.input("w", dtype, &[s.n, s.k], m).expect("w");
    b.schedule(x)
        .outer_split(1, du)
        .parallelize(1, ParallelType::DIDx);
    b.schedule(w)
        .outer_split(1, du)
        .parallelize(1, ParallelType::DIDx);
    let y = b.linear(x, w).expect("linear");
    b.rename(y, "y").expect("fresh name");
    if annotate_y {
        b.schedule(y)
            .outer_split(2, du)
            .parallelize(2, ParallelType::DIDx);
    }
    let z = b.set(y).expect("set");
    b.rename(z, "z").expect("fresh name");
    b.schedule(z)
        .outer_split(0, du)
        .parallelize(0, ParallelType::DIDx);
    b.output(z);
    built(b)
}

pub(crate) fn parse(text: &str) -> HostProgram {
    parse_host(text).unwrap_or_else(|e| panic!("bench host program does not parse: {e}\n{text}"))
}

/// The options that force `variant` of an AG+GEMM case: the decomposition of `ag` and the
/// stream schedule (`None` for [`AgVariant::Default`]: nothing forced).
pub fn agmm_options(variant: AgVariant) -> Option<(Decomposition, StreamSchedule)> {
    Some(match variant {
        AgVariant::Collective => (Decomposition::Collective, StreamSchedule::Auto),
        AgVariant::Broadcast => (Decomposition::StreamBroadcast, StreamSchedule::PerIteration),
        AgVariant::Ring => (Decomposition::Ring, StreamSchedule::PerIteration),
        AgVariant::RingPrefetch => (Decomposition::Ring, StreamSchedule::Prefetch),
        AgVariant::RingForward => (Decomposition::RingForward, StreamSchedule::Auto),
        AgVariant::RingBidirectional => (Decomposition::RingBidirectional, StreamSchedule::Auto),
        AgVariant::Default => return None,
    })
}

/// Compiles `program` with the bench's options: no cross-rank check (the tests run it),
/// `streams` workers, and the forced `transport` when given.
fn lower_with(
    d: usize,
    program: &Program,
    options: Options,
    streams: usize,
    transport: Option<Transport>,
    parts: Parts,
) -> Result<Lowered, Error> {
    let mut options = options.check(false).streams(streams.max(1));
    if d <= 1 {
        // One rank: nothing moves, so no decomposition applies (forcing one is an error).
        let p = options.pass_options_mut();
        p.decompositions.clear();
        p.pieces.clear();
        p.accumulate.clear();
    }
    if let Some(t) = transport {
        options = options.transport(t);
    }
    let c = compile(program, &options)?;
    Ok(Lowered {
        host: keep_parts(c.host(), parts),
        program: c.level1()?.clone(),
    })
}

/// Lowers an AG+GEMM variant with the pipeline (`streams` worker streams), forced by
/// [`agmm_options`], and keeps `parts`. Local shapes: `x[M/d, K]`, `w[N/d, K]`, `y[M, N/d]`.
pub fn agmm_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: AgVariant,
    streams: usize,
    parts: Parts,
) -> Result<Lowered, Error> {
    agmm_lowered_over(d, s, dtype, variant, streams, parts, None, None)
}

/// Fresh options whose plans are priced for GPU model `device` ([`Options::device`]); `None`:
/// the default profile.
fn priced_for(device: Option<&str>) -> Options {
    match device {
        Some(device) => Options::new().device(device),
        None => Options::new(),
    }
}

/// [`agmm_lowered`] with the transport forced (the plans then assume it, as
/// `--transport` does), the choices left to the search priced for GPU model `device` (as
/// [`default_lowered`] prices the default; `None`: the default profile).
#[allow(clippy::too_many_arguments)]
pub fn agmm_lowered_over(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: AgVariant,
    streams: usize,
    parts: Parts,
    transport: Option<Transport>,
    device: Option<&str>,
) -> Result<Lowered, Error> {
    let program = agmm_program(d, s, dtype, variant);
    let mut options = priced_for(device);
    if let Some((decomposition, schedule)) = agmm_options(variant) {
        options = options
            .decomposition("ag", decomposition)
            .stream_schedule(schedule);
    }
    lower_with(d, &program, options, streams, transport, parts)
}

/// Lowers a GEMM+RS variant with the pipeline, from the program whose partial sums `y` are
/// left to the search ([`rsmm_searched_program`]), forced through the options (decomposition
/// of `y`, pieces per ring step). Local shapes: `x[M, K/d]`, `w[N, K/d]`, `z[M/d, N]`.
pub fn rsmm_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: RsVariant,
    streams: usize,
    parts: Parts,
) -> Result<Lowered, Error> {
    rsmm_lowered_over(d, s, dtype, variant, streams, parts, None, None)
}

/// [`rsmm_lowered`] with the transport forced, priced for `device` as
/// [`agmm_lowered_over`] is.
#[allow(clippy::too_many_arguments)]
pub fn rsmm_lowered_over(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: RsVariant,
    streams: usize,
    parts: Parts,
    transport: Option<Transport>,
    device: Option<&str>,
) -> Result<Lowered, Error> {
    let options = priced_for(device);
    let (program, options) = match variant {
        RsVariant::Collective => (
            rsmm_searched_program(d, s, dtype),
            options.decomposition("y", Decomposition::Collective),
        ),
        RsVariant::Ring(pieces) => (
            rsmm_searched_program(d, s, dtype),
            options
                .decomposition("y", Decomposition::RingForward)
                .pieces("y", pieces)
                .accumulate("y", false),
        ),
        RsVariant::RingAccumulate(pieces) => (
            rsmm_searched_program(d, s, dtype),
            options
                .decomposition("y", Decomposition::RingForward)
                .pieces("y", pieces)
                .accumulate("y", true),
        ),
        RsVariant::Reduce => (
            rsmm_searched_program(d, s, dtype),
            options.decomposition("y", Decomposition::StreamReduce),
        ),
        RsVariant::Default => (rsmm_searched_program(d, s, dtype), options),
    };
    lower_with(d, &program, options, streams, transport, parts)
}

/// The default lowering of an AG+GEMM (`rsmm`: false) or GEMM+RS (`rsmm`: true) case: the
/// program with the resharded tensor left to the schedule search, compiled with no options
/// but the stream pool and the GPU model it runs on (`device`: as `meshflow run --backend
/// cuda` names it, so that plans are priced with that model's profile, [`Options::device`]).
/// Also returns the transport the plans assume, the chosen plan and the machine profile it was
/// priced with and why ([`meshflow::Compiled::profile_reason`]).
pub fn default_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    rsmm: bool,
    streams: usize,
    device: Option<&str>,
) -> Result<DefaultLowered, Error> {
    let program = if rsmm {
        rsmm_searched_program(d, s, dtype)
    } else {
        agmm_program(d, s, dtype, AgVariant::Default)
    };
    let options = priced_for(device).check(false).streams(streams.max(1));
    let c = compile(&program, &options)?;
    let plan = c
        .explain()
        .iter()
        .find(|r| !r.tensor.is_empty())
        .map_or_else(|| "collective".to_string(), |r| r.chosen.clone());
    Ok(DefaultLowered {
        lowered: Lowered {
            host: c.host().clone(),
            program: c.level1()?.clone(),
        },
        transport: c.transport(),
        plan,
        profile: options.profile_reason().to_string(),
    })
}

/// What [`default_lowered`] gives back.
#[derive(Clone, Debug)]
pub struct DefaultLowered {
    /// The programs.
    pub lowered: Lowered,
    /// The transport the plans assume.
    pub transport: Option<meshflow::Transport>,
    /// The plan the schedule search took (`collective` where nothing was searched).
    pub plan: String,
    /// The machine profile the plans were priced with, and why.
    pub profile: String,
}

fn keep_block(b: &Block, parts: Parts) -> Block {
    b.iter()
        .filter_map(|inst| {
            let comm = matches!(
                inst.kind,
                InstKind::Communication { .. }
                    | InstKind::CollectivePermute { .. }
                    | InstKind::Wait { .. }
                    | InstKind::StartCoalescing
                    | InstKind::EndCoalescing { .. }
                    | InstKind::MoeDispatch { .. }
                    | InstKind::MoeCombine { .. }
            );
            let compute = matches!(
                inst.kind,
                InstKind::Compute { .. } | InstKind::CallKernel { .. }
            );
            match parts {
                Parts::CommOnly if compute => return None,
                Parts::ComputeOnly if comm => return None,
                _ => {}
            }
            let mut inst = inst.clone();
            if let InstKind::ForLoop { body, .. } = &mut inst.kind {
                *body = keep_block(body, parts);
            }
            Some(inst)
        })
        .collect()
}

/// `host` with only its communications (and waits) or only its compute ops; everything else
/// (allocations, streams, views, loops) stays, so each part runs with the same schedule.
pub fn keep_parts(host: &HostProgram, parts: Parts) -> HostProgram {
    if parts == Parts::Both {
        return host.clone();
    }
    let mut h = host.clone();
    h.body = keep_block(&host.body, parts);
    h
}

/// A GEMM alone on uploaded (random) operands: `y[M, N] = a[M, K] @ w[N, K]^T` on every rank.
pub fn gemm_alone_host(d: usize, m: u64, k: u64, n: u64, dtype: DType) -> HostProgram {
    let t = dtype.name();
    parse(&format!(
        "host gemm_alone {{\n  mesh m0 = {mesh}\n  in a: {t}[{m}, {k}] on m0\n  in w: {t}[{n}, {k}] on m0\n  out y: {t}[{m}, {n}] on m0\n  linear(a, w -> y)\n}}\n",
        mesh = mesh_text(d)
    ))
}

/// A collective permute of `a[n]` to `b[n]` in which every rank sends to rank + 1 and
/// receives from rank - 1 (the peer at d = 2).
pub fn permute_host(d: usize, n: u64, dtype: DType) -> HostProgram {
    let t = dtype.name();
    parse(&format!(
        "host permute {{\n  mesh m0 = {mesh}\n  in a: {t}[{n}] on m0\n  out b: {t}[{n}] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % {d}, recv=(my(m0, DIDx) + {dm1}) % {d})\n  wait c0\n}}\n",
        mesh = mesh_text(d),
        dm1 = d.saturating_sub(1),
    ))
}

/// A reduce-scatter alone of an uploaded (random) `y[M, N]` over rows.
pub fn rs_alone_host(d: usize, m: u64, n: u64, dtype: DType) -> HostProgram {
    let t = dtype.name();
    parse(&format!(
        "host rs_alone {{\n  mesh m0 = {mesh}\n  in y: {t}[{m}, {n}] on m0\n  out z: {t}[{zm}, {n}] on m0\n  c0 = reduce_scatter(y -> z, team=slice(m0, DIDx), op=sum)\n  wait c0\n}}\n",
        mesh = mesh_text(d),
        zm = m / d as u64
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow::runtime::{run_and_compare, CpuOptions};

    const SMALL: Gemm3 = Gemm3 {
        m: 32,
        k: 16,
        n: 24,
    };

    #[test]
    fn every_variant_matches_the_reference_on_cpu_ranks() {
        for d in [1usize, 2, 4] {
            for dtype in [DType::F32, DType::BF16] {
                for v in AgVariant::ALL {
                    let l = agmm_lowered(d, SMALL, dtype, v, 2, Parts::Both)
                        .unwrap_or_else(|e| panic!("agmm {} d={d}: {e}", v.name()));
                    let cmp = run_and_compare(&l.program, &l.host, d, 3, &CpuOptions::default())
                        .unwrap_or_else(|e| panic!("agmm {} d={d}: {e}", v.name()));
                    assert!(cmp.passed(), "agmm {} d={d} {dtype}: {cmp}", v.name());
                }
                for v in [
                    RsVariant::Collective,
                    RsVariant::Ring(1),
                    RsVariant::Ring(2),
                    RsVariant::RingAccumulate(1),
                    RsVariant::RingAccumulate(2),
                    RsVariant::Reduce,
                    RsVariant::Default,
                ] {
                    let l = rsmm_lowered(d, SMALL, dtype, v, 2, Parts::Both)
                        .unwrap_or_else(|e| panic!("rsmm {} d={d}: {e}", v.name()));
                    let cmp = run_and_compare(&l.program, &l.host, d, 5, &CpuOptions::default())
                        .unwrap_or_else(|e| panic!("rsmm {} d={d}: {e}", v.name()));
                    assert!(cmp.passed(), "rsmm {} d={d} {dtype}: {cmp}", v.name());
                }
            }
        }
    }

    #[test]
    fn lowered_loops_interleave_communication_and_compute() {
        for v in [AgVariant::Broadcast, AgVariant::Ring] {
            let l = agmm_lowered(2, SMALL, DType::BF16, v, 2, Parts::Both).unwrap();
            let text = l.host.to_string();
            let body = &text[text.find("for i0").expect("a stream loop")..];
            assert!(
                body.find("wait c0").unwrap() < body.find("linear(").unwrap(),
                "{text}"
            );
            assert!(text.contains("set_current_stream worker("), "{text}");
        }
    }

    #[test]
    fn partial_programs_keep_their_part() {
        for v in AgVariant::ALL {
            let comm = agmm_lowered(2, SMALL, DType::BF16, v, 2, Parts::CommOnly)
                .unwrap()
                .host;
            let text = comm.to_string();
            assert!(!text.contains("linear(") && text.contains("wait"), "{text}");
            let compute = agmm_lowered(2, SMALL, DType::BF16, v, 2, Parts::ComputeOnly)
                .unwrap()
                .host;
            let text = compute.to_string();
            assert!(text.contains("linear(") && !text.contains("wait"), "{text}");
        }
        let comm = rsmm_lowered(
            2,
            SMALL,
            DType::BF16,
            RsVariant::Ring(2),
            2,
            Parts::CommOnly,
        )
        .unwrap()
        .host;
        assert!(!comm.to_string().contains("linear("));
    }
}
