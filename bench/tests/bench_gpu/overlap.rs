//! Overlap on 2 (and 4) GPUs, measured from per-stream CUDA event timestamps: the column-
//! parallel linear's ring and broadcast all-gathers (over the copy-engine transport, the
//! default between in-process ranks) and the row-parallel linear's reduce-scatter ring
//! (lowered with `ring_forward` forced on the partial sums, over the faster transport: see the
//! test), at sizes where communication and compute take
//! comparable time. Each test checks the outputs
//! (sampled against an f32 CPU reference), that communication and compute intervals intersect
//! on every rank, and that the overlapped time is below 0.85 x (the same schedule's
//! communication alone + its compute alone). Times are per step of [`STEPS`] steps run back to
//! back on warm GPUs (the median over iterations per rank, then the maximum over ranks).
//!
//! The ring test also proves the deferred waits and the double-buffered receive chunks: at
//! d = 2, on every rank, the transfer of chunk `i + 1` runs while the GEMM of chunk `i` runs.
//! (At d = 4 it usually does too, but a pull can only start once the sending rank's stream
//! has reached its offer, and in a single profiled step the ranks' skew can put that after
//! the short first GEMM; there the test checks that the intervals intersect on every rank.)
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use std::collections::BTreeMap;

use meshflow::ir::{DType, HostProgram};
use meshflow::runtime::cuda::{run_cuda_timed, Interval, IntervalKind, TimedRun, Transport};
use meshflow::runtime::data::{SplitMix64, TensorData};
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::RunInputs;
use meshflow_bench::programs::{
    agmm_lowered, gemm_alone_host, rsmm_lowered, AgVariant, Gemm3, Parts, RsVariant,
};
use meshflow_bench::Timing;
use support::*;

type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

const WARMUP: usize = 3;
const ITERS: usize = 10;
/// Worker streams (the pipeline's default).
const STREAMS: usize = 2;
/// Host program steps per timed iteration (back to back; the profiled run has one).
const STEPS: usize = 8;

fn timed(what: &str, host: &HostProgram, d: usize, inputs: PerRank, profile: bool) -> TimedRun {
    timed_over(what, host, d, inputs, profile, None)
}

/// Like [`timed`], with the transport fixed.
fn timed_over(
    what: &str,
    host: &HostProgram,
    d: usize,
    inputs: PerRank,
    profile: bool,
    transport: Option<Transport>,
) -> TimedRun {
    let mut o = cuda_options();
    o.config.transport = transport;
    o.ranks = Some(d);
    o.config.profile = profile;
    o.config.steps = if profile { 1 } else { STEPS };
    run_cuda_timed(host, RunInputs::PerRank(inputs), &o, WARMUP, ITERS)
        .unwrap_or_else(|e| panic!("{what} on {d} GPUs: {e}"))
}

fn random_full(s: Gemm3, seed: u64) -> BTreeMap<String, TensorData> {
    BTreeMap::from([
        (
            "x".to_string(),
            TensorData::random(DType::BF16, &[s.m, s.k], seed).unwrap(),
        ),
        (
            "w".to_string(),
            TensorData::random(DType::BF16, &[s.n, s.k], seed + 1).unwrap(),
        ),
    ])
}

fn replicated(d: usize, entries: &[(&str, Vec<u64>)]) -> PerRank {
    let m: BTreeMap<String, TensorData> = entries
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            (
                n.to_string(),
                TensorData::random(DType::BF16, s, 77 + i as u64).unwrap(),
            )
        })
        .collect();
    (0..d).map(|r| (r, m.clone())).collect()
}

/// Relative error of 256 sampled elements of `out = x @ w^T`.
fn sampled_error(full: &BTreeMap<String, TensorData>, out: &TensorData, s: Gemm3) -> f64 {
    let (x, w) = (&full["x"], &full["w"]);
    let (k, n) = (s.k as usize, s.n as usize);
    let mut rng = SplitMix64::new(5);
    let (mut num, mut den) = (0f64, 0f64);
    for _ in 0..256 {
        let (i, j) = (rng.below(s.m) as usize, rng.below(s.n) as usize);
        let acc: f64 = (0..k)
            .map(|kk| {
                f64::from(x.storage().get_f32(i * k + kk).unwrap())
                    * f64::from(w.storage().get_f32(j * k + kk).unwrap())
            })
            .sum();
        let got = f64::from(out.storage().get_f32(i * n + j).unwrap());
        num += (got - acc).powi(2);
        den += acc * acc;
    }
    (num / den).sqrt()
}

