//! The GPU MoE transports write `moe_dispatch`'s outputs in place (no copy out of the engine's
//! buffers): MoE layers whose `expert_x`, `expert_counts` and `routing` are poisoned (NaN /
//! `INT_POISON`) just before the dispatch, packed and as a strided view (written through a
//! temporary), bf16 and FP8 dispatch, top-k 1, 2 and 8, uniform and ragged routing (experts
//! and ranks that receive nothing), over NVLink (the automatic choice), NCCL, and NVLink with
//! the step recorded as a CUDA graph, compared with the CPU backend: counts exactly, expert
//! rows as per-expert multisets bit for bit (GPU padding is unspecified and not looked at),
//! `y` within the dtype's tolerance.

use crate::support::gpu::*;
use crate::support::moe::{routing_ids, PoisonedMoe, Route};

use meshflow::ir::DType;
use meshflow::runtime::cuda::{run_cuda_timed, Transport};
use meshflow::runtime::{run_cpu, RunInputs};

#[test]
fn dispatch_writes_poisoned_program_outputs_in_place() {
    let counts = rank_counts("dispatch_writes_poisoned_program_outputs_in_place");
    let seed = 0x5EED_0042;
    for d in counts {
        // (transport forced, graph): the automatic choice is NVLink for d >= 2.
        let runs: &[(Option<Transport>, bool)] = if d >= 2 {
            &[(None, false), (Some(Transport::Nccl), false), (None, true)]
        } else {
            &[(None, false)]
        };
        for &(forced, graph) in runs {
            for k in [1i64, 2, 8] {
                for (wire, h) in [
                    ("", 64),
                    (", wire=f8e4m3, scale=token", 64),
                    (", wire=f8e4m3, scale=block128", 128),
                ] {
                    for route in [Route::Uniform, Route::Ragged] {
                        for strided in [false, true] {
                            let case = PoisonedMoe {
                                d: d as i64,
                                t: 6,
                                e: 8 / d as i64,
                                k,
                                h,
                                f: 32,
                                dtype: DType::BF16,
                                wire,
                                strided,
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
    let mut rng = seed | 1;
    let ids = routing_ids(case.d, case.t, case.e, case.k, route, &mut rng);
    let host = case.host();
    let inputs = case.inputs(&ids, seed);
    let mut co = cpu_options();
    co.ranks = Some(case.d as usize);
    let want = run_cpu(&host, RunInputs::PerRank(inputs.clone()), &co)
        .unwrap_or_else(|e| panic!("{label} on CPU ranks: {e}"));
    let mut o = cuda_options();
    o.ranks = Some(case.d as usize);
    o.config.transport = forced;
    o.config.graph = graph;
    o.config.steps = if graph { 2 } else { 1 };
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
