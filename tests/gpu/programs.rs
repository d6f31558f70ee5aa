//! The end-to-end programs of the CPU backend on GPUs: the hand-written host programs (ring and
//! broadcast all-gather + linear, chunked row-parallel linear) on 1, 2 and 4 GPUs against the
//! level-1 reference; every compute op (packed and strided operands, in place) against the CPU backend
//! backend; the MoE layer through the NCCL MoE transport.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;
use crate::support::runtime as common;

use std::collections::BTreeMap;

use meshflow::ir::DType;
use meshflow::runtime::cuda::run_and_compare_cuda;
use meshflow::runtime::data::TensorData;
use support::*;

fn check(name: &str, level1: &meshflow::ir::Program, host: &meshflow::ir::HostProgram, d: usize) {
    let cmp = run_and_compare_cuda(level1, host, d, 42 + d as u64, &cuda_options())
        .unwrap_or_else(|e| panic!("{name} on {d} GPUs: {e}"));
    eprintln!("{name} d={d}: {cmp}");
    assert!(cmp.passed(), "{name} on {d} GPUs: {cmp}");
}

#[test]
fn ring_all_gather_linear_matches_reference() {
    for d in rank_counts("ring_all_gather_linear_matches_reference") {
        let l1 = common::level1("ring_linear.mf", &[("d", d as i64)]);
        check("ring", &l1, &common::ring_host(d as i64), d);
    }
}

#[test]
fn broadcast_all_gather_linear_matches_reference() {
    for d in rank_counts("broadcast_all_gather_linear_matches_reference") {
        let l1 = common::level1("broadcast_linear.mf", &[("d", d as i64)]);
        check("broadcast", &l1, &common::broadcast_host(d as i64), d);
    }
}

#[test]
fn chunked_all_reduce_matches_reference() {
    for d in rank_counts("chunked_all_reduce_matches_reference") {
        for s in [1, 3] {
            let l1 = common::level1("row_parallel_chunked.mf", &[("d", d as i64), ("s", s)]);
            check(
                "row_parallel",
                &l1,
                &common::row_parallel_host(d as i64, s),
                d,
            );
        }
    }
}

