//! MoE dispatch/combine on sim ranks against the level-1 reference: top-k 1, 2, 8; E = W,
//! E = 256 and E = 2048; ragged routing (experts receiving nothing, ranks sending and receiving
//! nothing); capacity overflow; bf16 and FP8 dispatch on 1, 2, 3, 4 and 8 ranks with fresh
//! random inputs. The dispatched rows (FP8 included) are compared **bit for bit**; the combined
//! values within the dtype's tolerance (the reference sums in f64), and the summation order of
//! the ir crate's `moe` docs is pinned by a case built to expose it.
//! Output buffers are poisoned (NaN / INT_POISON) before every run, so padding that is not
//! written shows up.

use crate::support::moe::{routing_ids, PoisonedMoe, Route};
use crate::support::runtime as common;

use std::collections::BTreeMap;

use common::*;
use meshflow::ir::DType;
use meshflow::ir::HostProgram;
use meshflow::ir::Program;
use meshflow::runtime::compare::compare_outputs;
use meshflow::runtime::data::TensorData;
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::{run_and_compare, run_cpu, RunInputs};

fn moe_level1(d: i64, t: i64, e: i64, k: i64) -> meshflow::ir::Program {
    level1(
        "moe_layer.mf",
        &[("d", d), ("t", t), ("e", e), ("k", k), ("h", 8), ("f", 4)],
    )
}

#[test]
fn random_routing_matches_reference() {
    // (ranks, total experts, top-k, tokens per rank)
    let cases: &[(i64, i64, i64, i64)] = &[
        (1, 1, 1, 5),
        (2, 2, 1, 5),
        (2, 2, 2, 5),
        (3, 3, 2, 4),
        (4, 4, 2, 6),
        (8, 8, 8, 3),
        (8, 8, 1, 3),
        (1, 256, 8, 4),
        (2, 256, 2, 4),
        (4, 256, 8, 4),
        (8, 256, 8, 2),
        (4, 2048, 8, 4),
        (8, 2048, 2, 2),
    ];
    for &(d, experts, k, t) in cases {
        let e = experts / d;
        let l1 = moe_level1(d, t, e, k);
        let host = moe_host(d, t, e, k, 8, 4);
        for seed in [1, 2] {
            let cmp = run_and_compare(&l1, &host, d as usize, seed, &options())
                .unwrap_or_else(|err| panic!("d={d} E={experts} k={k}: {err}"));
            assert!(cmp.passed(), "d={d} E={experts} k={k} seed={seed}: {cmp}");
        }
    }
}

/// Full inputs with explicit routing (`idx[t]` lists the experts of global token `t`).
fn inputs(d: i64, t: i64, e: i64, idx: &[Vec<i64>]) -> BTreeMap<String, TensorData> {
    let k = idx[0].len() as u64;
    let tokens = (t * d) as u64;
    let flat: Vec<i64> = idx.iter().flatten().copied().collect();
    let w: Vec<f32> = (0..tokens * k)
        .map(|i| 0.25 + (i % 3) as f32 * 0.5)
        .collect();
    BTreeMap::from([
        (
            "x".into(),
            TensorData::random(DType::F32, &[tokens, 8], 5).unwrap(),
        ),
        (
            "topk_idx".into(),
            TensorData::from_i64(DType::I32, &[tokens, k], &flat).unwrap(),
        ),
        (
            "topk_weights".into(),
            TensorData::from_f32(DType::F32, &[tokens, k], &w).unwrap(),
        ),
        (
            "w_experts".into(),
            TensorData::random(DType::F32, &[(e * d) as u64, 8, 4], 6).unwrap(),
        ),
    ])
}

#[test]
fn ragged_routing_with_idle_experts_and_silent_ranks() {
    // 4 ranks, one expert each, 4 tokens per rank, top-1. Rank 0 routes only to itself (sends
    // nothing to others), rank 2 routes everything to expert 0, experts 1 and 3 get nothing.
    let (d, t, e) = (4i64, 4i64, 1i64);
    let routes: Vec<Vec<i64>> = [0, 0, 0, 0, 2, 0, 2, 0, 0, 0, 0, 0, 2, 2, 2, 0]
        .iter()
        .map(|&x| vec![x])
        .collect();
    let l1 = moe_level1(d, t, e, 1);
    let host = moe_host(d, t, e, 1, 8, 4);
    let full = inputs(d, t, e, &routes);
    let out = run_full(&host, &l1, &full, &options()).unwrap();
    let got = out.gather(&l1).unwrap();
    let want = evaluate(&l1, &full).unwrap();
    let cmp = compare_outputs(&l1, &got, &want).unwrap();
    assert!(cmp.passed(), "{cmp}");
    // Expert buffers are bit-identical to the reference (canonical row order), padding is zero.
    for name in ["expert_x", "expert_counts", "routing"] {
        assert!(got[name].bit_eq(&want[name]), "{name}");
    }
    assert_eq!(
        got["expert_counts"].storage().to_i64_vec(),
        vec![11, 0, 5, 0]
    );
    let ex = got["expert_x"].storage().to_f32_vec();
    assert!(ex.iter().all(|v| !v.is_nan()), "no poison left in expert_x");
    let cap = (t * d) as usize;
    assert!(
        ex[cap * 8..2 * cap * 8].iter().all(|&v| v == 0.0),
        "idle expert 1 is zero padding"
    );
    // Expert 0's rows: rank 0's 4 tokens, then rank 1's tokens 1 and 3, then rank 2's 4, ...
    let routing = got["routing"].storage().to_i64_vec();
    let tokens: Vec<i64> = routing[..22].chunks(2).map(|p| p[0]).collect();
    assert_eq!(tokens, vec![0, 1, 2, 3, 5, 7, 8, 9, 10, 11, 15]);
}

