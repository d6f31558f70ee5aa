//! Determinism on the CPU backend: every example gives bit-identical outputs on every rank
//! across runs with the same seed, across stream-pool sizes of the backend (1, 2, 4, 8), and
//! across the number of worker streams the lowering uses (1, 2, 4: only stream assignment
//! changes, the chunks and the order of every reduction stay the same). Different seeds give
//! different inputs and different outputs.

use crate::support::hardening as hardening_support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use hardening_support::row;
use meshflow::ir::{parse_program, DeviceId, HostProgram, Program};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_cpu, CpuConfig, CpuOptions, RunInputs};
use meshflow::{compile, Options};

type Outputs = BTreeMap<DeviceId, BTreeMap<String, TensorData>>;

fn examples() -> Vec<(String, Program)> {
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
            (
                name.clone(),
                parse_program(&text).unwrap_or_else(|e| panic!("{name}: {e}")),
            )
        })
        .collect()
}

fn lower(l1: &Program, num_streams: usize) -> HostProgram {
    let options = Options::new().check(false).streams(num_streams);
    compile(l1, &options)
        .expect("the example lowers")
        .host()
        .clone()
}

fn run(l1: &Program, host: &HostProgram, seed: u64, stream_pool: usize) -> Outputs {
    let inputs = random_inputs(l1, seed).unwrap();
    let options = CpuOptions {
        config: CpuConfig {
            stream_pool,
            ..CpuConfig::default()
        },
        ..CpuOptions::default()
    };
    let inputs = RunInputs::Full {
        program: l1,
        inputs: &inputs,
    };
    run_cpu(host, inputs, &options)
        .unwrap_or_else(|e| panic!("{}: {e}", l1.name))
        .outputs
}

/// True when both runs hold the same outputs on the same ranks, bit for bit.
fn bit_identical(a: &Outputs, b: &Outputs) -> bool {
    a.len() == b.len()
        && a.iter().all(|(rank, outs)| {
            b.get(rank).is_some_and(|other| {
                outs.len() == other.len()
                    && outs
                        .iter()
                        .all(|(name, t)| other.get(name).is_some_and(|u| t.bit_eq(u)))
            })
        })
}

#[test]
fn examples_are_bit_identical_across_runs_stream_pools_and_lowerings() {
    let _serial = hardening_support::serial();
    for (name, l1) in examples() {
        let host = lower(&l1, 2);
        let first = run(&l1, &host, 11, 4);
        assert!(!first.is_empty(), "{name}: no outputs");
        for _ in 0..2 {
            assert!(
                bit_identical(&first, &run(&l1, &host, 11, 4)),
                "{name}: two runs with the same seed differ"
            );
        }
        for pool in [1, 2, 8] {
            assert!(
                bit_identical(&first, &run(&l1, &host, 11, pool)),
                "{name}: stream pool {pool} differs from 4"
            );
        }
        let mut lowerings_differ = false;
        for streams in [1, 4] {
            let other = lower(&l1, streams);
            lowerings_differ |= other.to_string() != host.to_string();
            assert!(
                bit_identical(&first, &run(&l1, &other, 11, 4)),
                "{name}: lowering with {streams} worker stream(s) differs from 2"
            );
        }
        let other_seed = run(&l1, &host, 12, 4);
        assert!(
            !bit_identical(&first, &other_seed),
            "{name}: seeds 11 and 12 give the same outputs"
        );
        row(
            "determinism",
            &[
                "cpu".into(),
                name.clone(),
                "3 runs bit-identical".into(),
                "stream pool 1/2/4/8 bit-identical".into(),
                format!(
                    "lowering streams 1/2/4 bit-identical ({})",
                    if lowerings_differ {
                        "host programs differ"
                    } else {
                        "same host program"
                    }
                ),
                "seeds 11 vs 12 differ".into(),
            ],
        );
    }
}

#[test]
fn different_seeds_give_different_inputs() {
    let _serial = hardening_support::serial();
    for (name, l1) in examples() {
        let (a, b) = (
            random_inputs(&l1, 1).unwrap(),
            random_inputs(&l1, 2).unwrap(),
        );
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        for (input, t) in &a {
            assert!(
                !t.bit_eq(&b[input]),
                "{name}: input `{input}` is the same for seeds 1, 2"
            );
            assert!(
                t.bit_eq(&random_inputs(&l1, 1).unwrap()[input]),
                "{name}: input `{input}` differs for the same seed"
            );
        }
    }
}
