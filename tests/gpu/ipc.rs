//! One process per GPU on 2 GPUs (the torchrun variables, as `meshflow launch --nproc 2` sets
//! them): the ranks share GPU memory over CUDA IPC, so a multi-process run gets the copy-engine
//! and NVLink MoE transports an in-process run gets.
//!
//! - Copy engine: collective permutes (rings both ways, strided views in a loop, a dedicated
//!   copy stream over 3 steps, pulls never deferred, every pull deferred, the default (pulls
//!   deferred only before the first compute), a permute posted on a worker stream ahead of
//!   compute on the main stream over 3 steps, as the prefetch schedule does), broadcasts
//!   from both roots, sum reduce-scatters in f32 and bf16, and a send buffer overwritten
//!   right after its send (16 MiB), each rank compared with
//!   the CPU backend running the same host program on the same inputs; every communication
//!   must report the copy engine.
//! - MoE over NVLink: the `moe_layer` (bf16) and `moe_layer_fp8` (FP8 dispatch, block scales)
//!   examples lowered for 2 ranks, against the CPU backend, also recorded as a CUDA graph and
//!   replayed; dispatch and combine must report NVLink. The same MoE graph in one process.
//!
//! The same through the `meshflow` binary (`meshflow launch`, a rank process that dies) is in
//! `cli/tests/cli_gpu/ipc.rs`. Without 2 GPUs every test prints why it skipped. Built with the
//! `cuda` feature only: `cargo test --features cuda --test gpu ipc::`.

use crate::support::gpu as support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use meshflow::ir::{parse_program_with, HostProgram};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cuda::{
    run_cuda_timed, run_rank, CopyStream, CudaConfig, CudaOptions, DeferPulls, Transport,
};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::{Rendezvous, TcpRendezvous, TorchrunEnv};
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::{run_cpu, RunInputs, SelectedTransport};
use meshflow::{compile, Compiled, Options};
use support::*;

type PerRank = BTreeMap<usize, BTreeMap<String, TensorData>>;

/// Runs this test binary's ignored test `child` as ranks 0 and 1 (the launcher behind
/// `meshflow launch`); returns whether every rank passed, and their output.
fn launch_children(child: &str) -> (Result<(), String>, String) {
    crate::support::launch::launch_test_children(&format!("ipc::{child}"), 2)
}

/// This process's rank (started by [`launch_children`]) and the run's rendezvous.
fn child_rank() -> (TorchrunEnv, Arc<dyn Rendezvous>) {
    let env = TorchrunEnv::from_env()
        .expect("valid torchrun variables")
        .expect("RANK and WORLD_SIZE are set by the launcher");
    let rdv = TcpRendezvous::connect(&env, Duration::from_secs(60)).expect("the rendezvous");
    (env, Arc::new(rdv))
}

/// Backend settings of the child runs (automatic transport selection).
fn config() -> CudaConfig {
    cuda_options().config
}

/// Runs `host` as this process's rank and compares its outputs with the CPU backend's run of
/// every rank on `inputs`; returns the transports its communications reported.
fn rank_vs_cpu(
    case: &str,
    env: &TorchrunEnv,
    rdv: &Arc<dyn Rendezvous>,
    host: &HostProgram,
    inputs: &PerRank,
    config: &CudaConfig,
) -> Vec<SelectedTransport> {
    let (rank, d) = (env.rank, env.world_size);
    let mut co = cpu_options();
    co.ranks = Some(d);
    let want = run_cpu(host, RunInputs::PerRank(inputs.clone()), &co)
        .unwrap_or_else(|e| panic!("{case} on {d} CPU ranks: {e}"));
    let empty = BTreeMap::new();
    let mine = inputs.get(&rank).unwrap_or(&empty);
    let run = run_rank(
        host,
        rank,
        d,
        env.local_rank,
        mine,
        rdv.clone(),
        config,
        0,
        1,
    )
    .unwrap_or_else(|e| panic!("rank {rank}: {case}: {e}"));
    let wanted = want.outputs.get(&rank).unwrap_or(&empty);
    assert!(!wanted.is_empty(), "{case}: rank {rank} has no outputs");
    for (t, w) in wanted {
        let g = run
            .outputs
            .get(t)
            .unwrap_or_else(|| panic!("{case}: rank {rank} has no output {t} on its GPU"));
        let err = g
            .rel_error(w)
            .unwrap_or_else(|e| panic!("{case}: rank {rank} output {t}: {e}"));
        assert!(
            err <= tol(w.dtype()),
            "{case}: rank {rank} output {t}: rel err {err:.3e} > {:.0e}",
            tol(w.dtype())
        );
    }
    run.transports
}

