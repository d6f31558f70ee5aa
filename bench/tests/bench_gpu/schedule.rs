//! `meshflow bench schedule` on 2 GPUs at two small shapes, as a smoke test (no timed
//! assertions): four cases in a row in this one process (ranks as threads; the second case of
//! each kind is the one that used to inherit the first one's NCCL communicators and hang);
//! every case is set up once and timed in interleaved rounds; every variant's outputs are
//! checked against the reference; every variant has a figure from each round and rank; the
//! rows have one default row per case, priced with the built-in profile of this GPU model. A
//! short timeout makes a stalled rank fail the case instead of hanging the test.
#![cfg(feature = "cuda")]

use std::time::Duration;

use crate::support::gpu::skip_unless;

use meshflow::passes::profile::DEFAULT;
use meshflow::passes::Profile;
use meshflow_bench::programs::Gemm3;
use meshflow_bench::rows::schedule_rows;
use meshflow_bench::{bench_agmm, bench_rsmm, BenchOptions};

#[test]
fn schedule_cases_are_checked_and_timed_in_rounds() {
    if skip_unless(2, "schedule_cases_are_checked_and_timed_in_rounds") {
        return;
    }
    let opts = BenchOptions {
        ranks: Some(2),
        warmup: 1,
        iterations: 3,
        steps: 2,
        shapes: vec![
            Gemm3 {
                m: 1024,
                k: 512,
                n: 768,
            },
            Gemm3 {
                m: 512,
                k: 512,
                n: 512,
            },
        ],
        parts: true,
        timeout: Duration::from_secs(60),
        ..BenchOptions::default()
    };
    // The default rows are what plain lowering on this machine picks: priced with the built-in
    // profile of this GPU model.
    let name = meshflow::kernels::Device::name_of(0).unwrap();
    let want = match Profile::builtin_for_device(&name) {
        Some(p) => format!("{p}: built-in profile of {name}"),
        None => format!("{DEFAULT}: default, no built-in profile for {name}"),
    };
    let mut cases = bench_agmm(&opts).unwrap();
    cases.extend(bench_rsmm(&opts).unwrap());
    assert_eq!(cases.len(), 4);
    for c in &cases {
        assert!(c.bound_us.is_finite() && c.bound_us > 0.0, "{}", c.table());
        assert!(!c.parts.is_empty(), "{}", c.table());
        for v in &c.variants {
            assert!(v.failure.is_none(), "{}: {:?}", v.name, v.failure);
            assert!(
                v.sampled_rel_err <= 1e-2,
                "{}: {}",
                v.name,
                v.sampled_rel_err
            );
            assert_eq!(v.timing.iterations, 3, "{}", v.name);
            assert_eq!(v.timing.per_rank_median_us.len(), 2, "{}", v.name);
            assert!(v.timing.min_us <= v.timing.us && v.timing.us <= v.timing.max_us);
        }
        let defaults: Vec<_> = c
            .variants
            .iter()
            .filter(|v| v.name.starts_with("default"))
            .collect();
        assert_eq!(defaults.len(), 1, "{}", c.table());
        assert_eq!(c.profile.as_deref(), Some(want.as_str()), "{}", c.table());
        assert!(
            c.table().contains(&format!(
                "The default row is priced with the profile {want}."
            )),
            "{}",
            c.table()
        );
        eprintln!("{}", c.table());
    }
    let rows = schedule_rows(&cases, 1);
    assert!(rows.iter().all(|r| r["us"].is_number() && r["procs"] == 1));
    assert_eq!(rows.iter().filter(|r| r["default"] == true).count(), 4);
}
