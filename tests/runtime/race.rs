//! Race detection: a missing `wait` or `synchronize` is rejected with a specific message, and
//! the corrected program passes.

use crate::support::runtime as common;

use std::collections::BTreeMap;

use common::*;
use meshflow::runtime::data::TensorData;
use meshflow::runtime::ranks::RunError;
use meshflow::runtime::{run_and_compare, run_cpu, RunInputs, RuntimeError};

fn race_message(err: RunError) -> String {
    let RunError::Failed(f) = err else {
        panic!("expected a run failure, got {err}");
    };
    let races: Vec<&RuntimeError> = f
        .errors
        .iter()
        .filter(|e| matches!(e, RuntimeError::Race { .. }))
        .collect();
    assert!(!races.is_empty(), "expected a race error, got {f}");
    races[0].to_string()
}

#[test]
fn missing_wait_on_a_collective_permute_is_a_race() {
    let d = 4;
    let good = ring_host(d);
    let text = good.to_string();
    assert!(text.contains("    wait c0\n"));
    let racy = meshflow::ir::parse_host(&text.replace("    wait c0\n", "")).unwrap();
    let l1 = level1("ring_linear.mf", &[("d", d)]);
    let err = run_and_compare(&l1, &racy, d as usize, 1, &options()).unwrap_err();
    let meshflow::runtime::compare::CompareError::Run(err) = err else {
        panic!("expected a run error, got {err}");
    };
    let msg = race_message(err);
    eprintln!("{msg}");
    assert!(msg.contains("race"), "{msg}");
    assert!(
        msg.contains("c0 = collective_permute(x -> ag_chunk"),
        "{msg}"
    );
    assert!(msg.contains("linear(ag_chunk, w -> y_chunk)"), "{msg}");
    assert!(msg.contains("missing `wait c0`"), "{msg}");
    assert!(msg.contains("at i0=0"), "{msg}");
    // The same program with the wait passes.
    let ok = run_and_compare(&l1, &good, d as usize, 1, &options()).unwrap();
    assert!(ok.passed(), "{ok}");
}

fn stream_program(sync_main: bool, sync_workers: bool) -> meshflow::ir::HostProgram {
    let t = r#"
host streams {
  mesh m0 = [0, 1]
  in x: f32[8, 4] on m0
  out y: f32[8, 4] on m0
  tensor a: f32[8, 4] on m0
  tensor a_chunk: f32[4, 4] on m0
  tensor y_chunk: f32[4, 4] on m0
  allocate a
  gelu(x -> a)
  s0 = get_current_stream
  for i0 in 0..2 {
    set_current_stream worker(i0)
$SYNC_MAIN    a_chunk = shard_by_stream(a, axis=0, chunks=2, index=i0)
    y_chunk = shard_by_stream(y, axis=0, chunks=2, index=i0)
    silu(a_chunk -> y_chunk)
  }
  set_current_stream s0
  for i1 in 0..2 {
$SYNC_WORKERS  }
  copy(y -> a)
  deallocate a
}
"#;
    let text = t
        .replace(
            "$SYNC_MAIN",
            if sync_main {
                "    synchronize s0\n"
            } else {
                ""
            },
        )
        .replace(
            "$SYNC_WORKERS",
            if sync_workers {
                "    synchronize worker(i1)\n"
            } else {
                ""
            },
        );
    meshflow::ir::parse_host(&text).unwrap()
}

fn run_streams(host: &meshflow::ir::HostProgram) -> Result<BTreeMap<String, TensorData>, RunError> {
    let x = TensorData::random(meshflow::ir::DType::F32, &[8, 4], 3).unwrap();
    let inputs = BTreeMap::from([
        (0, BTreeMap::from([("x".to_string(), x.clone())])),
        (1, BTreeMap::from([("x".to_string(), x)])),
    ]);
    let out = run_cpu(host, RunInputs::PerRank(inputs), &options())?;
    Ok(out.outputs[&0].clone())
}

