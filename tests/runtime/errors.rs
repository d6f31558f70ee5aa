//! Evaluator errors name the rank, the instruction and the loop iteration; nothing panics.

use crate::support::runtime as common;

use std::collections::BTreeMap;

use common::options;
use meshflow::ir::{parse_host, DType};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_cpu, RunInputs};

fn run(text: &str, x_shape: &[u64]) -> String {
    let host = parse_host(text).unwrap_or_else(|e| panic!("{e}"));
    let x = TensorData::zeros(DType::F32, x_shape).unwrap();
    let inputs = BTreeMap::from([(0, BTreeMap::from([("x".to_string(), x)]))]);
    match run_cpu(&host, RunInputs::PerRank(inputs), &options()) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

const HEAD: &str = "host e {\n  mesh m0 = [0]\n  in x: f32[4, 2] on m0\n  out y: f32[4, 2] on m0\n  tensor v: f32[2, 2] on m0\n";

#[test]
fn bad_chunk_index_names_instruction_and_iteration() {
    let text = format!("{HEAD}  for i0 in 0..3 {{\n    v = shard_by_stream(y, axis=0, chunks=2, index=i0)\n    copy(x -> x)\n  }}\n}}\n");
    let err = run(&text, &[4, 2]);
    assert!(err.contains("rank 0: `v = shard_by_stream(y, axis=0, chunks=2, index=i0)` at i0=2: chunk index 2 is outside 0..2"), "{err}");
}

#[test]
fn unset_stream_variable_is_an_error() {
    let text = format!("{HEAD}  set_current_stream s3\n}}\n");
    let err = run(&text, &[4, 2]);
    assert!(
        err.contains("stream variable s3 is used before get_current_stream"),
        "{err}"
    );
}

#[test]
fn inputs_are_checked_by_name_and_type() {
    let text = format!("{HEAD}  copy(x -> y)\n}}\n");
    assert_eq!(run(&text, &[4, 2]), "ok");
    let err = run(&text, &[2, 4]);
    assert!(
        err.contains("input `x`: must be f32[4, 2] on this rank, got f32[2, 4]"),
        "{err}"
    );
    let host = parse_host(&text).unwrap();
    let err = run_cpu(&host, RunInputs::PerRank(BTreeMap::new()), &options())
        .unwrap_err()
        .to_string();
    assert!(err.contains("input `x`: not supplied"), "{err}");
}

#[test]
fn deallocating_an_input_and_using_a_released_buffer_are_errors() {
    let err = run(&format!("{HEAD}  deallocate x\n}}\n"), &[4, 2]);
    assert!(
        err.contains("`x` is a program input; it cannot be deallocated"),
        "{err}"
    );
    let text = "host e {\n  mesh m0 = [0]\n  in x: f32[4, 2] on m0\n  out y: f32[4, 2] on m0\n  tensor t: f32[4, 2] on m0\n  tensor v: f32[2, 2] on m0\n  allocate t\n  v = shard_by_stream(t, axis=0, chunks=2, index=0)\n  deallocate t\n  copy(v -> v)\n}\n";
    let err = run(text, &[4, 2]);
    assert!(
        err.contains("`copy(v -> v)`: use of a released buffer"),
        "{err}"
    );
}

#[test]
fn shape_mismatches_in_compute_are_errors() {
    let text = "host e {\n  mesh m0 = [0]\n  in x: f32[4, 2] on m0\n  out y: f32[3, 2] on m0\n  gelu(x -> y)\n}\n";
    let err = run(text, &[4, 2]);
    assert!(
        err.contains("`gelu(x -> y)`: gelu: the output must have shape [4, 2], has [3, 2]"),
        "{err}"
    );
}

/// Regression (fuzzing): an absurd extent (`f32[999999999999, 9]`) aborted the process
/// ("memory allocation failed"); it is now an error naming the allocation, as is exceeding
/// the CPU backend's per-rank memory limit.
#[test]
fn absurd_and_over_limit_allocations_are_errors() {
    let huge = "host e {\n  mesh m0 = [0]\n  in x: f32[4, 2] on m0\n  out y: f32[4, 2] on m0\n  tensor big: f32[999999999999, 9] on m0\n  allocate big\n  copy(x -> y)\n  deallocate big\n}\n";
    let err = run(huge, &[4, 2]);
    assert!(
        err.contains("`allocate big`") && err.contains("cannot allocate"),
        "{err}"
    );

    let big = huge.replace("999999999999, 9", "1024, 1024");
    assert_eq!(run(&big, &[4, 2]), "ok");
    let host = parse_host(&big).unwrap();
    let x = TensorData::zeros(DType::F32, &[4, 2]).unwrap();
    let inputs = BTreeMap::from([(0, BTreeMap::from([("x".to_string(), x)]))]);
    let mut opts = options();
    opts.config.memory_limit = Some(1 << 20);
    let err = run_cpu(&host, RunInputs::PerRank(inputs), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`allocate big`") && err.contains("over the memory limit of 1048576 bytes"),
        "{err}"
    );
}

/// Regression (fuzzing): seeded routing ids for an absurd top-k (`topk_idx: i32[4, 2^61]`)
/// panicked ("capacity overflow" reserving the ids); an error naming the input now.
#[test]
fn seeded_inputs_for_absurd_shapes_are_errors() {
    use meshflow::runtime::compare::random_inputs;
    let params = [("t", 1), ("h", 1), ("e", 1 << 60), ("k", 1 << 61)];
    let l1 = common::level1("moe_layer.mf", &params);
    let err = random_inputs(&l1, 0).unwrap_err().to_string();
    assert!(
        err.contains("topk_idx") && err.contains("cannot allocate"),
        "{err}"
    );
}
