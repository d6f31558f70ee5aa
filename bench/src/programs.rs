//! The benchmarked programs: level-1 programs built with [`ProgramBuilder`], lowered with the
//! [pipeline](meshflow::pipeline) (the chunked reduce-scatter, whose schedule the pipeline does not
//! lower yet, and the neighbour rings of [`rings`](crate::rings) are hand-written host programs
//! checked against the same level-1 programs).
//!
//! - Column-parallel linear (AG+GEMM): `x[M, K]` and `w[N, K]` split on rows over `d` ranks,
//!   `y = x @ w^T` split on columns. Variants: one `all_gather` then one GEMM (`collective`), a
//!   stream loop of broadcasts rooted at the loop index (`broadcast`), a ring of collective
//!   permutes to distance `i` at step `i` (`ring`), a ring that forwards each chunk to the next
//!   rank (`ring_forward`) and one that sends half of each chunk each way
//!   (`ring_bidirectional`).
//! - Row-parallel linear (GEMM+RS): `x[M, K]` and `w[N, K]` split on `K`; the partial products
//!   are reduce-scattered over rows. Variants: one GEMM then one `reduce_scatter`
//!   (`collective`), `s` row chunks, each GEMM'd and reduce-scattered on its own stream
//!   (`chunked`), or running sums passed around a ring of neighbours (`ring`).
//!
//! Every host program can be cut down to only its communications or only its compute
//! ([`Parts`], [`keep_parts`]), to time each part of the same schedule on its own.

use meshflow::ir::{
    parse_host, Block, DType, DeviceMesh, HostProgram, InstKind, ParallelType, Program,
    ProgramBuilder,
};

use crate::rings::{agmm_ring_lowered, rsmm_ring_host, rsmm_ring_lowered};
use meshflow::pipeline::StreamSchedule;
use meshflow::{compile, Error, Options};

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
    /// A hand-written ring of neighbours: each step forwards the chunk received last step to
    /// rank + 1 while GEMM'ing it (see [`agmm_ring_host`](crate::rings::agmm_ring_host)).
    RingForward,
    /// A hand-written ring of neighbours in both directions: half of each chunk travels to
    /// rank + 1, the other half to rank − 1 (see
    /// [`agmm_ring_host`](crate::rings::agmm_ring_host)).
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
    /// `s` row chunks: GEMM and reduce-scatter per chunk on worker streams.
    Chunked(u64),
    /// A hand-written ring of neighbours: running sums of row chunks travel to rank + 1 under
    /// the next chunk's GEMM (see [`rsmm_ring_host`]); each step's GEMM and add are cut into
    /// this many row pieces, the add of a piece running on a worker under the GEMM of the next
    /// one (1: one GEMM, then one add on the main stream).
    Ring(u64),
    /// The partial sums `y` left to the schedule search (the default lowering, no options).
    Default,
}

impl RsVariant {
    /// Its name (`collective`, `chunked s=4`, `ring`, `ring pieces=4`).
    pub fn name(self) -> String {
        match self {
            RsVariant::Collective => "collective".into(),
            RsVariant::Chunked(s) => format!("chunked s={s}"),
            RsVariant::Ring(1) => "ring".into(),
            RsVariant::Ring(p) => format!("ring pieces={p}"),
            RsVariant::Default => "default".into(),
        }
    }
}

