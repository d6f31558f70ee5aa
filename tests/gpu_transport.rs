//! The copy-engine transport against NCCL and the sim backend: collective permutes (rings in
//! both directions, to itself, strided send and receive views), broadcasts from every root,
//! and the lowered ring and broadcast AG+GEMM loops (double-buffered receive chunks, several
//! steps back to back), on 2 and 4 GPUs (those present), with the pull on the posting stream
//! and on a dedicated copy stream.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

#[path = "data/gpu/support.rs"]
mod support;

use meshflow::bench::programs::{agmm_lowered, AgVariant, Gemm3, Parts};
use meshflow::ir::DType;
use meshflow::runtime::cuda::{CopyStream, CudaConfig, Transport};
use meshflow::runtime::shard::scatter_inputs;
use support::*;

fn configs() -> Vec<(&'static str, CudaConfig)> {
    let base = cuda_options().config;
    vec![
        (
            "nccl",
            CudaConfig {
                transport: Some(Transport::Nccl),
                ..base.clone()
            },
        ),
        (
            "copy engine",
            CudaConfig {
                transport: Some(Transport::CopyEngine),
                ..base.clone()
            },
        ),
        (
            "copy engine, copy stream, 3 steps",
            CudaConfig {
                transport: Some(Transport::CopyEngine),
                copy_stream: CopyStream::Dedicated,
                steps: 3,
                ..base
            },
        ),
    ]
}

fn multi_gpu_counts(test: &str) -> Vec<usize> {
    let counts: Vec<usize> = rank_counts(test).into_iter().filter(|&d| d >= 2).collect();
    if counts.is_empty() {
        eprintln!("skipped: {test} needs 2 GPUs");
    }
    counts
}

