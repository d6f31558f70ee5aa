//! Resource checks on the CPU backend: an embedder runs each example step after step with one
//! reused `Evaluator` per rank; after 1000 steps the process holds what it held after 10
//! (resident memory, CPU buffers, messages in flight), and no thread or file descriptor is
//! leaked. One-shot `run_cpu` calls are checked the same way.

use crate::support::hardening as hardening_support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Barrier, Mutex};

use hardening_support::*;
use meshflow::ir::{parse_program, DeviceId, HostProgram, Program};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cpu::{BufferStats, Fabric};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::{
    run_cpu_observed, CpuBackend, CpuConfig, CpuOptions, EvalOptions, Evaluator, RunInputs,
};
use meshflow::{compile, Options};

const WARMUP: usize = 10;
/// Steps of the embedder loop: 1000, or `MESHFLOW_HARDENING_STEPS` to look further.
fn steps() -> usize {
    std::env::var("MESHFLOW_HARDENING_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}
/// Resident memory may move by allocator noise (glibc arenas, page granularity), not grow
/// with the step count: 1000 leaked bytes per step would already be ~1 MiB.
const RSS_SLACK_KIB: u64 = 512;

fn examples() -> Vec<(String, Program, HostProgram)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/programs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/programs")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "mf"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 11, "the eleven example programs");
    files
        .into_iter()
        .map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).unwrap();
            let l1 = parse_program(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let host = compile(&l1, &Options::new().check(false))
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .host()
                .clone();
            (name, l1, host)
        })
        .collect()
}

/// What the process and the ranks hold at one point.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    rss_kib: u64,
    hwm_kib: u64,
    fds: usize,
    live: BufferStats,
    in_flight: BufferStats,
}

type Outputs = BTreeMap<String, TensorData>;

/// Runs `host` for `STEPS` steps on one reused evaluator per rank (threads that live for the
/// whole loop, as an embedder's would) and snapshots after `WARMUP` and after `STEPS` steps.
fn embedder_loop(
    l1: &Program,
    host: &HostProgram,
) -> (Snapshot, Snapshot, BTreeMap<DeviceId, Outputs>) {
    let world = host.world_size();
    let inputs = scatter_inputs(l1, &random_inputs(l1, 5).unwrap()).unwrap();
    let empty = BTreeMap::new();
    let fabric = Arc::new(Fabric::new());
    let config = CpuConfig::default();
    let barrier = Barrier::new(world + 1);
    let live: Mutex<Vec<BufferStats>> = Mutex::new(vec![BufferStats::default(); world]);
    let first: Mutex<BTreeMap<DeviceId, Outputs>> = Mutex::new(BTreeMap::new());
    let snap = |live: &Mutex<Vec<BufferStats>>| {
        let live = live.lock().unwrap();
        Snapshot {
            rss_kib: status("VmRSS"),
            hwm_kib: status("VmHWM"),
            fds: open_fds(),
            live: BufferStats {
                buffers: live.iter().map(|s| s.buffers).sum(),
                bytes: live.iter().map(|s| s.bytes).sum(),
            },
            in_flight: fabric.in_flight(),
        }
    };
    let (mut warm, mut end) = (Snapshot::default(), Snapshot::default());
    let steps = steps();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for rank in 0..world {
            let (fabric, config, barrier, live, first) =
                (&fabric, &config, &barrier, &live, &first);
            let inputs = inputs.get(&rank).unwrap_or(&empty);
            let handle = std::thread::Builder::new()
                .name(format!("embedder-rank-{rank}"))
                .spawn_scoped(scope, move || {
                    let backend = CpuBackend::new(rank, fabric.clone(), config);
                    let mut ev = Evaluator::new(host, backend, EvalOptions::default()).unwrap();
                    for step in 1..=steps {
                        let out = ev
                            .run(inputs)
                            .unwrap_or_else(|e| panic!("step {step}: {e}"));
                        let held = ev.backend().live_buffers();
                        assert!(
                            held.is_empty(),
                            "rank {rank} holds {held} after step {step}"
                        );
                        live.lock().unwrap()[rank] = held;
                        if step == 1 {
                            first.lock().unwrap().insert(rank, out);
                        } else if step == steps {
                            // Reusing the evaluator changes nothing: the last step's outputs
                            // are bit-identical to the first's.
                            let first = first.lock().unwrap();
                            let want = &first[&rank];
                            assert_eq!(out.len(), want.len());
                            for (name, t) in &out {
                                assert!(t.bit_eq(&want[name]), "rank {rank} `{name}` drifted");
                            }
                        }
                        if step == WARMUP || step == steps {
                            barrier.wait();
                            barrier.wait();
                        }
                    }
                })
                .expect("spawn rank thread");
            handles.push(handle);
        }
        barrier.wait();
        warm = snap(&live);
        barrier.wait();
        barrier.wait();
        end = snap(&live);
        barrier.wait();
        for h in handles {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
    let first = first.into_inner().unwrap();
    (warm, end, first)
}

#[test]
fn a_reused_evaluator_holds_after_1000_steps_what_it_held_after_10() {
    let _serial = serial();
    for (name, l1, host) in examples() {
        let (warm, end, _) = embedder_loop(&l1, &host);
        eprintln!(
            "{name}: after {WARMUP}: {warm:?}\n{name}: after {}: {end:?}",
            steps()
        );
        assert_eq!(
            threads_left("embedder-rank"),
            0,
            "{name}: rank threads left"
        );
        assert!(
            warm.live.is_empty() && end.live.is_empty(),
            "{name}: buffers held"
        );
        assert!(
            warm.in_flight.is_empty() && end.in_flight.is_empty(),
            "{name}: messages left"
        );
        assert_eq!(end.fds, warm.fds, "{name}: file descriptors leaked");
        assert!(
            end.rss_kib <= warm.rss_kib + RSS_SLACK_KIB,
            "{name}: resident memory grew from {} KiB to {} KiB",
            warm.rss_kib,
            end.rss_kib
        );
        row(
            "memory",
            &[
                "cpu".into(),
                name.clone(),
                host.world_size().to_string(),
                format!("{} KiB / {} KiB", warm.rss_kib, end.rss_kib),
                format!("{} KiB / {} KiB", warm.hwm_kib, end.hwm_kib),
                format!("{} / {}", warm.live, end.live),
                format!("{} / {}", warm.fds, end.fds),
            ],
        );
    }
}

#[test]
fn one_shot_runs_leave_no_threads_descriptors_or_buffers() {
    let _serial = serial();
    for (name, l1, host) in examples() {
        let inputs = random_inputs(&l1, 5).unwrap();
        let options = CpuOptions::default();
        let run = || {
            let (result, resources) = run_cpu_observed(
                &host,
                RunInputs::Full {
                    program: &l1,
                    inputs: &inputs,
                },
                &options,
            );
            result.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(resources.threads_joined, resources.threads_started);
            assert!(resources.held_at_exit.values().all(BufferStats::is_empty));
            assert!(resources.undelivered.is_empty());
            assert_eq!(cpu_threads(), 0, "{name}: a rank thread survived");
        };
        for _ in 0..WARMUP {
            run();
        }
        let (rss, fds) = (status("VmRSS"), open_fds());
        for _ in 0..100 {
            run();
        }
        eprintln!(
            "{name}: one-shot runs: {rss} KiB -> {} KiB",
            status("VmRSS")
        );
        assert_eq!(open_fds(), fds, "{name}: file descriptors leaked");
        assert!(
            status("VmRSS") <= rss + RSS_SLACK_KIB,
            "{name}: resident memory grew from {rss} KiB to {} KiB",
            status("VmRSS")
        );
    }
}