pub(super) fn mesh_text(d: usize) -> String {
    let v: Vec<String> = (0..d).map(|i| i.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn built(b: ProgramBuilder) -> Program {
    b.build()
        .expect("the bench programs are well formed by construction")
}

/// Level-1 column-parallel linear over `d` ranks; `variant` picks the schedule of the gathered
/// `ag` (replicated for `collective` and the hand-written rings, a Stream split for
/// `broadcast`, a swizzled Stream split for `ring`).
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
    match variant {
        AgVariant::Collective
        | AgVariant::RingForward
        | AgVariant::RingBidirectional
        | AgVariant::Default => {}
        AgVariant::Broadcast => {
            b.schedule(ag)
                .outer_split(0, du)
                .parallelize(0, ParallelType::Stream);
        }
        AgVariant::Ring | AgVariant::RingPrefetch => {
            b.schedule(ag)
                .outer_split(0, du)
                .swizzle1d(0, ParallelType::DIDx)
                .parallelize(0, ParallelType::Stream);
        }
    }
    let y = b.linear(ag, w).expect("linear");
    b.rename(y, "y").expect("fresh name");
    // y's sharding (columns over DIDx, and the Stream split of the loop) is left to
    // propagation, which then fuses the GEMM into the communication loop.
    b.output(y);
    built(b)
}

/// Level-1 row-parallel linear with a reduce-scatter over rows (chunked into `s` stream
/// chunks when `chunks` is `Some(s)`: rank `r` then holds rows `r` of every chunk).
pub fn rsmm_program(d: usize, s: Gemm3, dtype: DType, chunks: Option<u64>) -> Program {
    rsmm_program_with(d, s, dtype, chunks, true)
}

/// [`rsmm_program`] with the partial sums `y` unannotated (propagation makes them partial), so
/// that the schedule search decides how they are reduce-scattered.
pub fn rsmm_searched_program(d: usize, s: Gemm3, dtype: DType) -> Program {
    rsmm_program_with(d, s, dtype, None, false)
}

fn rsmm_program_with(
    d: usize,
    s: Gemm3,
    dtype: DType,
    chunks: Option<u64>,
    annotate_y: bool,
) -> Program {
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
    match chunks {
        None => {
            b.schedule(z)
                .outer_split(0, du)
                .parallelize(0, ParallelType::DIDx);
        }
        Some(c) => {
            b.schedule(z)
                .outer_split(0, c)
                .parallelize(0, ParallelType::Stream)
                .outer_split(1, du)
                .parallelize(1, ParallelType::DIDx);
        }
    }
    b.output(z);
    built(b)
}

pub(super) fn parse(text: &str) -> HostProgram {
    parse_host(text).unwrap_or_else(|e| panic!("bench host program does not parse: {e}\n{text}"))
}

/// Lowers an AG+GEMM variant with the pipeline (`streams` worker streams; the hand-written
/// rings use workers 0 and 1, see [`agmm_ring_lowered`]) and keeps `parts`. Local shapes:
/// `x[M/d, K]`, `w[N/d, K]`, `y[M, N/d]`.
pub fn agmm_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: AgVariant,
    streams: usize,
    parts: Parts,
) -> Result<Lowered, Error> {
    if matches!(
        variant,
        AgVariant::RingForward | AgVariant::RingBidirectional
    ) {
        return agmm_ring_lowered(d, s, dtype, variant, parts);
    }
    let program = agmm_program(d, s, dtype, variant);
    let stream_schedule = match variant {
        AgVariant::RingPrefetch => StreamSchedule::Prefetch,
        AgVariant::Default => StreamSchedule::Auto,
        _ => StreamSchedule::PerIteration,
    };
    let mut options = Options::new()
        .check(false)
        .streams(streams.max(1))
        .stream_schedule(stream_schedule);
    if variant == AgVariant::Collective {
        // The gathered `ag` is unannotated: keep the search from decomposing it.
        options = options.decomposition("ag", meshflow::passes::Decomposition::Collective);
    }
    let c = compile(&program, &options)?;
    Ok(Lowered {
        host: keep_parts(c.host(), parts),
        program: c.level1()?.clone(),
    })
}

/// Lowers a GEMM+RS variant: the collective one with the pipeline, the chunked one and the ring
/// by hand (see [`rsmm_host`], [`rsmm_ring_lowered`]). Local shapes: `x[M, K/d]`, `w[N, K/d]`,
/// `z[M/d, N]`.
pub fn rsmm_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: RsVariant,
    streams: usize,
    parts: Parts,
) -> Result<Lowered, Error> {
    match variant {
        RsVariant::Collective => {
            let program = rsmm_program(d, s, dtype, None);
            let options = Options::new().check(false).streams(streams.max(1));
            let c = compile(&program, &options)?;
            Ok(Lowered {
                host: keep_parts(c.host(), parts),
                program: c.level1()?.clone(),
            })
        }
        RsVariant::Chunked(chunks) => Ok(Lowered {
            program: rsmm_program(d, s, dtype, Some(chunks)),
            host: rsmm_host(d, s, dtype, variant, parts),
        }),
        RsVariant::Ring(pieces) => rsmm_ring_lowered(d, s, dtype, pieces, parts),
        RsVariant::Default => {
            let options = Options::new().check(false).streams(streams.max(1));
            let c = compile(&rsmm_searched_program(d, s, dtype), &options)?;
            Ok(Lowered {
                host: keep_parts(c.host(), parts),
                program: c.level1()?.clone(),
            })
        }
    }
}