#[test]
fn top_k_rows_of_one_token_go_to_several_ranks() {
    // Token t of every rank picks experts (t, t + 1) mod E over 2 ranks x 2 experts.
    let (d, t, e) = (2i64, 3i64, 2i64);
    let routes: Vec<Vec<i64>> = (0..t * d).map(|g| vec![g % 4, (g + 1) % 4]).collect();
    let l1 = moe_level1(d, t, e, 2);
    let full = inputs(d, t, e, &routes);
    let out = run_full(&moe_host(d, t, e, 2, 8, 4), &l1, &full, &options()).unwrap();
    let got = out.gather(&l1).unwrap();
    let want = evaluate(&l1, &full).unwrap();
    assert!(compare_outputs(&l1, &got, &want).unwrap().passed());
    assert!(got["routing"].bit_eq(&want["routing"]));
}

#[test]
fn capacity_overflow_is_an_error_naming_the_expert() {
    let (d, t, e) = (2i64, 3i64, 1i64);
    let routes: Vec<Vec<i64>> = vec![vec![1]; 6];
    let l1 = moe_level1(d, t, e, 1);
    let full = inputs(d, t, e, &routes);
    let host = moe_host_cap(d, t, e, 1, 8, 4, 4);
    let err = run_full(&host, &l1, &full, &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("expert 1 receives more than its capacity of 4 rows"),
        "{err}"
    );
    assert!(err.contains("moe_dispatch(x, topk_idx"), "{err}");
    // Invalid expert ids are rejected too.
    let bad: Vec<Vec<i64>> = vec![vec![2]; 6];
    let full = inputs(d, t, e, &bad);
    let err = run_full(&moe_host(d, t, e, 1, 8, 4), &l1, &full, &options())
        .unwrap_err()
        .to_string();
    assert!(err.contains("is not an expert id in 0..2"), "{err}");
}

#[test]
fn checked_in_moe_text_runs_on_four_ranks() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("ir/tests/data/host/moe_dispatch_combine.mfh"),
    )
    .expect("the ir crate's example exists");
    let host = meshflow::ir::parse_host(&text).unwrap();
    let l1 = level1(
        "moe_layer.mf",
        &[("d", 4), ("t", 6), ("e", 2), ("k", 2), ("h", 16), ("f", 8)],
    );
    // That host program returns only `y`; compare it alone.
    let mut l1 = l1;
    l1.outputs.truncate(1);
    let cmp = run_and_compare(&l1, &host, 4, 3, &options()).unwrap();
    assert!(cmp.passed(), "{cmp}");
}

// ---- the bit-exact matrix: dtypes, wires, top-k, rank counts, ragged routing ---------------------

/// A fresh seed per run (printed; `MESHFLOW_MOE_SEED` replays one).
fn fresh_seed() -> u64 {
    if let Ok(s) = std::env::var("MESHFLOW_MOE_SEED") {
        return s.parse().expect("MESHFLOW_MOE_SEED is a number");
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64)
}