/// Every rank has a communication and a compute interval that intersect.
fn assert_intervals_intersect(name: &str, d: usize, iv: &[Interval]) {
    for rank in 0..d {
        let mine: Vec<&Interval> = iv.iter().filter(|i| i.rank == rank).collect();
        let comms: Vec<&&Interval> = mine
            .iter()
            .filter(|i| i.kind == IntervalKind::Comm)
            .collect();
        let computes: Vec<&&Interval> = mine
            .iter()
            .filter(|i| i.kind == IntervalKind::Compute)
            .collect();
        assert!(
            !comms.is_empty() && !computes.is_empty(),
            "{name}: rank {rank} intervals {mine:?}"
        );
        let hit = comms
            .iter()
            .flat_map(|c| computes.iter().map(move |p| (c, p)))
            .find(|(c, p)| c.stream != p.stream && c.intersects(p));
        let (c, p) = hit.unwrap_or_else(|| {
            panic!("{name}: rank {rank}: no communication overlaps compute: {mine:#?}")
        });
        eprintln!(
            "{name} d={d} rank {rank}: {} [{:.0}, {:.0}] µs on stream {} overlaps {} [{:.0}, {:.0}] µs on stream {}",
            c.name, c.start_us, c.end_us, c.stream, p.name, p.start_us, p.end_us, p.stream
        );
    }
}

fn assert_faster(name: &str, d: usize, both: &Timing, comm: &Timing, compute: &Timing) {
    let limit = 0.85 * (comm.us + compute.us);
    eprintln!(
        "{name} d={d}: overlapped {:.1} µs, comm alone {:.1} µs, compute alone {:.1} µs, ratio to the sum {:.3} (limit 0.85)",
        both.us,
        comm.us,
        compute.us,
        both.us / (comm.us + compute.us)
    );
    assert!(
        both.us < limit,
        "{name} d={d}: {:.1} µs is not below 0.85 x ({:.1} + {:.1}) = {limit:.1} µs",
        both.us,
        comm.us,
        compute.us
    );
}

/// On every rank, for every chunk `i + 1` that arrives from another rank, its communication
/// interval (iteration `i + 1`) intersects the GEMM interval of chunk `i` (iteration `i`) on
/// another stream: the transfer of the next chunk runs under the GEMM of this one.
fn assert_next_transfer_under_gemm(name: &str, d: usize, iv: &[Interval]) {
    for rank in 0..d {
        for i in 0..d as i64 - 1 {
            let comm = iv
                .iter()
                .find(|c| c.rank == rank && c.kind == IntervalKind::Comm && c.iteration == [i + 1]);
            let gemm = iv
                .iter()
                .find(|g| g.rank == rank && g.kind == IntervalKind::Compute && g.iteration == [i]);
            let (Some(c), Some(g)) = (comm, gemm) else {
                panic!(
                    "{name}: rank {rank}: no transfer {} or GEMM {i}: {iv:#?}",
                    i + 1
                );
            };
            eprintln!(
                "{name} d={d} rank {rank}: transfer of chunk {} [{:.0}, {:.0}] µs on stream {}, GEMM of chunk {i} [{:.0}, {:.0}] µs on stream {}",
                i + 1, c.start_us, c.end_us, c.stream, g.start_us, g.end_us, g.stream
            );
            assert!(
                c.stream != g.stream && c.intersects(g),
                "{name}: rank {rank}: the transfer of chunk {} does not run under the GEMM of chunk {i}",
                i + 1
            );
        }
    }
}

fn overlap_counts(test: &str) -> Vec<usize> {
    rank_counts(test).into_iter().filter(|&d| d >= 2).collect()
}

