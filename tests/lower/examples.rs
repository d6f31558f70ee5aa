//! Lowers every example program of `examples/programs/*.mf` through the full pipeline:
//! snapshots at the default parameters, structural assertions, and every rank count where the
//! program parses, each verified with `verify_host`. The builder mirrors of the examples
//! (`tests/common`, used where the text is not needed) are checked equal to the parsed text.

use crate::support::programs as common;

use meshflow::ir::host::{CommKind, InstKind, Team};
use meshflow::ir::{parse_program_with, verify_host, HostProgram, Inst, Params, Program};
use meshflow::{compile, Options};

fn parse(name: &str, ranks: Option<i64>) -> Result<Program, meshflow::ir::ParseError> {
    let path = format!("{}/examples/programs/{name}.mf", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut params = Params::new();
    if let Some(r) = ranks {
        params.insert("ranks".into(), r);
    }
    parse_program_with(&text, &params)
}

fn lower(name: &str, ranks: u64) -> HostProgram {
    let program = parse(name, Some(ranks as i64)).expect("the example parses");
    compile(&program, &Options::new().check(false))
        .unwrap_or_else(|e| panic!("{name} at {ranks} ranks: {e}"))
        .host()
        .clone()
}

#[test]
fn the_examples_directory_holds_exactly_these_programs() {
    let dir = format!("{}/examples/programs", env!("CARGO_MANIFEST_DIR"));
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .expect("examples/programs exists")
        .filter_map(|e| {
            let p = e.ok()?.path();
            if p.extension()? != "mf" {
                return None;
            }
            Some(p.file_stem()?.to_string_lossy().into_owned())
        })
        .collect();
    found.sort();
    assert_eq!(found, common::EXAMPLES.to_vec());
}

#[test]
fn builder_mirrors_equal_the_parsed_examples() {
    for name in common::EXAMPLES {
        for ranks in [1, 2, 3, 4, 8] {
            let parsed = parse(name, Some(ranks)).ok();
            let built = common::example(name, ranks as u64);
            assert_eq!(parsed, built, "{name} at {ranks} ranks");
        }
    }
}

/// Every instruction with its loop depth.
fn insts(host: &HostProgram) -> Vec<(Inst, usize)> {
    let mut out = Vec::new();
    host.walk(&mut |i, d| out.push((i.clone(), d)));
    out
}

fn comms(host: &HostProgram, kind: CommKind) -> Vec<(Inst, usize)> {
    insts(host)
        .into_iter()
        .filter(|(i, _)| matches!(&i.kind, InstKind::Communication { kind: k, .. } if *k == kind))
        .collect()
}

fn stream_loops(host: &HostProgram) -> usize {
    host.body
        .iter()
        .filter(|i| {
            matches!(&i.kind, InstKind::ForLoop { body, .. }
                if body.iter().any(|b| b.kind.is_communication() || matches!(b.kind, InstKind::Compute { .. })))
        })
        .count()
}

#[test]
fn snapshots_of_every_example() {
    for name in common::EXAMPLES {
        insta::assert_snapshot!(name, lower(name, 4).to_string());
    }
}

#[test]
fn ring_is_one_collective_permute_in_one_stream_loop() {
    let host = lower("column_parallel_linear_ring", 4);
    let cps: Vec<_> = insts(&host)
        .into_iter()
        .filter(|(i, _)| matches!(i.kind, InstKind::CollectivePermute { .. }))
        .collect();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].1, 1, "the collective permute is inside the loop");
    assert_eq!(stream_loops(&host), 1);
    assert!(comms(&host, CommKind::AllGather).is_empty());
    let text = host.to_string();
    assert!(text.contains("send=(my(m0, DIDx) - i0) % 4"), "{text}");
    assert!(text.contains("recv=(i0 + my(m0, DIDx)) % 4"), "{text}");
}

#[test]
fn broadcast_variant_roots_at_the_loop_index() {
    let host = lower("column_parallel_linear_broadcast", 4);
    let b = comms(&host, CommKind::Broadcast);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].1, 1);
    let InstKind::Communication {
        root: Some(root), ..
    } = &b[0].0.kind
    else {
        panic!("a rooted broadcast");
    };
    let loop_var = host
        .body
        .iter()
        .find_map(|i| match &i.kind {
            InstKind::ForLoop { index, .. } => Some(*index),
            _ => None,
        })
        .expect("a loop");
    assert_eq!(*root, meshflow::ir::Expr::var(loop_var));
}

#[test]
fn collective_variant_is_one_all_gather() {
    let host = lower("column_parallel_linear_collective", 4);
    assert_eq!(comms(&host, CommKind::AllGather).len(), 1);
    assert_eq!(stream_loops(&host), 0);
}

#[test]
fn row_parallel_all_reduces_each_chunk_in_the_loop() {
    let host = lower("row_parallel_linear_chunked", 4);
    let ar = comms(&host, CommKind::AllReduce);
    assert_eq!(ar.len(), 1);
    assert_eq!(ar[0].1, 1, "per-chunk all_reduce inside the stream loop");
    assert_eq!(stream_loops(&host), 1);
}

