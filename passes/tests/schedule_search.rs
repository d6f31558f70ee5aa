//! The schedule search on the committed profiles (`profiles/*.json`): what it picks for the
//! cases of the benchmarks, and whether its predicted order of the variants agrees with the
//! order measured on 2x H200 (`bench/results/`).

mod common;

use meshflow_ir::{DType, ParallelType::DIDx, Program};
use meshflow_passes::{
    CostModel, Decomposition, ExplainRecord, PassOptions, PassOutput, Profile, StreamSchedule,
    Transport,
};
use serde_json::Value;

/// `y = linear(x, w)`, `x` and `w` split on rows: the all-gather of `x` (`x_gathered`) is the
/// search's. Bf16, full sizes `m x k` and `n x k`.
fn agmm(d: u64, m: u64, k: u64, n: u64) -> Program {
    let (mut b, mesh) = common::builder("agmm", d as usize);
    let x = b.input("x", DType::BF16, &[m, k], mesh).unwrap();
    let w = b.input("w", DType::BF16, &[n, k], mesh).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

/// `y = linear(x, w)` split on `k` (partial sums, the search's), `z = set(y)` split on rows.
fn rsmm(d: u64, m: u64, k: u64, n: u64) -> Program {
    let (mut b, mesh) = common::builder("rsmm", d as usize);
    let x = b.input("x", DType::BF16, &[m, k], mesh).unwrap();
    let w = b.input("w", DType::BF16, &[n, k], mesh).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    let z = b.set(y).unwrap();
    b.rename(z, "z").unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
    b.build().unwrap()
}

/// The decision records of compiling `p` with the built-in `profile`.
fn search(p: &Program, profile: &str) -> (Vec<ExplainRecord>, PassOutput) {
    let options = PassOptions {
        cost_model: CostModel::new(Profile::builtin(profile).unwrap()),
        ..PassOptions::default()
    };
    let out = common::all_passes()
        .run(p.clone(), &options)
        .unwrap_or_else(|e| panic!("{profile}: {e}"));
    (out.explain.clone(), out)
}

const PROFILES: [&str; 2] = ["h200x2", "h100x2"];

#[test]
fn small_m_picks_the_collective() {
    for profile in PROFILES {
        for d in [2, 4, 8] {
            for m in [32, 64] {
                // The collective, over whichever transport moves it faster.
                let (a, _) = search(&agmm(d, m * d, 8192, 8192), profile);
                assert!(
                    a[0].chosen.starts_with("collective(s=1, "),
                    "{profile}: {}",
                    a[0]
                );
                let (r, _) = search(&rsmm(d, m * d, 8192, 8192), profile);
                assert!(
                    r[0].chosen.starts_with("collective(s=1, "),
                    "{profile}: {}",
                    r[0]
                );
            }
        }
    }
}

#[test]
fn large_m_picks_the_prefetched_ring_on_the_copy_engine() {
    // AG+GEMM at 16384x8192x8192 and 8192^3 on 2 ranks: measured fastest on 2x H200 were the
    // prefetched ring and the forwarding ring (same schedule at d = 2, 1.01x / 1.05x of the
    // bound); the search predicts them equal and takes the simpler, over the copy engine.
    for profile in PROFILES {
        for m in [16384, 8192] {
            let (a, cx) = search(&agmm(2, m, 8192, 8192), profile);
            assert_eq!(
                a[0].chosen, "ring(s=2, prefetch, copy_engine)",
                "{profile}: {}",
                a[0]
            );
            assert_eq!(cx.transport, Some(Transport::CopyEngine));
            let plan = cx.plans["x_gathered"];
            assert_eq!(plan.schedule, StreamSchedule::Prefetch);
            // The forwarding ring is priced the same (to the cent).
            let cost = |label: &str| {
                a[0].variants
                    .iter()
                    .find(|v| v.variant == label)
                    .and_then(|v| v.cost_us)
                    .unwrap()
            };
            let fwd = cost("ring_forward(s=2, prefetch, copy_engine)");
            assert!((fwd - cost("ring(s=2, prefetch, copy_engine)")).abs() < 0.01);
            // Per iteration and over NCCL are predicted slower, as measured.
            assert!(cost("ring(s=2, per-iteration, copy_engine)") > fwd * 1.04);
            assert!(cost("ring(s=2, prefetch, nccl)") > fwd * 1.1);
            assert!(cost("collective(s=1, nccl)") > fwd * 1.2);
        }
    }
}

#[test]
fn gemm_rs_picks_the_ring_of_running_sums() {
    for profile in PROFILES {
        for m in [16384, 8192] {
            let (r, cx) = search(&rsmm(2, m, 8192, 8192), profile);
            let plan = cx.plans["y"];
            assert_eq!(plan.decomposition, Decomposition::RingForward, "{}", r[0]);
            assert_eq!(plan.transport, Transport::CopyEngine, "{}", r[0]);
            assert_eq!(r[0].tensor, "y");
        }
    }
}

#[test]
fn the_decisions_of_a_program_share_one_transport() {
    // Two all-gathers, one small and one large: the transport of least total wins for both.
    let (mut b, mesh) = common::builder("two", 2);
    let x = b.input("x", DType::BF16, &[16384, 8192], mesh).unwrap();
    let w = b.input("w", DType::BF16, &[8192, 8192], mesh).unwrap();
    let s = b.input("s", DType::BF16, &[64, 8192], mesh).unwrap();
    for t in [x, w, s] {
        b.schedule(t).outer_split(0, 2).parallelize(0, DIDx);
    }
    let y = b.linear(x, w).unwrap();
    let u = b.linear(s, w).unwrap();
    b.output(y);
    b.output(u);
    let p = b.build().unwrap();
    let (records, cx) = search(&p, "h200x2");
    let transports: Vec<Transport> = cx.plans.values().map(|p| p.transport).collect();
    assert!(transports.len() >= 2, "{records:?}");
    assert!(
        transports.iter().all(|&t| Some(t) == cx.transport),
        "{records:?}"
    );
    let last = records.last().unwrap();
    assert_eq!(last.communication, "transport");
    assert_eq!(last.variants.len(), 2);
}

/// A variant of the committed benchmark JSON, as the search names its plan.
fn label(bench: &str, variant: &str) -> Option<&'static str> {
    Some(match (bench, variant) {
        ("agmm", "broadcast (NCCL)") => "broadcast(s=2, per-iteration, nccl)",
        ("agmm", "broadcast (copy engine)") => "broadcast(s=2, per-iteration, copy_engine)",
        ("agmm", "ring (NCCL send/recv)") => "ring(s=2, per-iteration, nccl)",
        ("agmm", "ring (copy engine)") => "ring(s=2, per-iteration, copy_engine)",
        ("agmm", "ring, prefetch schedule (copy engine)") => "ring(s=2, prefetch, copy_engine)",
        ("agmm", "ring forward (NCCL send/recv)") => "ring_forward(s=2, prefetch, nccl)",
        ("agmm", "ring forward (copy engine)") => "ring_forward(s=2, prefetch, copy_engine)",
        ("agmm", "bidirectional ring (NCCL send/recv)") => {
            "ring_bidirectional(s=4, prefetch, nccl)"
        }
        ("agmm", "bidirectional ring (copy engine)") => {
            "ring_bidirectional(s=4, prefetch, copy_engine)"
        }
        ("rsmm", "collective (NCCL)") => "collective(s=1, nccl)",
        ("rsmm", "collective (copy engine)") => "collective(s=1, copy_engine)",
        ("rsmm", "ring (NCCL send/recv)") => "ring_forward(s=2, prefetch, nccl)",
        ("rsmm", "ring (copy engine)") => "ring_forward(s=2, prefetch, copy_engine)",
        ("rsmm", "ring pieces=4 (copy engine)") => "ring_forward(s=8, prefetch, copy_engine)",
        _ => return None,
    })
}

