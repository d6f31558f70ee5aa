//! Determinism and host memory on GPUs (CUDA + NCCL): every example (those whose world size
//! the machine has) gives bit-identical outputs on every rank across runs with the same seed
//! and the same configuration (NCCL picks the same algorithm and protocol for a fixed rank
//! count and size; across configurations its reductions may differ in the last bits). MoE
//! rows arrive in an unspecified order across NVLink by design, but the combine accumulates
//! in top-k order, so `y` is still bit-identical. A run of 1000 iterations on the same
//! backends leaves the host's high-water mark where a run of 10 left it.
//!
//! Built with the `cuda` feature only: `cargo test --features cuda --test gpu determinism::`.
#![cfg(feature = "cuda")]

use crate::support::gpu as support;
use crate::support::hardening as hardening_support;

use std::path::PathBuf;

use hardening_support::{row, serial, status};
use meshflow::ir::{parse_program, HostProgram, Program};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cuda::{run_cuda, run_cuda_timed};
use meshflow::runtime::RunInputs;
use meshflow::{compile, Options};

fn examples() -> Vec<(String, Program, HostProgram)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/programs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/programs")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "mf"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let l1 = parse_program(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let host = compile(&l1, &Options::new().check(false))
                .unwrap()
                .host()
                .clone();
            (name, l1, host)
        })
        .collect()
}

#[test]
fn gpu_examples_are_bit_identical_across_runs() {
    let _serial = serial();
    for (name, l1, host) in examples() {
        let d = host.world_size();
        if support::skip_unless(d, &format!("gpu determinism of {name}")) {
            continue;
        }
        let inputs = random_inputs(&l1, 11).unwrap();
        let run = || {
            let full = RunInputs::Full {
                program: &l1,
                inputs: &inputs,
            };
            run_cuda(&host, full, &support::cuda_options())
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .outputs
        };
        let first = run();
        for _ in 0..2 {
            let again = run();
            for (rank, outs) in &first {
                for (out, t) in outs {
                    assert!(
                        again[rank][out].bit_eq(t),
                        "{name}: rank {rank} `{out}` differs between runs"
                    );
                }
            }
        }
        row(
            "determinism",
            &[
                "cuda".into(),
                name.clone(),
                "3 runs bit-identical".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ],
        );
    }
}

#[test]
fn gpu_host_memory_after_1000_iterations_equals_after_10() {
    let _serial = serial();
    for (name, l1, host) in examples() {
        let d = host.world_size();
        if support::skip_unless(d, &format!("gpu host memory of {name}")) {
            continue;
        }
        let inputs = random_inputs(&l1, 5).unwrap();
        let run = |iterations| {
            let full = RunInputs::Full {
                program: &l1,
                inputs: &inputs,
            };
            run_cuda_timed(&host, full, &support::cuda_options(), 0, iterations)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            (status("VmRSS"), status("VmHWM"))
        };
        let (rss10, hwm10) = run(10);
        let (rss1000, hwm1000) = run(1000);
        eprintln!("{name}: VmRSS {rss10} -> {rss1000} KiB, VmHWM {hwm10} -> {hwm1000} KiB");
        assert!(
            hwm1000 <= hwm10 + 4096,
            "{name}: host memory grew with iterations"
        );
        row(
            "memory",
            &[
                "cuda".into(),
                name.clone(),
                d.to_string(),
                format!("{rss10} KiB / {rss1000} KiB"),
                format!("{hwm10} KiB / {hwm1000} KiB"),
                "-".into(),
                "-".into(),
            ],
        );
    }
}
