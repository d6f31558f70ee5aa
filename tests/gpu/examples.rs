//! Every `examples/programs/*.mf`, lowered with the pipeline, on 1, 2 and 4 GPUs (those the
//! machine has and the program supports), compared with the level-1 reference on the CPU
//! (f32 rel err < 1e-5, bf16 < 1e-2).
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshflow::ir::{parse_program_with, verify_program};
use meshflow::runtime::cuda::run_and_compare_cuda;
use meshflow::{compile, Options};
use support::*;

/// The rank counts each example supports (2-D and two-mesh programs need at least 2).
fn supports(stem: &str, ranks: usize) -> bool {
    !matches!(
        stem,
        "mlp_2d_mesh" | "pipeline_two_meshes" | "transformer_block_2d" | "fsdp_tp_weight"
    ) || ranks >= 2
}

#[test]
fn every_example_matches_the_reference_on_gpus() {
    let counts = rank_counts("every_example_matches_the_reference_on_gpus");
    if counts.is_empty() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/programs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/programs exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "mf"))
        .collect();
    files.sort();
    assert!(files.len() >= 11, "{files:?}");
    let mut runs = 0;
    for path in &files {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_string();
        let text = std::fs::read_to_string(path).unwrap();
        for &d in &counts {
            if !supports(&stem, d) {
                eprintln!("skipped: {stem} on {d} GPU(s) (the program needs at least 2 ranks)");
                continue;
            }
            let params = BTreeMap::from([("ranks".to_string(), d as i64)]);
            let program =
                parse_program_with(&text, &params).unwrap_or_else(|e| panic!("{stem}: {e}"));
            verify_program(&program).unwrap_or_else(|e| panic!("{stem}: {e}"));
            let compiled = compile(&program, &Options::new().check(false))
                .unwrap_or_else(|e| panic!("{stem} ranks={d}: {e}"));
            let world = compiled.host().world_size();
            let cmp = run_and_compare_cuda(
                compiled.level1().expect("lowered"),
                compiled.host(),
                world,
                7,
                &cuda_options(),
            )
            .unwrap_or_else(|e| panic!("{stem} on {world} GPUs: {e}\n{}", compiled.host()));
            eprintln!("{stem} d={world}: {cmp}");
            assert!(cmp.passed(), "{stem} on {world} GPUs: {cmp}");
            runs += 1;
        }
    }
    eprintln!("{runs} example runs on GPUs");
}