/// Rows of every expert as a sorted list of `(routing token, k, row bits)`.
fn expert_rows(out: &BTreeMap<String, TensorData>) -> Vec<Vec<(i64, i64, Vec<u64>)>> {
    let (ex, counts, routing) = (&out["expert_x"], &out["expert_counts"], &out["routing"]);
    let s = ex.shape().to_vec();
    let (e, c, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
    (0..e)
        .map(|x| {
            let n = counts.storage().get_i64(x).unwrap() as usize;
            let mut rows: Vec<(i64, i64, Vec<u64>)> = (0..n.min(c))
                .map(|j| {
                    let r = (x * c + j) * 2;
                    let row = (0..h)
                        .map(|q| ex.storage().bits((x * c + j) * h + q).unwrap())
                        .collect();
                    (
                        routing.storage().get_i64(r).unwrap(),
                        routing.storage().get_i64(r + 1).unwrap(),
                        row,
                    )
                })
                .collect();
            rows.sort();
            rows
        })
        .collect()
}

#[test]
fn moe_layer_matches_reference_with_expert_rows_as_multisets() {
    use meshflow::runtime::compare::random_inputs;
    use meshflow::runtime::cuda::{run_cuda_timed, Transport};
    use meshflow::runtime::reference::evaluate;
    use meshflow::runtime::RunInputs;
    // The automatic choice (MoE over NVLink for in-process GPUs with peer access), then NCCL.
    for (d, forced) in rank_counts("moe_layer_matches_reference_with_expert_rows_as_multisets")
        .into_iter()
        .flat_map(|d| [(d, None), (d, Some(Transport::Nccl))])
    {
        for (t, e, k) in [(6, 2, 2), (5, 1, 1), (4, 3, 3)] {
            let host = common::moe_host(d as i64, t, e, k, 16, 8);
            let l1 = common::level1(
                "moe_layer.mf",
                &[
                    ("d", d as i64),
                    ("t", t),
                    ("e", e),
                    ("k", k),
                    ("h", 16),
                    ("f", 8),
                ],
            );
            let inputs = random_inputs(&l1, 3).unwrap();
            let mut o = cuda_options();
            o.ranks = Some(d);
            o.config.transport = forced;
            let run = run_cuda_timed(
                &host,
                RunInputs::Full {
                    program: &l1,
                    inputs: &inputs,
                },
                &o,
                0,
                1,
            )
            .unwrap_or_else(|err| panic!("moe d={d} t={t} e={e} k={k} {forced:?}: {err}"));
            let used: Vec<Option<Transport>> = run.transports[&0]
                .iter()
                .filter(|c| c.name.starts_with("moe_"))
                .map(|c| c.transport)
                .collect();
            eprintln!("moe d={d} {forced:?}: dispatch and combine over {used:?}");
            assert_eq!(used.len(), 2, "{used:?}");
            if forced.is_some() || d == 1 {
                assert!(used.iter().all(|u| *u == Some(Transport::Nccl)), "{used:?}");
            } else {
                assert!(used[0].is_some() && used[0] == used[1], "{used:?}");
            }
            let out = run.outcome;
            let got = out.gather(&l1).unwrap();
            let want = evaluate(&l1, &inputs).unwrap();
            let err = got["y"].rel_error(&want["y"]).unwrap();
            assert!(err < 1e-5, "moe d={d}: y rel err {err:.3e}");
            assert!(
                got["expert_counts"].bit_eq(&want["expert_counts"]),
                "moe d={d}: counts differ"
            );
            assert_eq!(
                expert_rows(&got),
                expert_rows(&want),
                "moe d={d} t={t} e={e} k={k}: expert rows differ"
            );
            eprintln!(
                "moe d={d} t={t} e={e} k={k} {forced:?}: y rel err {err:.2e}, expert rows equal as multisets"
            );
        }
    }
}

/// Every compute op once, on packed, strided and aliased operands.
const COMPUTE: &str = r#"
host compute {
  mesh m0 = [0]
  in x: $T[2, 4, 6] on m0
  in w: $T[5, 6] on m0
  in b: $T[2, 6, 3] on m0
  in v: $T[4, 6] on m0
  out lin: $T[2, 4, 5] on m0
  out mm: $T[2, 4, 3] on m0
  out mm2: $T[2, 4, 5] on m0
  out sum1: $T[2, 6] on m0
  out cast32: f32[4, 6] on m0
  out perm: $T[6, 2, 4] on m0
  out ew: $T[4, 6] on m0
  out halves: $T[4, 6] on m0
  out cpy: $T[24] on m0
  out lin_strided: $T[4, 5] on m0
  out wide: $T[4, 10] on m0
  tensor wt: $T[6, 5] on m0
  tensor xh: $T[4, 3] on m0
  tensor wh: $T[5, 3] on m0
  tensor wide_half: $T[4, 5] on m0
  tensor x0: $T[1, 4, 6] on m0
  allocate wt
  linear(x, w -> lin)
  matmul(x, b -> mm)
  permute(w -> wt, perm=[1, 0])
  matmul(x, wt -> mm2)
  sum(x -> sum1, axis=1)
  cast(v -> cast32)
  permute(x -> perm, perm=[2, 0, 1])
  add(v, v -> ew)
  mul(ew, v -> ew)
  sub(ew, v -> ew)
  gelu(ew -> ew)
  silu(ew -> ew)
  x0 = shard_by_stream(x, axis=0, chunks=2, index=1)
  copy(v -> halves)
  xh = shard_by_stream(v, axis=1, chunks=2, index=0)
  wh = shard_by_stream(w, axis=1, chunks=2, index=1)
  linear(xh, wh -> lin_strided)
  wide_half = shard_by_stream(wide, axis=1, chunks=2, index=0)
  linear(v, w -> wide_half)
  wide_half = shard_by_stream(wide, axis=1, chunks=2, index=1)
  linear(v, w -> wide_half)
  copy(x0 -> cpy)
}
"#;

#[test]
fn every_compute_op_matches_the_cpu_backend() {
    if skip_unless(1, "every_compute_op_matches_the_cpu_backend") {
        return;
    }
    for t in ["f32", "bf16"] {
        let h = host(COMPUTE, &[("T", t.into())]);
        let inputs = per_rank_inputs(&h, 1, 21);
        let err = cpu_vs_cuda(&format!("compute {t}"), &h, 1, inputs);
        eprintln!("compute ops {t}: max rel err {err:.2e}");
    }
}

#[test]
fn grouped_matmul_over_zero_padded_rows_matches() {
    if skip_unless(1, "grouped_matmul_over_zero_padded_rows_matches") {
        return;
    }
    let h = host(
        "host gm {\n  mesh m0 = [0]\n  in ex: f32[2, 3, 4, 8] on m0\n  in counts: i32[2, 3] on m0\n  in w: f32[3, 8, 5] on m0\n  out y: f32[2, 3, 4, 5] on m0\n  grouped_matmul(ex, counts, w -> y)\n}\n",
        &[],
    );
    let counts = [4i64, 0, 2, 1, 3, 4];
    let mut x = TensorData::random(DType::F32, &[2, 3, 4, 8], 3)
        .unwrap()
        .storage()
        .to_f32_vec();
    for (g, &c) in counts.iter().enumerate() {
        for r in c as usize..4 {
            x[(g * 4 + r) * 8..(g * 4 + r + 1) * 8].fill(0.0);
        }
    }
    let inputs = BTreeMap::from([(
        0usize,
        BTreeMap::from([
            (
                "ex".to_string(),
                TensorData::from_f32(DType::F32, &[2, 3, 4, 8], &x).unwrap(),
            ),
            (
                "counts".to_string(),
                TensorData::from_i64(DType::I32, &[2, 3], &counts).unwrap(),
            ),
            (
                "w".to_string(),
                TensorData::random(DType::F32, &[3, 8, 5], 4).unwrap(),
            ),
        ]),
    )]);
    cpu_vs_cuda("grouped_matmul", &h, 1, inputs);
}