/// The measurement files of the current schedules (the older files time superseded versions
/// of the chunked reduce-scatter and of the prefetch schedule).
const MEASURED: [&str; 3] = [
    "2026-11-22-h200x2-ce-ceiling-agmm.json",
    "2026-11-22-h200x2-rings-rsmm.json",
    "2026-11-22-h200x2-rings-pieces-rsmm.json",
];

/// Pairs of variants measured further apart than this are expected in the same order.
const NOISE: f64 = 1.05;

#[test]
fn predicted_and_measured_orders_agree_on_the_committed_measurements() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results");
    let mut compared = 0;
    for file in MEASURED {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        for case in json["cases"].as_array().unwrap() {
            let bench = case["bench"].as_str().unwrap();
            let dim = |k: &str| case[k].as_u64().unwrap();
            let (m, k, n, world) = (dim("m"), dim("k"), dim("n"), dim("world"));
            assert_eq!(world, 2, "{file}: the H200 profile describes 2 GPUs");
            let program = if bench == "agmm" {
                agmm(world, m, k, n)
            } else {
                rsmm(world, m, k, n)
            };
            let (records, _) = search(&program, "h200x2");
            let record = &records[0];
            let mut rows: Vec<(&str, f64, f64)> = Vec::new();
            for v in case["variants"].as_array().unwrap() {
                let name = v["name"].as_str().unwrap();
                let Some(measured) = v["timing"]["us"].as_f64() else {
                    continue;
                };
                if name.starts_with("collective (NCCL all_gather)") {
                    // Measured below the sum of its parts (all-gather alone + GEMM alone),
                    // which a program computing on the gathered data cannot do; likely the
                    // all-gather of step k + 1 (it depends only on the input) runs under step
                    // k's GEMM in the benchmark's back-to-back steps. Not compared.
                    let alone =
                        case["comm"]["us"].as_f64().unwrap() + case["gemm"]["us"].as_f64().unwrap();
                    assert!(measured < 0.9 * alone, "{file} {m}: {measured} vs {alone}");
                    continue;
                }
                let Some(label) = label(bench, name) else {
                    continue;
                };
                let predicted = record
                    .variants
                    .iter()
                    .find(|c| c.variant == label)
                    .and_then(|c| c.cost_us)
                    .unwrap_or_else(|| panic!("{file}: no candidate {label}\n{record}"));
                rows.push((name, measured, predicted));
            }
            assert!(rows.len() >= 4, "{file} {bench} {m}: {rows:?}");
            for (i, a) in rows.iter().enumerate() {
                for b in &rows[i + 1..] {
                    if a.1.max(b.1) / a.1.min(b.1) < NOISE {
                        continue;
                    }
                    compared += 1;
                    assert_eq!(
                        a.1 < b.1,
                        a.2 < b.2,
                        "{file} {bench} {m}: measured {} {:.1} vs {} {:.1} us, predicted {:.1} vs {:.1}",
                        a.0,
                        a.1,
                        b.0,
                        b.1,
                        a.2,
                        b.2
                    );
                }
            }
        }
    }
    // The pairs apart by more than the noise: 30 + 29 (AG+GEMM, 16384 and 8192), 5 + 5 (GEMM+RS
    // rings session), 8 + 8 (pieces session).
    assert_eq!(compared, 85);
}