#[test]
fn copy_engine_permutes_match_the_sim_backend() {
    for d in multi_gpu_counts("copy_engine_permutes_match_the_sim_backend") {
        for (what, config) in configs() {
            for (s, r) in [(1, d - 1), (0, 0), (d - 1, 1)] {
                let h = host(
                    "host ring {\n  mesh m0 = $MESH\n  in a: bf16[64, 40] on m0\n  out b: bf16[64, 40] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + $S) % $D, recv=(my(m0, DIDx) + $R) % $D)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("S", (s % d).to_string()), ("R", (r % d).to_string()), ("D", d.to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 9);
                sim_vs_cuda_with(
                    &format!("{what}: permute +{s}/+{r}"),
                    &h,
                    d,
                    inputs,
                    &|_| true,
                    &config,
                );
            }
            // Strided send and receive views (column halves), in a loop of two instances.
            let h = host(
                "host strided {\n  mesh m0 = $MESH\n  in a: f32[6, 8] on m0\n  out b: f32[6, 8] on m0\n  tensor a_half: f32[6, 4] on m0\n  tensor b_half: f32[6, 4] on m0\n  for i0 in 0..2 {\n    a_half = shard_by_stream(a, axis=1, chunks=2, index=i0)\n    b_half = shard_by_stream(b, axis=1, chunks=2, index=1 - i0)\n    c0 = collective_permute(a_half -> b_half, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n    wait c0\n  }\n}\n",
                &[("MESH", iota(d)), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
            );
            let inputs = per_rank_inputs(&h, d, 11);
            sim_vs_cuda_with(
                &format!("{what}: strided permute"),
                &h,
                d,
                inputs,
                &|_| true,
                &config,
            );
        }
    }
}

#[test]
fn copy_engine_broadcasts_match_the_sim_backend() {
    for d in multi_gpu_counts("copy_engine_broadcasts_match_the_sim_backend") {
        for (what, config) in configs() {
            for root in 0..d {
                let h = host(
                    "host bc {\n  mesh m0 = $MESH\n  in a: f32[16, 5] on m0\n  out b: f32[16, 5] on m0\n  c0 = broadcast(a -> b, team=slice(m0, DIDx), root=$ROOT)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("ROOT", root.to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 17);
                sim_vs_cuda_with(
                    &format!("{what}: broadcast root {root}"),
                    &h,
                    d,
                    inputs,
                    &|_| true,
                    &config,
                );
            }
        }
    }
}

#[test]
fn lowered_ring_and_broadcast_loops_match_the_sim_backend() {
    for d in multi_gpu_counts("lowered_ring_and_broadcast_loops_match_the_sim_backend") {
        let s = Gemm3 {
            m: 256 * d as u64,
            k: 128,
            n: 64 * d as u64,
        };
        for (what, config) in configs() {
            for v in [AgVariant::Ring, AgVariant::Broadcast] {
                let l = agmm_lowered(d, s, DType::BF16, v, 2, Parts::Both).unwrap();
                let full = std::collections::BTreeMap::from([
                    (
                        "x".to_string(),
                        meshflow::runtime::data::TensorData::random(DType::BF16, &[s.m, s.k], 3)
                            .unwrap(),
                    ),
                    (
                        "w".to_string(),
                        meshflow::runtime::data::TensorData::random(DType::BF16, &[s.n, s.k], 4)
                            .unwrap(),
                    ),
                ]);
                let inputs = scatter_inputs(&l.program, &full).unwrap();
                sim_vs_cuda_with(
                    &format!("{what}: agmm {}", v.name()),
                    &l.host,
                    d,
                    inputs,
                    &|_| true,
                    &config,
                );
            }
        }
    }
}

#[test]
fn a_failing_rank_stops_a_peer_waiting_for_its_copy_engine_data() {
    if skip_unless(
        2,
        "a_failing_rank_stops_a_peer_waiting_for_its_copy_engine_data",
    ) {
        return;
    }
    let h = host(
        "host p {\n  mesh m0 = [0, 1]\n  in a: f32[1024] on m0\n  out b: f32[1024] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % 2, recv=(my(m0, DIDx) + 1) % 2)\n  wait c0\n}\n",
        &[],
    );
    let mut inputs = per_rank_inputs(&h, 2, 1);
    // Rank 1 is not given its input: it fails before posting, while rank 0 waits for its offer.
    inputs.insert(1, std::collections::BTreeMap::new());
    let mut opts = cuda_options();
    opts.config.transport = Some(Transport::CopyEngine);
    opts.config.timeout = std::time::Duration::from_secs(20);
    let t0 = std::time::Instant::now();
    let err =
        meshflow::runtime::cuda::run_cuda(&h, meshflow::runtime::SimInputs::PerRank(inputs), &opts)
            .expect_err("rank 1 has no input");
    let text = err.to_string();
    eprintln!("after {:?}: {text}", t0.elapsed());
    assert!(
        text.contains("rank 1") && text.contains("input `a`"),
        "{text}"
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(30));
    let good = per_rank_inputs(&h, 2, 2);
    let config = CudaConfig {
        transport: Some(Transport::CopyEngine),
        ..cuda_options().config
    };
    sim_vs_cuda_with("permute after a failure", &h, 2, good, &|_| true, &config);
}

#[test]
fn copy_engine_reduce_scatters_match_the_sim_backend() {
    for d in multi_gpu_counts("copy_engine_reduce_scatters_match_the_sim_backend") {
        for (what, config) in configs() {
            for dtype in ["f32", "bf16"] {
                let h = host(
                    "host rs {\n  mesh m0 = $MESH\n  in a: $T[$R, 24] on m0\n  out b: $T[8, 24] on m0\n  c0 = reduce_scatter(a -> b, team=slice(m0, DIDx), op=sum)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("T", dtype.into()), ("R", (8 * d).to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 23);
                sim_vs_cuda_with(
                    &format!("{what}: reduce_scatter {dtype}"),
                    &h,
                    d,
                    inputs,
                    &|_| true,
                    &config,
                );
            }
        }
    }
}

#[test]
fn a_send_buffer_written_right_after_the_wait_is_not_raced() {
    // `t` is sent, then overwritten at once by the next op, then sent again: the overwrite must
    // wait for the peer's read of the first send (16 MiB, so that a missing order would show).
    for d in multi_gpu_counts("a_send_buffer_written_right_after_the_wait_is_not_raced") {
        for (what, config) in configs() {
            let h = host(
                "host war {\n  mesh m0 = $MESH\n  in a: f32[4194304] on m0\n  out b: f32[4194304] on m0\n  out c: f32[4194304] on m0\n  tensor t: f32[4194304] on m0\n  allocate t\n  gelu(a -> t)\n  c0 = collective_permute(t -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c0\n  gelu(b -> t)\n  c1 = collective_permute(t -> c, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c1\n  deallocate t\n}\n",
                &[("MESH", iota(d)), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
            );
            let inputs = per_rank_inputs(&h, d, 29);
            sim_vs_cuda_with(
                &format!("{what}: write after send"),
                &h,
                d,
                inputs,
                &|_| true,
                &config,
            );
        }
    }
}