/// The level-1 MoE layer and its lowered host program for `d` ranks, `t` tokens and `e`
/// experts per rank, top-`k`, width `h` -> `f`, dtype `dt`, dispatch attributes `wire` (text
/// after the operands, e.g. `, wire=f8e4m3, scale=token`).
fn moe_texts(
    d: i64,
    t: i64,
    e: i64,
    k: i64,
    (h, f): (i64, i64),
    dt: &str,
    wire: &str,
) -> (Program, HostProgram) {
    let split = "{outer_split(0, d), parallelize(0, DIDx)}";
    let text = format!(
        "program moe {{
  param d = {d}
  mesh m0 = iota(d)
  input x: {dt}[{t} * d, {h}] on m0 {split}
  input topk_idx: i32[{t} * d, {k}] on m0 {split}
  input topk_weights: f32[{t} * d, {k}] on m0 {split}
  input w_experts: {dt}[{e} * d, {h}, {f}] on m0 {split}
  tensor expert_x: {dt}[{e} * d, {t} * d, {h}] on m0 {split}
  tensor expert_counts: i32[{e} * d] on m0 {split}
  tensor routing: i32[{e} * d, {t} * d, 2] on m0 {split}
  tensor expert_y: {dt}[{e} * d, {t} * d, {f}, r({h})] on m0
  tensor y: {dt}[{t} * d, {f}] on m0 {split}
  expert_x, expert_counts, routing = moe_dispatch(x, topk_idx{wire})
  expert_y = grouped_matmul(expert_x, expert_counts, w_experts)
  y = moe_combine(expert_y, expert_counts, routing, topk_weights)
  output y, expert_x, expert_counts, routing
}}
"
    );
    let l1 = meshflow::ir::parse_program(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let host = meshflow::compile(&l1, &meshflow::Options::new().check(false))
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
        .host()
        .clone();
    (l1, host)
}

/// Runs one configuration on sim ranks and compares the dispatch's outputs with the reference
/// bit for bit and `y` within tolerance; returns the expert counts (to check raggedness).
fn bit_exact(d: i64, k: i64, dt: DType, wire: &str, route: Route, seed: u64) -> Vec<i64> {
    let (t, e) = (5, (8 + d - 1) / d);
    let (h, f) = if wire.contains("block128") {
        (128, 16)
    } else {
        (32, 16)
    };
    let (l1, host) = moe_texts(d, t, e, k, (h, f), dt.name(), wire);
    let mut inputs = meshflow::runtime::compare::random_inputs(&l1, seed).unwrap();
    let mut rng = seed | 1;
    let ids = routing_ids(d, t, e, k, route, &mut rng);
    inputs.insert(
        "topk_idx".into(),
        TensorData::from_i64(DType::I32, &[(t * d) as u64, k as u64], &ids).unwrap(),
    );
    let label = format!("d={d} k={k} {dt} wire='{wire}' {route:?} seed={seed}");
    let out = run_full(&host, &l1, &inputs, &options()).unwrap_or_else(|e| panic!("{label}: {e}"));
    let got = out.gather(&l1).unwrap();
    let want = evaluate(&l1, &inputs).unwrap();
    // The dispatch (FP8 quantization included) is exact; `y` went through the reference's
    // f64 grouped_matmul and combine, so it is judged by the tolerance of its dtype (the
    // backends' summation order is pinned by `combine_sums_per_rank_partials_in_rank_order`).
    for name in ["expert_x", "expert_counts", "routing"] {
        assert!(got[name].bit_eq(&want[name]), "{label}: `{name}` differs");
    }
    let cmp = compare_outputs(&l1, &got, &want).unwrap();
    assert!(cmp.passed(), "{label}: {cmp}");
    let y = got["y"].storage().to_f32_vec();
    assert!(y.iter().all(|v| v.is_finite()), "{label}: poison left in y");
    got["expert_counts"].storage().to_i64_vec()
}

#[test]
fn bf16_and_fp8_dispatch_match_the_reference_bit_for_bit_on_1_to_8_ranks() {
    let seed = fresh_seed();
    eprintln!("seed {seed} (set MESHFLOW_MOE_SEED to replay)");
    let wires = [
        ("", DType::F32),
        ("", DType::BF16),
        (", wire=f8e4m3, scale=token", DType::BF16),
        (", wire=f8e4m3, scale=block128", DType::BF16),
        (", wire=f8e4m3, scale=block128", DType::F32),
    ];
    let mut idle_expert = false;
    for d in [1, 2, 3, 4, 8] {
        for k in [1, 2, 8] {
            for (wire, dt) in wires {
                for route in [Route::Uniform, Route::Ragged] {
                    let s = seed ^ (d as u64 * 1_000_003 + k as u64 * 7919);
                    let counts = bit_exact(d, k, dt, wire, route, s);
                    idle_expert |= counts.contains(&0);
                }
            }
        }
    }
    assert!(
        idle_expert,
        "some configuration leaves an expert without rows"
    );
}

#[test]
fn ragged_routing_leaves_a_rank_without_rows() {
    // 4 ranks, 2 experts each, top-2: nobody routes to rank 1's experts.
    let (d, t, e, k) = (4i64, 5i64, 2i64, 2i64);
    let mut rng = 99;
    let ids = routing_ids(d, t, e, k, Route::Ragged, &mut rng);
    assert!(ids.iter().all(|x| x / e != 1));
    // Rank 0's tokens go only to rank 3's experts.
    assert!(ids[..(t * k) as usize].iter().all(|x| x / e == 3));
    let counts = bit_exact(
        d,
        k,
        DType::BF16,
        ", wire=f8e4m3, scale=token",
        Route::Ragged,
        5,
    );
    assert_eq!(&counts[2..4], &[0, 0], "rank 1's experts receive nothing");
}

