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