fn column_parallel(variant: AgVariant) {
    let test = format!("column_parallel_{}_overlaps", variant.name());
    let counts = overlap_counts(&test);
    if counts.is_empty() {
        eprintln!("skipped: {test} needs 2 GPUs");
    }
    for d in counts {
        let du = d as u64;
        // AG of 128 MiB of bf16 (64 MiB from each peer at d = 2: ~200 µs over the copy engine,
        // with the local chunk's copy) and a GEMM of 8192 x 8192 x 2048 per rank (~340 µs, two
        // chunks of ~170 µs): comparable times.
        let s = Gemm3 {
            m: 8192,
            k: 8192,
            n: 2048 * du,
        };
        let lower = |parts| agmm_lowered(d, s, DType::BF16, variant, STREAMS, parts).unwrap();
        let l = lower(Parts::Both);
        let full = random_full(s, 1);
        let per_rank = scatter_inputs(&l.program, &full).unwrap();
        let name = format!("agmm {}", variant.name());
        let run = timed(&name, &l.host, d, per_rank.clone(), true);
        let out = run.outcome.gather(&l.program).unwrap();
        let err = sampled_error(&full, &out["y"], s);
        assert!(err < 1e-2, "{name} d={d}: sampled rel err {err:.3e}");
        assert_intervals_intersect(&name, d, &run.intervals);
        if variant == AgVariant::Ring && d == 2 {
            assert_next_transfer_under_gemm(&name, d, &run.intervals);
        }
        let both = Timing::from_times(&timed(&name, &l.host, d, per_rank.clone(), false).times_us);
        let comm = Timing::from_times(
            &timed(&name, &lower(Parts::CommOnly).host, d, per_rank, false).times_us,
        );
        let gemm_in = replicated(d, &[("a", vec![s.m, s.k]), ("w", vec![s.n / du, s.k])]);
        let compute = Timing::from_times(
            &timed(
                "GEMM alone",
                &gemm_alone_host(d, s.m, s.k, s.n / du, DType::BF16),
                d,
                gemm_in,
                false,
            )
            .times_us,
        );
        assert_faster(&name, d, &both, &comm, &compute);
    }
}

#[test]
fn column_parallel_ring_overlaps() {
    column_parallel(AgVariant::Ring);
}

#[test]
fn column_parallel_broadcast_overlaps() {
    column_parallel(AgVariant::Broadcast);
}

#[test]
fn row_parallel_ring_overlaps() {
    let test = "row_parallel_ring_overlaps";
    let counts = overlap_counts(test);
    if counts.is_empty() {
        eprintln!("skipped: {test} needs 2 GPUs");
    }
    for d in counts {
        let du = d as u64;
        // Per rank a GEMM of 8192 x 2048 x 8192 and a reduce-scatter of 128 MiB: comparable.
        let s = Gemm3 {
            m: 8192,
            k: 2048 * du,
            n: 8192,
        };
        let v = RsVariant::Ring(1);
        let lower = |v, parts| rsmm_lowered(d, s, DType::BF16, v, STREAMS, parts).unwrap();
        let l = lower(v, Parts::Both);
        let full = random_full(s, 2);
        let per_rank = scatter_inputs(&l.program, &full).unwrap();
        // Each step GEMMs one row chunk's partial product while the running sum of the previous
        // step travels to the next rank on a worker stream, over the transport whose permutes
        // alone are faster here (what the cost model would pick).
        let comm_only = lower(v, Parts::CommOnly);
        let comm_over = |t| {
            let run = timed_over(
                "rsmm comm alone",
                &comm_only.host,
                d,
                per_rank.clone(),
                false,
                t,
            );
            Timing::from_times(&run.times_us)
        };
        let (ce, nccl) = (
            comm_over(Some(Transport::CopyEngine)),
            comm_over(Some(Transport::Nccl)),
        );
        let (transport, comm) = if ce.us <= nccl.us {
            (Transport::CopyEngine, ce)
        } else {
            (Transport::Nccl, nccl)
        };
        let name = &format!("rsmm ring over {transport:?}");
        let timed = |what: &str, host: &HostProgram, d, inputs, profile| {
            timed_over(what, host, d, inputs, profile, Some(transport))
        };
        let run = timed(name, &l.host, d, per_rank.clone(), true);
        let out = run.outcome.gather(&l.program).unwrap();
        let err = sampled_error(&full, &out["z"], s);
        assert!(err < 1e-2, "{name} d={d}: sampled rel err {err:.3e}");
        assert_intervals_intersect(name, d, &run.intervals);
        let both = Timing::from_times(&timed(name, &l.host, d, per_rank.clone(), false).times_us);
        let compute = Timing::from_times(
            &timed(name, &lower(v, Parts::ComputeOnly).host, d, per_rank, false).times_us,
        );
        assert_faster(name, d, &both, &comm, &compute);
    }
}