#[test]
fn combine_sums_per_rank_partials_in_rank_order() {
    // 2 ranks x 2 experts, one token per rank, h = f = 1, y_e = w_experts[e]. Token 0 of
    // rank 0 picks experts 2 (rank 1), 0 (rank 0), 3 (rank 1), weights 1: rank 1's partial is
    // 1e8 + (-1e8) = 0 and rank 0's is 1, so out = 1 + 0 = 1; the plain k order would give
    // (1e8 + 1) - 1e8 = 0 in f32.
    let (l1, host) = moe_texts(2, 1, 2, 3, (1, 1), "f32", "");
    let inputs = BTreeMap::from([
        (
            "x".to_string(),
            TensorData::from_f32(DType::F32, &[2, 1], &[1.0, 1.0]).unwrap(),
        ),
        (
            "topk_idx".to_string(),
            TensorData::from_i64(DType::I32, &[2, 3], &[2, 0, 3, 0, 1, 2]).unwrap(),
        ),
        (
            "topk_weights".to_string(),
            TensorData::from_f32(DType::F32, &[2, 3], &[1.0; 6]).unwrap(),
        ),
        (
            "w_experts".to_string(),
            TensorData::from_f32(DType::F32, &[4, 1, 1], &[1.0, 0.5, 1e8, -1e8]).unwrap(),
        ),
    ]);
    let out = run_full(&host, &l1, &inputs, &options()).unwrap();
    let y = out.gather(&l1).unwrap()["y"].storage().to_f32_vec();
    assert_eq!(y[0], 1.0);
    let want = evaluate(&l1, &inputs).unwrap()["y"].storage().to_f32_vec();
    assert_eq!(want[0], 1.0, "the reference follows the same order");
    // Token 0 of rank 1: experts 0, 1 (rank 0: 1 + 0.5) and 2 (rank 1: 1e8).
    assert_eq!(y[1], 1.5f32 + 1e8f32);
}

/// The dispatch writes outputs poisoned beforehand, packed and as a strided view (the second
/// half of a wider tensor), bf16 and FP8, top-k 1, 2 and 8, uniform and ragged routing: both
/// layouts give the same rows, counts and `y`; padding is zero on the CPU backend. (The same
/// programs run on GPUs in `tests/gpu/moe_outputs.rs`, compared with this backend.)
#[test]
fn dispatch_into_poisoned_packed_and_strided_outputs_on_sim_ranks() {
    let seed = fresh_seed();
    eprintln!("seed {seed} (set MESHFLOW_MOE_SEED to replay)");
    for d in [1i64, 2, 3, 4] {
        for k in [1i64, 2, 8] {
            for (wire, h) in [("", 32), (", wire=f8e4m3, scale=block128", 128)] {
                for route in [Route::Uniform, Route::Ragged] {
                    let base = PoisonedMoe::on_sim_ranks(d, k, h, wire);
                    let label = format!("d={d} k={k} wire='{wire}' {route:?}");
                    let ids = base.routing_ids(route, seed);
                    let runs: Vec<_> = [false, true]
                        .into_iter()
                        .map(|strided| {
                            let case = PoisonedMoe { strided, ..base };
                            let out = run_cpu(
                                &case.host(),
                                RunInputs::PerRank(case.inputs(&ids, seed)),
                                &options(),
                            )
                            .unwrap_or_else(|e| panic!("{label} strided={strided}: {e}"));
                            (case, out.outputs)
                        })
                        .collect();
                    for r in 0..d as usize {
                        let (packed, strided) = (&runs[0], &runs[1]);
                        let (p, s) = (&packed.1[&r], &strided.1[&r]);
                        assert_eq!(
                            packed.0.expert_rows(p),
                            strided.0.expert_rows(s),
                            "{label} rank {r}: rows differ"
                        );
                        assert!(p["y"].bit_eq(&s["y"]), "{label} rank {r}: y differs");
                        let y = p["y"].storage().to_f32_vec();
                        assert!(y.iter().all(|v| v.is_finite()), "{label}: poison in y");
                        // The CPU backend zeroes the padding.
                        let counts = p["expert_counts"].storage().to_i64_vec();
                        let (c, hh) = (base.cap() as usize, h as usize);
                        for (x, &n) in counts.iter().enumerate() {
                            for j in n as usize..c {
                                let at = (x * c + j) * hh;
                                assert!(
                                    (0..hh).all(|q| p["ex_out"].storage().bits(at + q) == Some(0)),
                                    "{label} rank {r}: padding row {j} of expert {x} is not zero"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
