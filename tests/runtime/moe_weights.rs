//! Where the top-k weights go: with the dispatch when the combine's weights are a program
//! input nothing writes (the evaluator pairs the two), with the combine when the program
//! computes them after the dispatch. Both ways give bit-identical results on 1, 2, 3, 4 and 8
//! sim ranks (top-k 1, 2 and 8; bf16 and FP8 dispatch; uniform and ragged routing) and match
//! the level-1 reference; the trace says which instruction carried the weights. (The same
//! pairs of programs run on GPUs in `tests/gpu/moe_weights.rs`, where the two ways move
//! different bytes.)

use crate::support::moe::{with_late_weights, PoisonedMoe, Route};
use crate::support::runtime as common;

use common::*;
use meshflow::ir::HostProgram;
use meshflow::runtime::backend::MoeWeightsAt;
use meshflow::runtime::{run_and_compare, run_cpu, RunInputs, RunOutcome};

/// Which instruction carried the weights, per MoE event of the trace (one answer expected).
fn carried_by(out: &RunOutcome) -> MoeWeightsAt {
    let trace = out.trace.as_ref().expect("a trace was requested");
    let seen: std::collections::BTreeSet<_> = trace
        .events
        .iter()
        .filter(|e| e.name.starts_with("moe_"))
        .map(|e| e.moe_weights)
        .collect();
    match seen.into_iter().collect::<Vec<_>>()[..] {
        [Some(w)] => w,
        ref other => panic!("MoE events disagree on the weights: {other:?}"),
    }
}

#[test]
fn the_moe_layer_matches_the_reference_with_weights_early_and_late() {
    for d in [1i64, 2, 3, 4, 8] {
        for k in [1i64, 2, 8] {
            let e = (8 + d - 1) / d;
            let l1 = level1(
                "moe_layer.mf",
                &[("d", d), ("t", 5), ("e", e), ("k", k), ("h", 8), ("f", 4)],
            );
            let early = moe_host(d, 5, e, k, 8, 4);
            for (host, how) in [(with_late_weights(&early), "late"), (early, "early")] {
                let cmp = run_and_compare(&l1, &host, d as usize, 3, &options())
                    .unwrap_or_else(|err| panic!("d={d} k={k} {how}: {err}"));
                assert!(cmp.passed(), "d={d} k={k} {how}: {cmp}");
            }
        }
    }
}

#[test]
fn weights_with_the_dispatch_or_the_combine_give_bit_identical_results() {
    let seed = std::env::var("MESHFLOW_MOE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_0019_u64);
    eprintln!("seed {seed} (set MESHFLOW_MOE_SEED to change)");
    let mut traced = options();
    traced.trace = true;
    for d in [1i64, 2, 3, 4, 8] {
        for (k, wire, h) in [
            (1i64, "", 16i64),
            (2, ", wire=f8e4m3, scale=token", 16),
            (8, ", wire=f8e4m3, scale=block128", 128),
        ] {
            for route in [Route::Uniform, Route::Ragged] {
                let case = PoisonedMoe::on_sim_ranks(d, k, h, wire);
                let label = format!("d={d} k={k} wire='{wire}' {route:?}");
                let ids = case.routing_ids(route, seed);
                let run = |host: &HostProgram| {
                    run_cpu(host, RunInputs::PerRank(case.inputs(&ids, seed)), &traced)
                        .unwrap_or_else(|e| panic!("{label}: {e}"))
                };
                let early_host = case.host();
                let (early, late) = (run(&early_host), run(&with_late_weights(&early_host)));
                assert_eq!(carried_by(&early), MoeWeightsAt::Dispatch, "{label}");
                assert_eq!(carried_by(&late), MoeWeightsAt::Combine, "{label}");
                for r in 0..d as usize {
                    let (a, b) = (&early.outputs[&r], &late.outputs[&r]);
                    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
                    for (name, v) in a {
                        assert!(v.bit_eq(&b[name]), "{label} rank {r}: `{name}` differs");
                    }
                }
            }
        }
    }
}