#[test]
fn missing_synchronize_is_a_race() {
    // The workers read `a` written on the main stream without `synchronize s0`.
    let msg = race_message(run_streams(&stream_program(false, true)).unwrap_err());
    eprintln!("{msg}");
    assert!(
        msg.contains("`gelu(x -> a)` writes on stream main"),
        "{msg}"
    );
    assert!(
        msg.contains("`silu(a_chunk -> y_chunk)` at i0=0 reads on stream worker 0"),
        "{msg}"
    );
    assert!(
        msg.contains("missing `synchronize` of stream main on stream worker 0"),
        "{msg}"
    );
    // The main stream reads `y` written on the workers without synchronizing them.
    let msg = race_message(run_streams(&stream_program(true, false)).unwrap_err());
    eprintln!("{msg}");
    assert!(msg.contains("`copy(y -> a)`"), "{msg}");
    assert!(
        msg.contains("missing `synchronize` of stream worker"),
        "{msg}"
    );
    // Corrected: passes and computes silu(gelu(x)).
    let out = run_streams(&stream_program(true, true)).unwrap();
    let x = TensorData::random(meshflow::ir::DType::F32, &[8, 4], 3).unwrap();
    let want: Vec<f32> = x
        .storage()
        .to_f32_vec()
        .into_iter()
        .map(|v| {
            meshflow::runtime::cpu_ops::silu_scalar(meshflow::runtime::cpu_ops::gelu_scalar(v))
        })
        .collect();
    assert_eq!(out["y"].storage().to_f32_vec(), want);
}

#[test]
fn overwriting_a_communication_input_before_wait_is_a_race() {
    let t = r#"
host overwrite {
  mesh m0 = [0, 1]
  in x: f32[4] on m0
  out y: f32[4] on m0
  tensor a: f32[4] on m0
  allocate a
  copy(x -> a)
  c0 = all_reduce(a -> y, team=slice(m0, DIDx), op=sum)
$WAIT  gelu(x -> a)
  deallocate a
}
"#;
    let x = TensorData::from_f32(meshflow::ir::DType::F32, &[4], &[1., 2., 3., 4.]).unwrap();
    let per_rank = BTreeMap::from([
        (0, BTreeMap::from([("x".to_string(), x.clone())])),
        (1, BTreeMap::from([("x".to_string(), x)])),
    ]);
    let racy = meshflow::ir::parse_host(&t.replace("$WAIT", "")).unwrap();
    let err = run_cpu(&racy, RunInputs::PerRank(per_rank.clone()), &options()).unwrap_err();
    let msg = race_message(err);
    eprintln!("{msg}");
    assert!(msg.contains("c0 = all_reduce(a -> y"), "{msg}");
    assert!(msg.contains("`gelu(x -> a)` writes"), "{msg}");
    assert!(msg.contains("missing `wait c0`"), "{msg}");
    let fixed = meshflow::ir::parse_host(&t.replace("$WAIT", "  wait c0\n")).unwrap();
    let out = run_cpu(&fixed, RunInputs::PerRank(per_rank.clone()), &options()).unwrap();
    assert_eq!(
        out.outputs[&1]["y"].storage().to_f32_vec(),
        vec![2., 4., 6., 8.]
    );
    // With race checking off the racy program runs (the CPU backend executes eagerly).
    let mut opts = options();
    opts.config.race_check = false;
    assert!(run_cpu(&racy, RunInputs::PerRank(per_rank), &opts).is_ok());
}

/// The lowered chunked all-reduce loop (`row_parallel_linear_chunked`) with `n` chunks on two
/// ranks: a linear into a double-buffered chunk on worker `i % 2`, an all-reduce of it into
/// chunk `i` of `y`, a wait.
fn stream_all_reduce(n: i64) -> meshflow::ir::HostProgram {
    let t = r#"
host stream_all_reduce {
  mesh m0 = [0, 1]
  in x: f32[$ROWS, 8] on m0
  in w: f32[6, 8] on m0
  out y: f32[$ROWS, 6] on m0
  tensor x_chunk: f32[2, 8] on m0
  tensor p_chunk: f32[2, 6] on m0
  tensor y_chunk: f32[2, 6] on m0
  tensor ring: f32[4, 6] on m0
  allocate y
  allocate ring
  s0 = get_current_stream
  for i0 in 0..$N {
    set_current_stream worker(i0 % 2)
    synchronize s0
    x_chunk = shard_by_stream(x, axis=0, chunks=$N, index=i0)
    p_chunk = shard_by_stream(ring, axis=0, chunks=2, index=i0 % 2)
    linear(x_chunk, w -> p_chunk)
    y_chunk = shard_by_stream(y, axis=0, chunks=$N, index=i0)
    c0 = all_reduce(p_chunk -> y_chunk, team=slice(m0, DIDx), op=sum)
    wait c0
  }
  set_current_stream s0
  for i1 in 0..2 {
    synchronize worker(i1)
  }
  deallocate ring
}
"#;
    host(t, &[("ROWS", 2 * n), ("N", n)])
}

