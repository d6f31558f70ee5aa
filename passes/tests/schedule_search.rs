//! The schedule search on the committed profiles (`profiles/*.json`): what it picks for the
//! cases of the benchmarks, and whether its predicted order of the variants agrees with the
//! order measured on the machine of each profile, 2x H200 and 2x H100 (`bench/results/`).

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
            for m in [4, 8] {
                // The collective, over whichever transport moves it faster. AG+GEMM on the
                // calibrated pairs is the exception at d = 2: the copy-engine permute of a few
                // KiB (14.6 us at 64 KiB on H200, 19.0 on H100) under a chunk GEMM is predicted
                // to beat NCCL's all-gather plus the GEMM at every M (not measured at such M
                // yet).
                let (a, _) = search(&agmm(d, m * d, 8192, 8192), profile);
                let ring_expected = d == 2;
                assert_eq!(
                    a[0].chosen.starts_with("collective(s=1, "),
                    !ring_expected,
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
fn large_m_picks_a_copy_engine_ring() {
    // AG+GEMM at 16384x8192x8192 and 8192^3 on 2 ranks, over the copy engine. On the
    // calibrated H200 pair the per-iteration ring's two GEMMs run on two workers and the second
    // fills the first's tail (`gemm_overlap` 0.13): it is predicted within 1 % of the prefetched
    // ring, just under it at 16384 and just over it at 8192^3, the order measured in
    // interleaved rounds on 2026-11-26 (the per-iteration ring 1.5-5.8 % faster at 16384 in
    // two runs; 2.3-4.0 % slower at 8192^3 in the first, level in the second). On the
    // calibrated H100 pair the fitted overlap is smaller (0.11, the median of a 16384 that
    // measured the per-iteration ring 0.2-0.4 % faster and an 8192^3 that measured it 4.4-5.2 %
    // slower, 2026-11-26): the per-iteration ring is predicted 1-3 % over the prefetched ring
    // at both sizes, and the prefetched ring is kept.
    for profile in PROFILES {
        for m in [16384, 8192] {
            let (a, cx) = search(&agmm(2, m, 8192, 8192), profile);
            let (chosen, schedule) = match (profile, m) {
                ("h200x2", 16384) => (
                    "ring(s=2, per-iteration, copy_engine)",
                    StreamSchedule::PerIteration,
                ),
                _ => ("ring(s=2, prefetch, copy_engine)", StreamSchedule::Prefetch),
            };
            assert_eq!(a[0].chosen, chosen, "{profile}: {}", a[0]);
            assert_eq!(cx.transport, Some(Transport::CopyEngine));
            let plan = cx.plans["x_gathered"];
            assert_eq!(plan.schedule, schedule);
            let cost = |label: &str| {
                a[0].variants
                    .iter()
                    .find(|v| v.variant == label)
                    .and_then(|v| v.cost_us)
                    .unwrap()
            };
            // The forwarding ring is priced as the prefetched ring (to the cent).
            let fwd = cost("ring_forward(s=2, prefetch, copy_engine)");
            assert!((fwd - cost("ring(s=2, prefetch, copy_engine)")).abs() < 0.01);
            let per_iteration = cost("ring(s=2, per-iteration, copy_engine)");
            if profile == "h200x2" {
                assert!((per_iteration / fwd - 1.0).abs() < 0.01, "{}", a[0]);
            } else {
                let over = per_iteration / fwd;
                assert!(over > 1.01 && over < 1.03, "{}", a[0]);
            }
            // Over NCCL and the collective are predicted slower, as measured.
            assert!(cost("ring(s=2, prefetch, nccl)") > fwd * 1.1);
            assert!(cost("collective(s=1, nccl)") > fwd * 1.2);
        }
    }
}

#[test]
fn gemm_overlap_prices_only_gemms_on_different_workers() {
    // One worker stream: the per-iteration ring runs its iterations one after the other on it,
    // so nothing overlaps (neither the transfer nor the GEMMs) and the overlap changes nothing.
    let program = agmm(2, 16384, 8192, 8192);
    let cost = |streams: usize, overlap: f64| {
        let mut profile = Profile::builtin("h200x2").unwrap();
        for t in profile.transports.values_mut() {
            t.gemm_overlap = overlap;
        }
        let options = PassOptions {
            num_streams: streams,
            cost_model: CostModel::new(profile),
            decompositions: [("x_gathered".to_string(), Decomposition::Ring)].into(),
            stream_schedule: StreamSchedule::PerIteration,
            ..PassOptions::default()
        };
        let out = common::all_passes().run(program.clone(), &options).unwrap();
        out.explain[0]
            .variants
            .iter()
            .find(|v| v.variant == "ring(s=2, per-iteration, copy_engine)")
            .and_then(|v| v.cost_us)
            .unwrap()
    };
    assert_eq!(cost(1, 0.0), cost(1, 0.5));
    // Two workers: the transfer runs beside the first GEMM, and the second GEMM starts under
    // the first one's tail, by the overlap times one chunk GEMM (690.8 us).
    assert!(cost(2, 0.0) < cost(1, 0.0));
    let gain = cost(2, 0.0) - cost(2, 0.13);
    assert!((gain - 0.13 * 690.8).abs() < 1.0, "{gain}");
}

#[test]
fn gemm_rs_picks_the_ring_of_running_sums() {
    // On both pairs: the copy-engine ring accumulating in place, 2 pieces per step, the
    // fastest variant measured at both sizes in both process modes on 2026-11-26.
    for profile in PROFILES {
        for m in [16384, 8192] {
            let (r, cx) = search(&rsmm(2, m, 8192, 8192), profile);
            let plan = cx.plans["y"];
            assert_eq!(plan.decomposition, Decomposition::RingForward, "{}", r[0]);
            assert_eq!(plan.transport, Transport::CopyEngine, "{}", r[0]);
            assert_eq!(
                r[0].chosen, "ring_forward(s=4, prefetch, copy_engine, accumulate)",
                "{profile}: {}",
                r[0]
            );
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
        ("rsmm", "ring accumulate pieces=2 (copy engine)") => {
            "ring_forward(s=4, prefetch, copy_engine, accumulate)"
        }
        ("rsmm", "ring accumulate pieces=4 (copy engine)") => {
            "ring_forward(s=8, prefetch, copy_engine, accumulate)"
        }
        _ => return None,
    })
}

/// The measurement files of the current schedules (the older files time superseded versions
/// of the chunked reduce-scatter and of the prefetch schedule): `meshflow bench agmm|rsmm`
/// results (`{"cases": [...]}`).
const MEASURED: [&str; 3] = [
    "2026-11-22-h200x2-ce-ceiling-agmm.json",
    "2026-11-22-h200x2-rings-rsmm.json",
    "2026-11-22-h200x2-rings-pieces-rsmm.json",
];

/// `meshflow bench schedule` rows (a list of `{case, world, variant, procs, default, us, ...}`),
/// `bench/results/<date>-<profile>-schedule.json` and `<date>-<profile>-schedule-<what>.json`
/// (repeats, other settings): every file of a machine a committed profile describes is read,
/// with the name of that profile.
fn schedule_files(dir: &str) -> Vec<(String, &'static str)> {
    let mut files: Vec<(String, &'static str)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| {
            let profile = PROFILES.into_iter().find(|p| {
                let stem = format!("-{p}-schedule");
                f.ends_with(&format!("{stem}.json"))
                    || (f.contains(&format!("{stem}-")) && f.ends_with(".json"))
            })?;
            Some((f, profile))
        })
        .collect();
    files.sort();
    files
}

/// Pairs of variants measured further apart than this are expected in the same order: the
/// spread of one program measured twice in one run (up to 4 % before the benchmark timed every
/// variant in interleaved rounds, see `bench/README.md`) is not an order.
const NOISE: f64 = 1.05;

/// Pairs that two measurement files order the opposite way: no model agrees with both. The
/// per-iteration copy-engine ring against the prefetched and the forwarding ring at 16384 was
/// 5.2 % slower on 2026-11-22 (variants timed one after another, before the copy engine's
/// rework of 2026-11-25) and is 3.1-3.2 % faster in the 2026-11-26 rows with one process per
/// GPU (4.9-5.6 % in an earlier run that day; interleaved rounds, which share the machine's
/// drift). The model
/// follows the newer rows (the profile's `gemm_overlap`, see its notes). Listed by the older
/// file; [`the_conflicting_pairs_are_measured_both_ways`] checks that the newer file really
/// orders each of them the other way round.
const CONFLICTING: [(&str, &str, &str, u64); 2] = [
    (
        "2026-11-22-h200x2-ce-ceiling-agmm.json",
        "ring (copy engine)",
        "ring forward (copy engine)",
        16384,
    ),
    (
        "2026-11-22-h200x2-ce-ceiling-agmm.json",
        "ring (copy engine)",
        "ring, prefetch schedule (copy engine)",
        16384,
    ),
];

/// Pairs the model orders wrongly, by measurement file (both process modes), bench, rows and
/// the two variants: neither is a plan the search picks (both are 1.25x of the chosen plan or
/// more). On 2x H200 the NCCL ring's time moves by more than the pair's gap between runs
/// (GEMM+RS at 16384 over NCCL send/recv, one process: 2056.3 us in an earlier run on
/// 2026-11-26, 1940.3 and 1961.8 us in two later ones, against 2027-2095 us for the
/// copy-engine collective). On 2x H100 (one run) the NCCL ring of GEMM+RS at 16384 measured
/// 8.7-10.4 % faster than the NCCL collective and is predicted 0.6 % slower: the ring measured
/// 405-462 us over the GEMM alone and is predicted 620 us over it (its transfers slow the
/// GEMM by `transfer_first` = 0.85 of their time, the H200 fit the H100 profile keeps), while
/// the collective's extra time is predicted right (608 us; the reduce-scatter alone measured
/// 635-638 us); the two later H100 files of that day measured the same pair the same way.
const MODEL_ERRORS: [(&str, &str, u64, &str, &str); 4] = [
    (
        "2026-11-26-h200x2-schedule.json",
        "rsmm",
        16384,
        "collective (copy engine)",
        "ring (NCCL send/recv)",
    ),
    (
        "2026-11-26-h100x2-schedule.json",
        "rsmm",
        16384,
        "collective (NCCL)",
        "ring (NCCL send/recv)",
    ),
    (
        "2026-11-26-h100x2-schedule-repeat.json",
        "rsmm",
        16384,
        "collective (NCCL)",
        "ring (NCCL send/recv)",
    ),
    (
        "2026-11-26-h100x2-schedule-device-profile.json",
        "rsmm",
        16384,
        "collective (NCCL)",
        "ring (NCCL send/recv)",
    ),
];

/// Compares the measured and predicted (with the built-in `profile`) order of every pair of
/// `measured` variants (name, µs) of one case further apart than [`NOISE`]; returns the pairs
/// compared.
fn compare_orders(
    what: &str,
    profile: &str,
    bench: &str,
    dims: [u64; 4],
    measured: &[(String, f64)],
    wrong: &mut Vec<String>,
) -> usize {
    let [m, k, n, world] = dims;
    assert_eq!(world, 2, "{what}: the {profile} profile describes 2 GPUs");
    let program = if bench == "agmm" {
        agmm(world, m, k, n)
    } else {
        rsmm(world, m, k, n)
    };
    let (records, _) = search(&program, profile);
    let record = &records[0];
    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    for (name, us) in measured {
        let Some(label) = label(bench, name) else {
            continue;
        };
        let predicted = record
            .variants
            .iter()
            .find(|c| c.variant == label)
            .and_then(|c| c.cost_us)
            .unwrap_or_else(|| panic!("{what}: no candidate {label}\n{record}"));
        rows.push((name, *us, predicted));
    }
    assert!(rows.len() >= 4, "{what} {bench} {m}: {rows:?}");
    let mut compared = 0;
    for (i, a) in rows.iter().enumerate() {
        for b in &rows[i + 1..] {
            if a.1.max(b.1) / a.1.min(b.1) < NOISE {
                continue;
            }
            compared += 1;
            let known = CONFLICTING.iter().any(|&(f, x, y, rows)| {
                what.starts_with(f)
                    && rows == m
                    && ((a.0 == x && b.0 == y) || (a.0 == y && b.0 == x))
            });
            let model_error = MODEL_ERRORS.iter().any(|&(f, bn, rows, x, y)| {
                what.starts_with(f)
                    && bench == bn
                    && rows == m
                    && ((a.0 == x && b.0 == y) || (a.0 == y && b.0 == x))
            });
            if known || model_error {
                continue;
            }
            if (a.1 < b.1) != (a.2 < b.2) {
                wrong.push(format!(
                    "{what} {bench} {m}: measured {} {:.1} vs {} {:.1} us, predicted {:.1} vs {:.1}",
                    a.0, a.1, b.0, b.1, a.2, b.2
                ));
            }
        }
    }
    compared
}

#[test]
fn predicted_and_measured_orders_agree_on_the_committed_measurements() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results");
    // Every pair predicted in the wrong order, reported together.
    let mut wrong: Vec<String> = Vec::new();
    let mut compared = 0;
    for file in MEASURED {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        for case in json["cases"].as_array().unwrap() {
            let bench = case["bench"].as_str().unwrap();
            let dim = |k: &str| case[k].as_u64().unwrap();
            let (m, k, n, world) = (dim("m"), dim("k"), dim("n"), dim("world"));
            let mut measured = Vec::new();
            for v in case["variants"].as_array().unwrap() {
                let name = v["name"].as_str().unwrap();
                let Some(us) = v["timing"]["us"].as_f64() else {
                    continue;
                };
                if name.starts_with("collective (NCCL all_gather)") {
                    // Measured below the sum of its parts (all-gather alone + GEMM alone),
                    // which a program computing on the gathered data cannot do; likely the
                    // all-gather of step k + 1 (it depends only on the input) runs under step
                    // k's GEMM in the benchmark's back-to-back steps. Not compared.
                    let alone =
                        case["comm"]["us"].as_f64().unwrap() + case["gemm"]["us"].as_f64().unwrap();
                    assert!(us < 0.9 * alone, "{file} {m}: {us} vs {alone}");
                    continue;
                }
                measured.push((name.to_string(), us));
            }
            compared += compare_orders(
                file,
                "h200x2",
                bench,
                [m, k, n, world],
                &measured,
                &mut wrong,
            );
        }
    }
    // The pairs apart by more than the noise: 30 + 29 (AG+GEMM, 16384 and 8192), 5 + 5 (GEMM+RS
    // rings session), 8 + 8 (pieces session).
    assert_eq!(compared, 85);
    // Pairs of schedule rows compared, by profile.
    let mut rows_compared: std::collections::BTreeMap<&str, usize> = Default::default();
    for (file, profile) in schedule_files(dir) {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        let rows: Value = serde_json::from_str(&text).unwrap();
        // One case of one process mode at a time.
        let mut cases: std::collections::BTreeMap<(String, u64), Vec<(String, f64)>> =
            Default::default();
        for r in rows.as_array().unwrap() {
            let (Some(case), Some(variant)) = (r["case"].as_str(), r["variant"].as_str()) else {
                panic!("{file}: a row without case or variant: {r}");
            };
            let Some(us) = r["us"].as_f64() else {
                continue;
            };
            // The default row is the same plan as a labelled row (compared there); the NCCL
            // all-gather collective is not compared (see above).
            if r["default"] == true || variant.starts_with("collective (NCCL all_gather)") {
                continue;
            }
            assert_eq!(r["world"], 2, "{file}: {r}");
            let procs = r["procs"].as_u64().unwrap();
            cases
                .entry((case.to_string(), procs))
                .or_default()
                .push((variant.to_string(), us));
        }
        for ((case, procs), measured) in cases {
            let (bench, dims) = case.split_once('_').unwrap();
            let d: Vec<u64> = dims.split('x').map(|x| x.parse().unwrap()).collect();
            let what = format!("{file} procs={procs}");
            *rows_compared.entry(profile).or_default() += compare_orders(
                &what,
                profile,
                bench,
                [d[0], d[1], d[2], 2],
                &measured,
                &mut wrong,
            );
        }
    }
    assert!(
        wrong.is_empty(),
        "{} pairs predicted in the wrong order:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // Pairs compared: every H200 file (2026-11-25: 8192^3 in one process; the two of
    // 2026-11-26: both sizes, both cases, both process modes) and the three H100 files of
    // 2026-11-26 (the same four cases and two modes each).
    assert!(rows_compared["h200x2"] >= 362, "{rows_compared:?}");
    assert!(rows_compared["h100x2"] >= 500, "{rows_compared:?}");
}

#[test]
fn the_conflicting_pairs_are_measured_both_ways() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results");
    let read = |file: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/{file}")).unwrap()).unwrap()
    };
    let newer = read("2026-11-26-h200x2-schedule.json");
    for (file, x, y, m) in CONFLICTING {
        let older = read(file);
        let case = older["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["m"] == m)
            .unwrap();
        let us = |name: &str| {
            case["variants"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == name)
                .and_then(|v| v["timing"]["us"].as_f64())
                .unwrap()
        };
        let old = us(x) / us(y);
        // The newer rows: one process per GPU, the same case.
        let row = |name: &str| {
            newer
                .as_array()
                .unwrap()
                .iter()
                .find(|r| {
                    r["case"] == format!("agmm_{m}x8192x8192")
                        && r["procs"] == 2
                        && r["variant"] == name
                })
                .and_then(|r| r["us"].as_f64())
                .unwrap()
        };
        let new = row(x) / row(y);
        // The newer rows order the pair the other way round (the per-iteration ring 3.2 %
        // ahead of the forwarding ring and 3.1 % ahead of the prefetched one; 5.6 % and 4.9 %
        // in an earlier run of the same day).
        assert!(
            old > NOISE && new < 1.0 / 1.02,
            "{file} {x} / {y}: {old:.3} there, {new:.3} in 2026-11-26"
        );
    }
}