/// The transports of the communications named `names`, as text (`collective_permute:
/// copy-engine ...`), after checking each is `want`.
fn expect_transports(
    case: &str,
    used: &[SelectedTransport],
    names: &[&str],
    want: Transport,
) -> String {
    let picked: Vec<&SelectedTransport> = used.iter().filter(|t| names.contains(&t.name)).collect();
    assert!(!picked.is_empty(), "{case}: no {names:?} in {used:?}");
    for t in &picked {
        assert_eq!(
            t.transport,
            Some(want),
            "{case}: {} over {:?}",
            t.name,
            t.transport
        );
    }
    picked
        .iter()
        .map(|t| format!("{} over {want}", t.name))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---- the copy engine across processes --------------------------------------------------------

/// The copy-engine cases: name, host program, backend settings.
fn copy_cases(d: usize) -> Vec<(String, HostProgram, CudaConfig)> {
    let mesh = iota(d);
    let ring = |s: usize, r: usize, dtype: &str| {
        host(
            "host ring {\n  mesh m0 = $MESH\n  in a: $T[64, 40] on m0\n  out b: $T[64, 40] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + $S) % $D, recv=(my(m0, DIDx) + $R) % $D)\n  wait c0\n}\n",
            &[("MESH", mesh.clone()), ("T", dtype.into()), ("S", s.to_string()), ("R", r.to_string()), ("D", d.to_string())],
        )
    };
    let dedicated = CudaConfig {
        copy_stream: CopyStream::Dedicated,
        steps: 3,
        ..config()
    };
    let blocking = CudaConfig {
        defer_pulls: DeferPulls::Never,
        ..config()
    };
    // The default defers only before the first compute: these cases defer every pull.
    let deferring = CudaConfig {
        defer_pulls: DeferPulls::Always,
        ..config()
    };
    let three_steps = CudaConfig {
        steps: 3,
        defer_pulls: DeferPulls::Always,
        ..config()
    };
    let mut cases = vec![
        ("permute ring +1".to_string(), ring(1, d - 1, "bf16"), config()),
        ("permute ring -1".to_string(), ring(d - 1, 1, "f32"), config()),
        (
            "permute, copy stream, 3 steps".to_string(),
            ring(1, d - 1, "f32"),
            dedicated,
        ),
        (
            "permute, pulls never deferred".to_string(),
            ring(1, d - 1, "f32"),
            blocking,
        ),
        (
            "permute, every pull deferred".to_string(),
            ring(1, d - 1, "bf16"),
            deferring,
        ),
        (
            "permute ahead of compute, 3 steps".to_string(),
            host(
                "host ahead {\n  mesh m0 = $MESH\n  in a: f32[256, 40] on m0\n  out b: f32[256, 40] on m0\n  out c: f32[256, 40] on m0\n  s0 = get_current_stream\n  set_current_stream worker(0)\n  synchronize s0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  set_current_stream s0\n  gelu(a -> c)\n  wait c0\n  synchronize worker(0)\n}\n",
                &[("MESH", mesh.clone()), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
            ),
            three_steps,
        ),
        (
            "strided permute loop".to_string(),
            host(
                "host strided {\n  mesh m0 = $MESH\n  in a: f32[6, 8] on m0\n  out b: f32[6, 8] on m0\n  tensor a_half: f32[6, 4] on m0\n  tensor b_half: f32[6, 4] on m0\n  for i0 in 0..2 {\n    a_half = shard_by_stream(a, axis=1, chunks=2, index=i0)\n    b_half = shard_by_stream(b, axis=1, chunks=2, index=1 - i0)\n    c0 = collective_permute(a_half -> b_half, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n    wait c0\n  }\n}\n",
                &[("MESH", mesh.clone()), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
            ),
            config(),
        ),
        (
            "write after send".to_string(),
            host(
                "host war {\n  mesh m0 = $MESH\n  in a: f32[4194304] on m0\n  out b: f32[4194304] on m0\n  out c: f32[4194304] on m0\n  tensor t: f32[4194304] on m0\n  allocate t\n  gelu(a -> t)\n  c0 = collective_permute(t -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c0\n  gelu(b -> t)\n  c1 = collective_permute(t -> c, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  wait c1\n  deallocate t\n}\n",
                &[("MESH", mesh.clone()), ("D", d.to_string()), ("DM1", (d - 1).to_string())],
            ),
            config(),
        ),
    ];
    for root in 0..d {
        cases.push((
            format!("broadcast root {root}"),
            host(
                "host bc {\n  mesh m0 = $MESH\n  in a: f32[16, 5] on m0\n  out b: f32[16, 5] on m0\n  c0 = broadcast(a -> b, team=slice(m0, DIDx), root=$ROOT)\n  wait c0\n}\n",
                &[("MESH", mesh.clone()), ("ROOT", root.to_string())],
            ),
            config(),
        ));
    }
    for dtype in ["f32", "bf16"] {
        cases.push((
            format!("reduce_scatter {dtype}"),
            host(
                "host rs {\n  mesh m0 = $MESH\n  in a: $T[$R, 24] on m0\n  out b: $T[8, 24] on m0\n  c0 = reduce_scatter(a -> b, team=slice(m0, DIDx), op=sum)\n  wait c0\n}\n",
                &[("MESH", mesh.clone()), ("T", dtype.into()), ("R", (8 * d).to_string())],
            ),
            config(),
        ));
    }
    cases
}

#[test]
fn copy_engine_across_two_processes_matches_the_cpu_backend() {
    if skip_unless(
        2,
        "copy_engine_across_two_processes_matches_the_cpu_backend",
    ) {
        return;
    }
    let (r, text) = launch_children("ipc_rank_copy_engine");
    r.unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (case, _, _) in copy_cases(2) {
        for rank in 0..2 {
            let line = format!("ipc rank {rank}: ok {case}:");
            assert!(text.contains(&line), "missing `{line}`\n{text}");
        }
    }
}

/// One rank of [`copy_engine_across_two_processes_matches_the_cpu_backend`].
#[test]
#[ignore = "a rank process of copy_engine_across_two_processes_matches_the_cpu_backend"]
fn ipc_rank_copy_engine() {
    let (env, rdv) = child_rank();
    for (i, (case, h, config)) in copy_cases(env.world_size).into_iter().enumerate() {
        let inputs = per_rank_inputs(&h, env.world_size, 100 + i as u64);
        let used = rank_vs_cpu(&case, &env, &rdv, &h, &inputs, &config);
        let names = ["collective_permute", "broadcast", "reduce_scatter"];
        let how = expect_transports(&case, &used, &names, Transport::CopyEngine);
        eprintln!("ipc rank {}: ok {case}: {how}", env.rank);
    }
    // Rank 0 serves the store: nobody leaves before everyone is done.
    rdv.barrier("gpu_ipc/copy/done", env.world_size, Duration::from_secs(60))
        .expect("the final barrier");
}

// ---- MoE over NVLink across processes --------------------------------------------------------

/// An example lowered for `ranks` (its level-1 program cuts the inputs).
fn compiled(example: &str, ranks: usize) -> Compiled {
    let path = crate::support::root().join(format!("examples/programs/{example}.mf"));
    let text = std::fs::read_to_string(path).expect("example exists");
    let params = BTreeMap::from([("ranks".to_string(), ranks as i64)]);
    let program = parse_program_with(&text, &params).expect("example parses");
    compile(&program, &Options::new().check(false)).expect("example compiles")
}

/// The MoE examples' per-rank inputs.
fn moe_inputs(c: &Compiled, seed: u64) -> PerRank {
    let l1 = c.level1().expect("lowered");
    let full = random_inputs(l1, seed).expect("inputs");
    scatter_inputs(l1, &full).expect("scattered inputs")
}

/// The MoE cases: name, example, whether steps are recorded as a CUDA graph.
const MOE_CASES: [(&str, &str, bool); 4] = [
    ("moe bf16", "moe_layer", false),
    ("moe fp8", "moe_layer_fp8", false),
    ("moe bf16 in a CUDA graph", "moe_layer", true),
    ("moe fp8 in a CUDA graph", "moe_layer_fp8", true),
];

fn moe_config(graph: bool) -> CudaConfig {
    CudaConfig {
        graph,
        steps: if graph { 3 } else { 1 },
        ..config()
    }
}

#[test]
fn nvlink_moe_across_two_processes_matches_the_cpu_backend() {
    if skip_unless(2, "nvlink_moe_across_two_processes_matches_the_cpu_backend") {
        return;
    }
    let (r, text) = launch_children("ipc_rank_moe");
    r.unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (case, _, _) in MOE_CASES {
        for rank in 0..2 {
            let line = format!("ipc rank {rank}: ok {case}:");
            assert!(text.contains(&line), "missing `{line}`\n{text}");
        }
    }
}

/// One rank of [`nvlink_moe_across_two_processes_matches_the_cpu_backend`].
#[test]
#[ignore = "a rank process of nvlink_moe_across_two_processes_matches_the_cpu_backend"]
fn ipc_rank_moe() {
    let (env, rdv) = child_rank();
    for (i, (case, example, graph)) in MOE_CASES.into_iter().enumerate() {
        let c = compiled(example, env.world_size);
        let inputs = moe_inputs(&c, 31 + i as u64);
        let used = rank_vs_cpu(case, &env, &rdv, c.host(), &inputs, &moe_config(graph));
        let how = expect_transports(
            case,
            &used,
            &["moe_dispatch", "moe_combine"],
            Transport::Nvlink,
        );
        eprintln!("ipc rank {}: ok {case}: {how}", env.rank);
    }
    rdv.barrier("gpu_ipc/moe/done", env.world_size, Duration::from_secs(60))
        .expect("the final barrier");
}

/// The same MoE layers in one process (one thread per GPU), recorded as a CUDA graph and
/// replayed 3 times, over NVLink, against the CPU backend; with the profile on, every replay
/// reports its own dispatch and combine intervals (event record nodes of the graph given fresh
/// events per replay), in stream order.
#[test]
fn nvlink_moe_in_a_cuda_graph_in_one_process_matches_the_cpu_backend() {
    let test = "nvlink_moe_in_a_cuda_graph_in_one_process_matches_the_cpu_backend";
    if skip_unless(2, test) {
        return;
    }
    for example in ["moe_layer", "moe_layer_fp8"] {
        let c = compiled(example, 2);
        let inputs = moe_inputs(&c, 53);
        let mut co = cpu_options();
        co.ranks = Some(2);
        let want = run_cpu(c.host(), RunInputs::PerRank(inputs.clone()), &co)
            .unwrap_or_else(|e| panic!("{example} on the CPU: {e}"));
        let config = CudaConfig {
            profile: true,
            ..moe_config(true)
        };
        let replays = config.steps;
        let options = CudaOptions {
            ranks: Some(2),
            config,
        };
        let got = run_cuda_timed(c.host(), RunInputs::PerRank(inputs), &options, 1, 2)
            .unwrap_or_else(|e| panic!("{example} recorded as a graph: {e}"));
        for rank in 0..2 {
            let of = |name: &str| -> Vec<(f64, f64)> {
                let mut v: Vec<(f64, f64)> = got
                    .intervals
                    .iter()
                    .filter(|i| i.rank == rank && i.name == name)
                    .map(|i| (i.start_us, i.end_us))
                    .collect();
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                v
            };
            let (d, cb) = (of("moe_dispatch"), of("moe_combine"));
            assert_eq!(d.len(), replays, "{example} rank {rank}: dispatches {d:?}");
            assert_eq!(cb.len(), replays, "{example} rank {rank}: combines {cb:?}");
            for i in 0..replays {
                assert!(d[i].0 <= d[i].1, "{example} rank {rank} replay {i}: {d:?}");
                assert!(
                    d[i].1 <= cb[i].0,
                    "{example} rank {rank} replay {i}: {d:?} {cb:?}"
                );
                assert!(
                    cb[i].0 <= cb[i].1,
                    "{example} rank {rank} replay {i}: {cb:?}"
                );
                if i + 1 < replays {
                    assert!(cb[i].1 <= d[i + 1].0, "{example} rank {rank}: {d:?} {cb:?}");
                }
            }
            assert!(
                got.times_us[rank].iter().all(|t| t.is_finite() && *t > 0.0),
                "{example} rank {rank}: {:?}",
                got.times_us[rank]
            );
        }
        for (rank, outs) in &want.outputs {
            for (t, w) in outs {
                let err = got.outcome.outputs[rank][t].rel_error(w).unwrap();
                assert!(
                    err <= tol(w.dtype()),
                    "{example} rank {rank} {t}: {err:.3e}"
                );
            }
            let how = expect_transports(
                example,
                &got.transports[rank],
                &["moe_dispatch", "moe_combine"],
                Transport::Nvlink,
            );
            eprintln!("{example} graph, rank {rank}: ok, {how}");
        }
    }
}
