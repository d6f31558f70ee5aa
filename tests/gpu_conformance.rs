//! The conformance cases (`tests/data/conformance/*/*.mf`) on GPUs: every case that lowers
//! at a rank count the machine has (1, 2 or 4 GPUs) and fits in it is run on the CUDA
//! backend and compared with the level-1 reference (f32 rel err < 1e-5, bf16 < 1e-2). This
//! covers on GPUs what the CPU harness covers: collectives over buffers with leading axes of
//! extent 1, uneven shards (padded buffers, `narrow` views, repacking copies), chains of splits,
//! coalesced transfers between overlapping meshes and local copies over one-device teams.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

#[path = "data/gpu/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshflow::ir::parse_program_with;
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::cuda::run_and_compare_cuda;
use support::*;

#[test]
fn conformance_cases_match_the_reference_on_gpus() {
    let counts = rank_counts("conformance_cases_match_the_reference_on_gpus");
    if counts.is_empty() {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/conformance");
    let mut files: Vec<PathBuf> = ["dtensor", "nvfuser"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root.join(d)).expect("the conformance folders exist"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "mf"))
        .collect();
    files.sort();
    let (mut runs, mut skipped) = (0, 0);
    let mut failures = Vec::new();
    for path in &files {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
        let text = std::fs::read_to_string(path).expect("readable case");
        for &d in &counts {
            let params = BTreeMap::from([("ranks".to_string(), d as i64)]);
            let Ok(program) = parse_program_with(&text, &params) else {
                skipped += 1;
                continue;
            };
            let Ok(compiled) = compile(&program, &CompileOptions::default()) else {
                skipped += 1;
                continue;
            };
            let world = compiled.host.world_size();
            if world > d {
                skipped += 1;
                continue;
            }
            match run_and_compare_cuda(&compiled.program, &compiled.host, d, 7, &cuda_options()) {
                Ok(cmp) if cmp.passed() => runs += 1,
                Ok(cmp) => failures.push(format!("{name} on {d} GPUs: {cmp}\n{}", compiled.host)),
                Err(e) => failures.push(format!("{name} on {d} GPUs: {e}\n{}", compiled.host)),
            }
        }
    }
    eprintln!(
        "{runs} conformance runs on GPUs, {skipped} skipped (refused, or more devices than \
         the GPU count)"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
