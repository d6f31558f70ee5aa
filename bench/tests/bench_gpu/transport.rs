//! The copy-engine transport against NCCL and the CPU backend: collective permutes (rings in
//! both directions, to itself, strided send and receive views), broadcasts from every root,
//! and the lowered ring and broadcast AG+GEMM loops (double-buffered receive chunks, several
//! steps back to back), on 2 and 4 GPUs (those present), with the pull on the posting stream
//! and on a dedicated copy stream. Also: programs recorded as CUDA graphs (and the clear
//! refusal where a transport needs the host), and the transport every communication reports.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use meshflow::ir::DType;
use meshflow::runtime::cuda::{CopyStream, CudaConfig, Transport};
use meshflow::runtime::shard::scatter_inputs;
use meshflow_bench::programs::{agmm_lowered, AgVariant, Gemm3, Parts};
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
fn copy_engine_permutes_match_the_cpu_backend() {
    for d in multi_gpu_counts("copy_engine_permutes_match_the_cpu_backend") {
        for (what, config) in configs() {
            for (s, r) in [(1, d - 1), (0, 0), (d - 1, 1)] {
                let h = host(
                    "host ring {\n  mesh m0 = $MESH\n  in a: bf16[64, 40] on m0\n  out b: bf16[64, 40] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + $S) % $D, recv=(my(m0, DIDx) + $R) % $D)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("S", (s % d).to_string()), ("R", (r % d).to_string()), ("D", d.to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 9);
                cpu_vs_cuda_with(
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
            cpu_vs_cuda_with(
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
fn copy_engine_broadcasts_match_the_cpu_backend() {
    for d in multi_gpu_counts("copy_engine_broadcasts_match_the_cpu_backend") {
        for (what, config) in configs() {
            for root in 0..d {
                let h = host(
                    "host bc {\n  mesh m0 = $MESH\n  in a: f32[16, 5] on m0\n  out b: f32[16, 5] on m0\n  c0 = broadcast(a -> b, team=slice(m0, DIDx), root=$ROOT)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("ROOT", root.to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 17);
                cpu_vs_cuda_with(
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
fn lowered_ring_and_broadcast_loops_match_the_cpu_backend() {
    for d in multi_gpu_counts("lowered_ring_and_broadcast_loops_match_the_cpu_backend") {
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
                cpu_vs_cuda_with(
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
        meshflow::runtime::cuda::run_cuda(&h, meshflow::runtime::RunInputs::PerRank(inputs), &opts)
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
    cpu_vs_cuda_with("permute after a failure", &h, 2, good, &|_| true, &config);
}

#[test]
fn copy_engine_reduce_scatters_match_the_cpu_backend() {
    for d in multi_gpu_counts("copy_engine_reduce_scatters_match_the_cpu_backend") {
        for (what, config) in configs() {
            for dtype in ["f32", "bf16"] {
                let h = host(
                    "host rs {\n  mesh m0 = $MESH\n  in a: $T[$R, 24] on m0\n  out b: $T[8, 24] on m0\n  c0 = reduce_scatter(a -> b, team=slice(m0, DIDx), op=sum)\n  wait c0\n}\n",
                    &[("MESH", iota(d)), ("T", dtype.into()), ("R", (8 * d).to_string())],
                );
                let inputs = per_rank_inputs(&h, d, 23);
                cpu_vs_cuda_with(
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
            cpu_vs_cuda_with(
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

/// `run --graph`: one step recorded as a CUDA graph and replayed `steps` times gives what the
/// CPU backend gives (the automatic selection keeps to transports that replay), on 2 and 4
/// GPUs.
#[test]
fn a_program_recorded_as_a_cuda_graph_matches_the_cpu_backend() {
    for d in multi_gpu_counts("a_program_recorded_as_a_cuda_graph_matches_the_cpu_backend") {
        let s = Gemm3 {
            m: 256 * d as u64,
            k: 128,
            n: 64 * d as u64,
        };
        for v in [AgVariant::Ring, AgVariant::Broadcast, AgVariant::Collective] {
            let l = agmm_lowered(d, s, DType::BF16, v, 2, Parts::Both).unwrap();
            let full = std::collections::BTreeMap::from([
                (
                    "x".to_string(),
                    meshflow::runtime::data::TensorData::random(DType::BF16, &[s.m, s.k], 5)
                        .unwrap(),
                ),
                (
                    "w".to_string(),
                    meshflow::runtime::data::TensorData::random(DType::BF16, &[s.n, s.k], 6)
                        .unwrap(),
                ),
            ]);
            let inputs = scatter_inputs(&l.program, &full).unwrap();
            let config = CudaConfig {
                graph: true,
                steps: 3,
                ..cuda_options().config
            };
            cpu_vs_cuda_with(
                &format!("graph: agmm {}", v.name()),
                &l.host,
                d,
                inputs,
                &|_| true,
                &config,
            );
        }
    }
}

/// Recording is refused, with the reason, where a forced transport needs the host during a
/// step; nothing hangs and a later run without graphs works.
#[test]
fn graph_recording_is_refused_where_a_transport_needs_the_host() {
    for d in multi_gpu_counts("graph_recording_is_refused_where_a_transport_needs_the_host") {
        let h = host(
            "host p {\n  mesh m0 = $MESH\n  in a: f32[256] on m0\n  out b: f32[256] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c0\n}\n",
            &[("MESH", iota(d)), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
        );
        let mut opts = cuda_options();
        opts.ranks = Some(d);
        opts.config.graph = true;
        opts.config.transport = Some(Transport::CopyEngine);
        let inputs = per_rank_inputs(&h, d, 3);
        let err = meshflow::runtime::cuda::run_cuda(
            &h,
            meshflow::runtime::RunInputs::PerRank(inputs.clone()),
            &opts,
        )
        .expect_err("the copy engine cannot be recorded");
        let text = err.to_string();
        eprintln!("{text}");
        assert!(
            text.contains("cannot be recorded as a CUDA graph") && text.contains("copy-engine"),
            "{text}"
        );
        assert!(!text.contains("panicked"), "{text}");
        let config = CudaConfig {
            transport: Some(Transport::CopyEngine),
            ..cuda_options().config
        };
        cpu_vs_cuda_with("after a refused graph", &h, d, inputs, &|_| true, &config);
    }
}

/// Every communication reports the transport that carried it, in the run's report and in the
/// profiled trace: forced NCCL everywhere; the copy engine for a ring permute of in-process
/// GPUs with peer access (else NCCL).
#[test]
fn every_communication_reports_its_transport() {
    use meshflow::runtime::cuda::run_cuda_timed;
    for d in multi_gpu_counts("every_communication_reports_its_transport") {
        let h = host(
            "host p {\n  mesh m0 = $MESH\n  in a: f32[256] on m0\n  out b: f32[256] on m0\n  out c: f32[256] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c0\n  c1 = all_reduce(a -> c, team=slice(m0, DIDx), op=sum)\n  wait c1\n}\n",
            &[("MESH", iota(d)), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
        );
        for forced in [None, Some(Transport::Nccl)] {
            let mut opts = cuda_options();
            opts.ranks = Some(d);
            opts.config.transport = forced;
            opts.config.profile = true;
            let inputs = per_rank_inputs(&h, d, 4);
            let run = run_cuda_timed(
                &h,
                meshflow::runtime::RunInputs::PerRank(inputs),
                &opts,
                0,
                1,
            )
            .unwrap_or_else(|e| panic!("{forced:?}: {e}"));
            for rank in 0..d {
                let used: Vec<(&str, Option<Transport>)> = run.transports[&rank]
                    .iter()
                    .map(|c| (c.name, c.transport))
                    .collect();
                eprintln!("{forced:?} rank {rank}: {used:?}");
                assert_eq!(used.len(), 2, "{used:?}");
                assert_eq!(used[1], ("all_reduce", Some(Transport::Nccl)));
                let permute = used[0].1;
                match forced {
                    Some(t) => assert_eq!(permute, Some(t)),
                    None => assert!(
                        matches!(permute, Some(Transport::CopyEngine | Transport::Nccl)),
                        "{used:?}"
                    ),
                }
                let events = run.outcome.trace.as_ref().expect("profiled");
                let traced: Vec<_> = events
                    .events
                    .iter()
                    .filter(|e| e.rank == rank && e.name == "collective_permute")
                    .map(|e| e.transport)
                    .collect();
                assert!(
                    !traced.is_empty() && traced.iter().all(|t| *t == permute),
                    "{traced:?} vs {permute:?}"
                );
            }
        }
    }
}
