//! The example programs (`examples/programs/*.mf`) and the hand-written host programs
//! (`ir/tests/data/host/*.mfh`): parse, verify, print, and round-trip.

mod common;

use common::{examples, host_examples};
use meshflow_ir::{
    parse_host, parse_program, parse_program_with, verify_host, verify_program, Params,
};

#[test]
fn examples_parse_verify_and_round_trip() {
    for (name, text) in examples() {
        let program = parse_program(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Err(e) = verify_program(&program) {
            panic!("{name} does not verify:\n{e}");
        }
        let printed = program.to_string();
        let reparsed = parse_program(&printed).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(reparsed, program, "{name}: parse(print(p)) != p");
        assert_eq!(
            reparsed.to_string(),
            printed,
            "{name}: printing is not canonical"
        );
        // Locations point at the first token of each line of the printed text.
        let first_op = reparsed.ops.first().and_then(|op| op.loc.span());
        let expected_line = 2 + reparsed.meshes.len() + reparsed.tensors.len();
        assert_eq!(
            first_op.map(|s| (s.line as usize, s.col)),
            Some((expected_line, 3)),
            "{name}"
        );
        insta::assert_snapshot!(name.as_str(), printed);
    }
}

/// What each example gives with `ranks` overridden: `Ok(devices)` or `Err((line, col,
/// message))`.
#[test]
fn examples_with_other_rank_counts() {
    type Expected = Result<usize, (u32, u32, &'static str)>;
    let d = |n: usize| -> Expected { Ok(n) };
    // mlp_2d_mesh with ranks = 3 gets dp = 3 / 2 = 1: a 1x2 mesh on 2 of the 3 ranks.
    let table: &[(&str, [Expected; 4])] = &[
        ("column_parallel_linear_broadcast", [d(1), d(2), d(3), d(8)]),
        (
            "column_parallel_linear_collective",
            [d(1), d(2), d(3), d(8)],
        ),
        ("column_parallel_linear_ring", [d(1), d(2), d(3), d(8)]),
        (
            "fsdp_tp_weight",
            [
                Err((13, 17, "mesh `m`: iota(0, 2) has no devices (dp = 0)")),
                d(2),
                d(2),
                d(8),
            ],
        ),
        (
            "mlp_2d_mesh",
            [
                Err((8, 17, "mesh `m`: iota(0, 2) has no devices (dp = 0)")),
                d(2),
                d(2),
                d(8),
            ],
        ),
        ("moe_layer", [d(1), d(2), d(3), d(8)]),
        ("moe_layer_fp8", [d(1), d(2), d(3), d(8)]),
        (
            "pipeline_two_meshes",
            [
                Err((6, 22, "mesh `stage0`: iota(0) has no devices (d = 0)")),
                d(2),
                d(2),
                d(8),
            ],
        ),
        ("row_parallel_linear_chunked", [d(1), d(2), d(3), d(8)]),
        ("row_parallel_linear_ring", [d(1), d(2), d(3), d(8)]),
        (
            "transformer_block_2d",
            [
                Err((19, 17, "mesh `m`: iota(0, 2) has no devices (dp = 0)")),
                d(2),
                d(2),
                d(8),
            ],
        ),
    ];
    let all = examples();
    assert_eq!(all.len(), table.len(), "every example is in the table");
    for ((name, text), (expected_name, outcomes)) in all.iter().zip(table) {
        assert_eq!(name, expected_name);
        for (ranks, expected) in [1, 2, 3, 8].into_iter().zip(outcomes) {
            let params: Params = [("ranks".to_string(), ranks)].into_iter().collect();
            let got = parse_program_with(text, &params);
            match (got, expected) {
                (Ok(p), Ok(world)) => {
                    if let Err(e) = verify_program(&p) {
                        panic!("{name} with ranks = {ranks} does not verify:\n{e}");
                    }
                    assert_eq!(p.world_size(), *world, "{name} with ranks = {ranks}");
                    let printed = p.to_string();
                    assert_eq!(parse_program(&printed).as_ref(), Ok(&p), "{name}");
                }
                (Err(e), Err((line, col, message))) => {
                    assert_eq!((e.line, e.col, e.message.as_str()), (*line, *col, *message));
                }
                (got, expected) => {
                    panic!("{name} with ranks = {ranks}: got {got:?}, expected {expected:?}")
                }
            }
        }
    }
}

#[test]
fn host_programs_parse_verify_and_round_trip() {
    for (name, text) in host_examples() {
        let program = parse_host(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Err(e) = verify_host(&program) {
            panic!("{name} does not verify:\n{e}");
        }
        let printed = program.to_string();
        let reparsed = parse_host(&printed).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(reparsed, program, "{name}: parse(print(p)) != p");
        assert_eq!(
            reparsed.to_string(),
            printed,
            "{name}: printing is not canonical"
        );
        let stripped: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            printed, stripped,
            "{name}: the data file is written canonically"
        );
    }
}

#[test]
fn text_round_trips_through_from_str() {
    for (name, text) in examples() {
        let p: meshflow_ir::Program = text.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            p.to_string().parse::<meshflow_ir::Program>().as_ref(),
            Ok(&p)
        );
    }
    for (name, text) in host_examples() {
        let p: meshflow_ir::HostProgram = text.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            p.to_string().parse::<meshflow_ir::HostProgram>().as_ref(),
            Ok(&p)
        );
    }
}

#[test]
fn the_earlier_spelling_launch_kernel_still_parses() {
    let (_, text) = host_examples()
        .into_iter()
        .find(|(name, _)| name.contains("compute_and_kernels"))
        .expect("the kernels example");
    let old = text.replace("call_kernel(", "launch_kernel(");
    assert_ne!(old, text);
    let program = parse_host(&old).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(program, parse_host(&text).expect("parses"));
    assert!(program.to_string().contains("call_kernel("));
}
