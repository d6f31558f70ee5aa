//! Hand-written host programs that mirror how the examples are lowered, run on several rank
//! counts of the sim backend and compared with the level-1 reference.

#[path = "data/runtime/common.rs"]
mod common;

use std::collections::BTreeMap;

use common::*;
use meshflow::ir::parse_host;
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::{run_and_compare, run_sim, SimInputs};

const RANKS: [i64; 5] = [1, 2, 3, 4, 8];

fn check(name: &str, level1: &meshflow::ir::Program, host: &meshflow::ir::HostProgram, d: i64) {
    let cmp = run_and_compare(level1, host, d as usize, 42 + d as u64, &options())
        .unwrap_or_else(|e| panic!("{name} on {d} ranks: {e}"));
    eprintln!("{name} d={d}: {cmp}");
    assert!(cmp.passed(), "{name} on {d} ranks: {cmp}");
}

#[test]
fn ring_all_gather_linear_matches_reference() {
    for d in RANKS {
        check(
            "ring",
            &level1("ring_linear.mf", &[("d", d)]),
            &ring_host(d),
            d,
        );
    }
}

#[test]
fn broadcast_all_gather_linear_matches_reference() {
    for d in RANKS {
        check(
            "broadcast",
            &level1("broadcast_linear.mf", &[("d", d)]),
            &broadcast_host(d),
            d,
        );
    }
}

#[test]
fn chunked_all_reduce_matches_reference() {
    for d in RANKS {
        for s in [1, 3] {
            let l1 = level1("row_parallel_chunked.mf", &[("d", d), ("s", s)]);
            check("row_parallel", &l1, &row_parallel_host(d, s), d);
        }
    }
}

#[test]
fn moe_layer_matches_reference_including_expert_buffers() {
    for d in RANKS {
        for (t, e, k) in [(6, 2, 2), (5, 1, 1), (4, 3, 3)] {
            let l1 = level1(
                "moe_layer.mf",
                &[("d", d), ("t", t), ("e", e), ("k", k), ("h", 16), ("f", 8)],
            );
            check("moe", &l1, &moe_host(d, t, e, k, 16, 8), d);
        }
    }
}

#[test]
fn checked_in_ring_text_runs_on_four_ranks() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("ir/tests/data/host/ring_all_gather_linear.mfh"),
    )
    .expect("the ir crate's example exists");
    let host = parse_host(&text).expect("parses");
    check(
        "ring (ir example text)",
        &level1("ring_linear.mf", &[("d", 4)]),
        &host,
        4,
    );
}

#[test]
fn repeated_runs_are_bit_identical() {
    let l1 = level1("row_parallel_chunked.mf", &[("d", 4), ("s", 3)]);
    let host = row_parallel_host(4, 3);
    let inputs = random_inputs(&l1, 7).unwrap();
    let run = || {
        let out = run_sim(
            &host,
            SimInputs::Full {
                program: &l1,
                inputs: &inputs,
            },
            &options(),
        )
        .unwrap();
        out.gather(&l1).unwrap()
    };
    let first = run();
    for _ in 0..3 {
        let again = run();
        for (name, t) in &first {
            assert!(t.bit_eq(&again[name]), "{name} differs between runs");
        }
    }
    // And the comparison against the reference passes.
    let want = evaluate(&l1, &inputs).unwrap();
    assert!(compare_outputs(&l1, &first, &want).unwrap().passed());
}

#[test]
fn trace_has_one_event_per_executed_instruction() {
    let host = ring_host(2);
    let l1 = level1("ring_linear.mf", &[("d", 2)]);
    let inputs = random_inputs(&l1, 1).unwrap();
    let mut opts = options();
    opts.trace = true;
    let out = run_sim(
        &host,
        SimInputs::Full {
            program: &l1,
            inputs: &inputs,
        },
        &opts,
    )
    .unwrap();
    let trace = out.trace.expect("trace requested");
    // Per rank: allocate y, allocate ag, get stream, 2 x 7 loop instructions, set stream,
    // 2 synchronizes, deallocate.
    let per_rank: BTreeMap<usize, usize> = trace.events.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e.rank).or_default() += 1;
        m
    });
    assert_eq!(per_rank, BTreeMap::from([(0, 21), (1, 21)]));
    let json = trace.to_json();
    assert!(json.starts_with("{\"traceEvents\":["));
    assert!(json.contains("\"ph\":\"X\",\"name\":\"collective_permute\""));
    assert!(
        json.contains("\"tid\":2"),
        "worker streams appear as threads"
    );
}