/// Runs `host` on two ranks with one evaluator each and returns rank 0's race-check cost.
fn race_cost(host: &meshflow::ir::HostProgram) -> meshflow::runtime::cpu::RaceCheckCost {
    use meshflow::ir::{DType, Role};
    use meshflow::runtime::cpu::{CpuBackend, Fabric};
    use meshflow::runtime::{EvalOptions, Evaluator};
    let fabric = std::sync::Arc::new(Fabric::new());
    let config = options().config;
    let inputs: BTreeMap<String, TensorData> = host
        .tensors
        .values()
        .filter(|t| t.role == Role::Input)
        .map(|t| {
            (
                t.name.clone(),
                TensorData::random(DType::F32, &t.shape, 5).unwrap(),
            )
        })
        .collect();
    let costs: Vec<_> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..2)
            .map(|rank| {
                let (fabric, config, inputs) = (fabric.clone(), &config, &inputs);
                s.spawn(move || {
                    let backend = CpuBackend::new(rank, fabric, config);
                    let mut ev = Evaluator::new(host, backend, EvalOptions::default()).unwrap();
                    ev.run(inputs).unwrap();
                    ev.backend().race_check_cost()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    costs[0]
}

/// The race checker's work grows linearly with the iterations: 20x more iterations of a
/// stream all-reduce loop check 20x more accesses for at most ~20x the work (a checker
/// that scans every earlier access of a buffer does ~10x more work per access at 2000
/// iterations than at 100). Work is counted, not timed.
#[test]
fn race_checking_costs_linear_work_in_the_iterations() {
    let small = race_cost(&stream_all_reduce(100));
    let large = race_cost(&stream_all_reduce(2000));
    eprintln!("100 iterations: {small:?}; 2000 iterations: {large:?}");
    assert!(small.accesses >= 500, "{small:?}");
    assert_eq!(
        large.accesses * 100,
        small.accesses * 2000,
        "{large:?} vs {small:?}"
    );
    let per_access = |c: meshflow::runtime::cpu::RaceCheckCost| c.work as f64 / c.accesses as f64;
    assert!(per_access(large) <= 8.0, "{large:?}");
    assert!(
        large.work <= 21 * small.work,
        "20x the iterations cost {}x the work",
        large.work as f64 / small.work as f64
    );
}

/// The figures of docs/hardening.md: CPU-backend run time of the stream all-reduce loop on
/// two ranks, with and without race checking. Prints rows; asserts nothing about time (run
/// it optimized: `cargo test --release --test runtime -- --ignored --nocapture race_check_timings`).
#[test]
#[ignore = "timing figures for docs/hardening.md, run by scripts/hardening.sh"]
fn race_check_timings() {
    use meshflow::ir::{DType, Role};
    for n in [1_000, 10_000, 20_000, 40_000] {
        let host = stream_all_reduce(n);
        let x = TensorData::random(DType::F32, &[2 * n as u64, 8], 1).unwrap();
        let w = TensorData::random(DType::F32, &[6, 8], 2).unwrap();
        let per_rank: BTreeMap<usize, BTreeMap<String, TensorData>> = (0..2)
            .map(|r| {
                let inputs = host
                    .tensors
                    .values()
                    .filter(|t| t.role == Role::Input)
                    .map(|t| {
                        let data = if t.name == "x" { x.clone() } else { w.clone() };
                        (t.name.clone(), data)
                    })
                    .collect();
                (r, inputs)
            })
            .collect();
        let mut cells = vec![n.to_string()];
        for race_check in [true, false] {
            let mut opts = options();
            opts.config.race_check = race_check;
            let started = std::time::Instant::now();
            run_cpu(&host, RunInputs::PerRank(per_rank.clone()), &opts).unwrap();
            cells.push(format!("{:.0} ms", started.elapsed().as_secs_f64() * 1e3));
        }
        eprintln!("HARDENING|race_time|{}", cells.join("|"));
    }
}
