//! The GPU MoE transports write `moe_dispatch`'s outputs in place (no copy out of the engine's
//! buffers): MoE layers whose `expert_x`, `expert_counts` and `routing` are poisoned (NaN /
//! `INT_POISON`) just before the dispatch, packed and as a strided view (written through a
//! temporary), bf16 and FP8 dispatch, top-k 1, 2 and 8, uniform and ragged routing (experts
//! and ranks that receive nothing), over NVLink (the automatic choice), NCCL, and NVLink with
//! the step recorded as a CUDA graph, compared with the CPU backend: counts exactly, expert
//! rows as per-expert multisets bit for bit (GPU padding is unspecified and not looked at),
//! `y` within the dtype's tolerance.

use crate::support::gpu::*;
use crate::support::moe::{PoisonedMoe, Route};

use meshflow::ir::DType;
use meshflow::runtime::cuda::{run_cuda_timed, Transport};
use meshflow::runtime::RunInputs;

#[test]
fn dispatch_writes_poisoned_program_outputs_in_place() {
    let counts = rank_counts("dispatch_writes_poisoned_program_outputs_in_place");
    let seed = 0x5EED_0042;
    for d in counts {
        // (transport forced, graph): the automatic choice is NVLink for d >= 2.
        for &(forced, graph) in moe_runs(d) {
            for k in [1i64, 2, 8] {
                for (wire, h) in [
                    ("", 64),
                    (", wire=f8e4m3, scale=token", 64),
                    (", wire=f8e4m3, scale=block128", 128),
                ] {
                    for route in [Route::Uniform, Route::Ragged] {
                        for strided in [false, true] {
                            let case = PoisonedMoe {
                                strided,
                                ..PoisonedMoe::on_gpus(d, k, h, wire)
                            };
                            let label = format!(
                                "d={d} {forced:?} graph={graph} k={k} wire='{wire}' {route:?} \
                                 strided={strided}"
                            );
                            check(&case, &label, route, forced, graph, seed);
                        }
                    }
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
    let host = case.host();
    let inputs = case.inputs(&ids, seed);
    let want = run_on_cpu_ranks(&host, case.d as usize, inputs.clone(), label);
    let o = moe_run_options(case.d as usize, forced, graph);
    let run = run_cuda_timed(&host, RunInputs::PerRank(inputs), &o, 0, 1)
        .unwrap_or_else(|e| panic!("{label} on GPUs: {e}"));
    let used: Vec<_> = run.transports[&0]
        .iter()
        .filter(|c| c.name.starts_with("moe_"))
        .map(|c| c.transport)
        .collect();
    let got = &run.outcome.outputs;
    for r in 0..case.d as usize {
        let (g, w) = (&got[&r], &want.outputs[&r]);
        assert!(
            g["expert_counts"].bit_eq(&w["expert_counts"]),
            "{label} rank {r}: counts {:?} vs {:?}",
            g["expert_counts"].storage().to_i64_vec(),
            w["expert_counts"].storage().to_i64_vec()
        );
        assert_eq!(
            case.expert_rows(g),
            case.expert_rows(w),
            "{label} rank {r}: expert rows differ"
        );
        let err = g["y"].rel_error(&w["y"]).unwrap();
        assert!(
            err <= tol(DType::BF16),
            "{label} rank {r}: y rel err {err:.3e}"
        );
    }
    eprintln!("{label}: ok over {used:?}");
}