/// The default lowering of an AG+GEMM (`rsmm`: false) or GEMM+RS (`rsmm`: true) case: the
/// program with the resharded tensor left to the schedule search, compiled with no options
/// but the stream pool. Also returns the transport the plans assume and the chosen plan.
pub fn default_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    rsmm: bool,
    streams: usize,
) -> Result<(Lowered, Option<meshflow::Transport>, String), Error> {
    let program = if rsmm {
        rsmm_searched_program(d, s, dtype)
    } else {
        agmm_program(d, s, dtype, AgVariant::Default)
    };
    let options = Options::new().check(false).streams(streams.max(1));
    let c = compile(&program, &options)?;
    let plan = c
        .explain()
        .iter()
        .find(|r| !r.tensor.is_empty())
        .map_or_else(|| "collective".to_string(), |r| r.chosen.clone());
    Ok((
        Lowered {
            host: c.host().clone(),
            program: c.level1()?.clone(),
        },
        c.transport(),
        plan,
    ))
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

/// The hand-written host program of a GEMM+RS variant (local shapes: `x[M, K/d]`,
/// `w[N, K/d]`, `z[M/d, N]`). The pipeline does not lower the chunked reduce-scatter's
/// schedule (a Stream split outside the DIDx split of the scattered axis) yet, so the chunked
/// variant is written here and checked against [`rsmm_program`] on the CPU backend. The ring
/// is [`rsmm_ring_host`].
pub fn rsmm_host(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: RsVariant,
    parts: Parts,
) -> HostProgram {
    if let RsVariant::Ring(pieces) = variant {
        return keep_parts(&rsmm_ring_host(d, s, dtype, pieces), parts);
    }
    let du = d as u64;
    let kd = s.k / du;
    let (comm, compute) = (parts != Parts::ComputeOnly, parts != Parts::CommOnly);
    let t = dtype.name();
    let chunks = match variant {
        // (The ring returned above.)
        RsVariant::Collective | RsVariant::Ring(_) | RsVariant::Default => 1,
        RsVariant::Chunked(c) => c.max(1),
    };
    let (mc, zc) = (s.m / chunks, s.m / chunks / du);
    let mut p = format!(
        "host rsmm {{\n  mesh m0 = {mesh}\n  in x: {t}[{m}, {kd}] on m0\n  in w: {t}[{n}, {kd}] on m0\n  out z: {t}[{zm}, {n}] on m0\n  tensor y: {t}[{m}, {n}] on m0\n  tensor x_chunk: {t}[{mc}, {kd}] on m0\n  tensor y_chunk: {t}[{mc}, {n}] on m0\n  tensor z_chunk: {t}[{zc}, {n}] on m0\n  allocate y\n",
        mesh = mesh_text(d),
        m = s.m,
        n = s.n,
        zm = s.m / du,
    );
    match variant {
        RsVariant::Collective | RsVariant::Ring(_) | RsVariant::Default => {
            if compute {
                p += "  linear(x, w -> y)\n";
            }
            if comm {
                p += "  c0 = reduce_scatter(y -> z, team=slice(m0, DIDx), op=sum)\n  wait c0\n";
            }
        }
        RsVariant::Chunked(_) => {
            // The GEMMs of the chunks run one after the other on the main stream; the
            // reduce-scatter of chunk i runs on worker 0 once the GEMM of chunk i is done, under
            // the GEMM of chunk i + 1.
            p += &format!(
                "  s0 = get_current_stream\n  for i0 in 0..{chunks} {{\n    x_chunk = shard_by_stream(x, axis=0, chunks={chunks}, index=i0)\n    y_chunk = shard_by_stream(y, axis=0, chunks={chunks}, index=i0)\n"
            );
            if compute {
                p += "    linear(x_chunk, w -> y_chunk)\n";
            }
            if comm {
                p += &format!(
                    "    set_current_stream worker(0)\n    synchronize s0\n    z_chunk = shard_by_stream(z, axis=0, chunks={chunks}, index=i0)\n    c0 = reduce_scatter(y_chunk -> z_chunk, team=slice(m0, DIDx), op=sum)\n    wait c0\n    set_current_stream s0\n"
                );
            }
            p += "  }\n  synchronize worker(0)\n";
        }
    }
    p += "  deallocate y\n}\n";
    parse(&p)
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
                    RsVariant::Chunked(2),
                    RsVariant::Chunked(4),
                    RsVariant::Ring(1),
                    RsVariant::Ring(2),
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
        let comm = rsmm_host(
            2,
            SMALL,
            DType::BF16,
            RsVariant::Chunked(2),
            Parts::CommOnly,
        );
        assert!(!comm.to_string().contains("linear("));
    }
}