#[test]
fn row_parallel_ring_passes_running_sums_to_the_next_rank() {
    // The search accumulates in place here: each step's GEMM adds onto the running sum that
    // arrived (`linear_accumulate`), no separate add.
    let host = lower("row_parallel_linear_ring", 4);
    assert!(comms(&host, CommKind::ReduceScatter).is_empty());
    let cps: Vec<_> = insts(&host)
        .into_iter()
        .filter(|(i, _)| matches!(i.kind, InstKind::CollectivePermute { .. }))
        .collect();
    // Step 0 peeled, the middle steps but the last in a loop, step d-2 peeled (it sends into
    // z): d - 1 transfers of a running sum.
    assert_eq!(cps.len(), 3);
    assert_eq!((cps[0].1, cps[1].1, cps[2].1), (0, 1, 0));
    let text = host.to_string();
    assert_eq!(
        text.matches("send=(my(m0, DIDx) + 1) % 4, recv=(my(m0, DIDx) + 3) % 4")
            .count(),
        3,
        "{text}"
    );
    // Steps 1..d-1 accumulate onto what arrived; the last one into z, where the running sum
    // landed.
    assert!(!text.contains("add("), "{text}");
    assert_eq!(text.matches("linear_accumulate(").count(), 3, "{text}");
    assert!(text.contains("w -> z)"), "{text}");
    assert!(text.contains("-> z, team="), "{text}");
    // The partial sums are never materialized whole.
    assert!(!text.contains("tensor y:"), "{text}");
}

#[test]
fn mlp_2d_mesh_uses_slice_teams() {
    let host = lower("mlp_2d_mesh", 4);
    let ar = comms(&host, CommKind::AllReduce);
    assert_eq!(ar.len(), 1);
    assert!(matches!(
        ar[0].0.kind.team(),
        Some(Team::Slice {
            pt: meshflow::ir::ParallelType::DIDx,
            ..
        })
    ));
}

#[test]
fn pipeline_sends_between_the_meshes() {
    let host = lower("pipeline_two_meshes", 4);
    let sr = comms(&host, CommKind::SendRecv);
    assert_eq!(sr.len(), 2, "one transfer per device pair");
    let teams: Vec<_> = sr.iter().map(|(i, _)| i.kind.team().cloned()).collect();
    assert_eq!(
        teams,
        vec![
            Some(Team::Devices(vec![0, 2])),
            Some(Team::Devices(vec![1, 3]))
        ]
    );
}

#[test]
fn moe_layer_dispatches_and_combines() {
    let host = lower("moe_layer", 4);
    let all = insts(&host);
    assert_eq!(
        all.iter()
            .filter(|(i, _)| matches!(i.kind, InstKind::MoeDispatch { .. }))
            .count(),
        1
    );
    assert_eq!(
        all.iter()
            .filter(|(i, _)| matches!(i.kind, InstKind::MoeCombine { .. }))
            .count(),
        1
    );
}

#[test]
fn fsdp_weights_unshard_by_their_shard_order() {
    // `w1` (FSDP2 on top of TP: rows over DIDx, then DIDy) unshards with one all-gather over
    // DIDy; `w2` (DTensor's default order: DIDy outer) gathers over DIDx and DIDy.
    let host = lower("fsdp_tp_weight", 4);
    let teams: Vec<String> = comms(&host, CommKind::AllGather)
        .iter()
        .map(|(i, _)| match &i.kind {
            InstKind::Communication { output, team, .. } => format!(
                "{} {}",
                host.tensors[*output].name,
                match team {
                    Team::Slice { pt, .. } => pt.name(),
                    _ => "?",
                }
            ),
            _ => String::new(),
        })
        .collect();
    assert_eq!(
        teams,
        vec![
            "w1_tp_gathered DIDy",
            "w2_tp_step_gathered DIDx",
            "w2_tp_step_1_gathered DIDy"
        ],
        "{host}"
    );
    assert_eq!(
        insts(&host)
            .iter()
            .filter(|(i, _)| i.kind.is_communication())
            .count(),
        3
    );
}

#[test]
fn every_example_lowers_and_verifies_at_every_rank_count() {
    let mut lowered = 0;
    for name in common::EXAMPLES {
        assert!(parse(name, None).is_ok(), "{name} parses with its defaults");
        for ranks in [1, 2, 3, 4, 8] {
            let Ok(program) = parse(name, Some(ranks)) else {
                continue;
            };
            let compiled = compile(&program, &Options::new().check(false))
                .unwrap_or_else(|e| panic!("{name} at {ranks} ranks: {e}"));
            verify_host(compiled.host())
                .unwrap_or_else(|e| panic!("{name} at {ranks} ranks does not verify: {e}"));
            lowered += 1;
        }
    }
    // 7 single-mesh examples at 5 rank counts; 4 examples need 2 ranks (4 counts).
    assert_eq!(lowered, 7 * 5 + 4 * 4);
}

#[test]
fn transformer_block_2d_is_two_all_gathers_and_two_reduce_scatters_over_didx() {
    for ranks in [2, 4, 8] {
        let host = lower("transformer_block_2d", ranks);
        let mut counts = std::collections::BTreeMap::new();
        for (inst, _) in insts(&host) {
            if inst.kind.is_communication() {
                assert!(
                    matches!(
                        inst.kind.team(),
                        Some(Team::Slice {
                            pt: meshflow::ir::ParallelType::DIDx,
                            ..
                        })
                    ),
                    "{}",
                    host
                );
                *counts.entry(inst.kind.name()).or_insert(0) += 1;
            }
        }
        let want: std::collections::BTreeMap<&str, usize> =
            [("all_gather", 2), ("reduce_scatter", 2)]
                .into_iter()
                .collect();
        assert_eq!(counts, want, "at {ranks} ranks:\n{host}");
    }
}
