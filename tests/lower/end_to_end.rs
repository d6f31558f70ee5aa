//! End to end: every example (and the programs of the decision-table rows that need no
//! special mesh) is compiled, checked across ranks (`check_program`: team sequences, peers,
//! send/recv matching, deadlocks), executed on the CPU backend and compared with the
//! unsharded reference, at every rank count it supports and with 1, 2 and 3 worker streams.

use crate::support::programs as common;

use meshflow::check::check_program;
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;
use meshflow::{compile, Options};

fn run(name: &str, program: &meshflow::ir::Program, streams: usize) {
    let options = Options::new().check(false).streams(streams);
    let compiled = compile(program, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    let world = compiled.host().world_size();
    check_program(compiled.host(), world)
        .unwrap_or_else(|e| panic!("{name}: cross-rank check failed:\n{e}\n{}", compiled.host()));
    let cmp = run_and_compare(
        compiled.level1().expect("lowered"),
        compiled.host(),
        world,
        7,
        &CpuOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: run failed: {e}\n{}", compiled.host()));
    assert!(cmp.passed(), "{name}: {cmp}\n{}", compiled.host());
}

#[test]
fn every_example_matches_the_reference_at_every_rank_count() {
    let mut runs = 0;
    for name in common::EXAMPLES {
        for ranks in [1, 2, 3, 4, 8] {
            let Some(program) = common::example(name, ranks) else {
                continue;
            };
            for streams in [1, 2, 3] {
                run(
                    &format!("{name} ranks={ranks} streams={streams}"),
                    &program,
                    streams,
                );
                runs += 1;
            }
        }
    }
    assert_eq!(runs, (7 * 5 + 4 * 4) * 3);
}

#[test]
fn the_transformer_matches_the_reference() {
    run("transformer", &common::transformer(2, 2, 2), 2);
}
