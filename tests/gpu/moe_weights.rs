//! The top-k weights on GPUs: with the dispatch when the combine's weights are a program input
//! nothing writes (they travel with the token rows), with the combine when the program
//! computes them after the dispatch (the engine first copies them to every peer). The same
//! pairs of programs as `tests/runtime/moe_weights.rs`: on 1 and 2 GPUs (and 4 where present),
//! over NVLink (the automatic choice), NCCL, and NVLink as CUDA graph replays; top-k 1, 2 and
//! 8 with bf16 and FP8 dispatch, uniform and ragged routing. Both ways give bit-identical
//! outputs on the GPUs (counts, expert rows and `y`), `y` matches the CPU backend within the
//! dtype's tolerance, and the run reports which instruction carried the weights.

use crate::support::gpu::*;
use crate::support::moe::{with_late_weights, PoisonedMoe, Route};

use meshflow::ir::{DType, HostProgram};
use meshflow::runtime::backend::MoeWeightsAt;
use meshflow::runtime::cuda::{run_cuda_timed, Transport};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::RunInputs;

use std::collections::BTreeMap;

type Outputs = BTreeMap<usize, BTreeMap<String, TensorData>>;

#[test]
fn moe_weights_early_and_late_match_bit_for_bit_on_gpus() {
    let seed = 0x5EED_0019;
    for d in rank_counts("moe_weights_early_and_late_match_bit_for_bit_on_gpus") {
        for &(forced, graph) in moe_runs(d) {
            for (k, wire, h) in [
                (1i64, "", 64i64),
                (2, ", wire=f8e4m3, scale=token", 64),
                (8, ", wire=f8e4m3, scale=block128", 128),
            ] {
                for route in [Route::Uniform, Route::Ragged] {
                    let case = PoisonedMoe::on_gpus(d, k, h, wire);
                    let label =
                        format!("d={d} {forced:?} graph={graph} k={k} wire='{wire}' {route:?}");
                    check(&case, &label, route, forced, graph, seed);
                }
            }
        }
    }
}

fn check(
    case: &PoisonedMoe,
    label: &str,
    route: Route,
    forced: Option<Transport>,
    graph: bool,
    seed: u64,
) {
    let ids = case.routing_ids(route, seed);
    let inputs = case.inputs(&ids, seed);
    let early = case.host();
    let late = with_late_weights(&early);
    let want = run_on_cpu_ranks(&early, case.d as usize, inputs.clone(), label);
    let gpu = |host: &HostProgram, how: MoeWeightsAt| -> Outputs {
        let o = moe_run_options(case.d as usize, forced, graph);
        let run = run_cuda_timed(host, RunInputs::PerRank(inputs.clone()), &o, 0, 1)
            .unwrap_or_else(|e| panic!("{label} weights at the {}: {e}", how.name()));
        for (rank, list) in &run.transports {
            for c in list.iter().filter(|c| c.name.starts_with("moe_")) {
                assert_eq!(
                    c.moe_weights,
                    Some(how),
                    "{label} rank {rank}: {} carried the weights with the wrong instruction",
                    c.name
                );
            }
        }
        run.outcome.outputs
    };
    let (a, b) = (
        gpu(&early, MoeWeightsAt::Dispatch),
        gpu(&late, MoeWeightsAt::Combine),
    );
    for r in 0..case.d as usize {
        let (ea, lb, w) = (&a[&r], &b[&r], &want.outputs[&r]);
        assert!(
            ea["expert_counts"].bit_eq(&lb["expert_counts"]),
            "{label} rank {r}: counts differ between early and late weights"
        );
        assert_eq!(
            case.expert_rows(ea),
            case.expert_rows(lb),
            "{label} rank {r}: expert rows differ between early and late weights"
        );
        assert!(
            ea["y"].bit_eq(&lb["y"]),
            "{label} rank {r}: y differs between early and late weights"
        );
        let err = ea["y"].rel_error(&w["y"]).unwrap();
        assert!(
            err <= tol(DType::BF16),
            "{label} rank {r}: y rel err {err:.3e} against the CPU backend"
        );
    }
    eprintln!("{label}: early and late weights bit-identical");
}
