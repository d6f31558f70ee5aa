//! MoE dispatch/combine on CPU ranks against the level-1 reference: top-k 1, 2, 8; E = W,
//! E = 256 and E = 2048; ragged routing (experts receiving nothing, ranks sending nothing);
//! capacity overflow. Output buffers are poisoned (NaN / INT_POISON) before every run, so
//! padding that is not written shows up.

use crate::support::runtime as common;

use std::collections::BTreeMap;

use common::*;
use meshflow::ir::DType;
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
    let out = run_cpu(
        &host,
        RunInputs::Full {
            program: &l1,
            inputs: &full,
        },
        &options(),
    )
    .unwrap();
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
    let out = run_cpu(
        &moe_host(d, t, e, 2, 8, 4),
        RunInputs::Full {
            program: &l1,
            inputs: &full,
        },
        &options(),
    )
    .unwrap();
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
    let err = run_cpu(
        &host,
        RunInputs::Full {
            program: &l1,
            inputs: &full,
        },
        &options(),
    )
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
    let err = run_cpu(
        &moe_host(d, t, e, 1, 8, 4),
        RunInputs::Full {
            program: &l1,
            inputs: &full,
        },
        &options(),
    )
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
