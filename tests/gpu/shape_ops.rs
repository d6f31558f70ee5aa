//! The shape ops, `max`/`min`/`avg`, `softmax`, `rms_norm`, broadcasting `matmul` and partial
//! inputs on GPUs: every conformance case that lowers, at 1, 2 and 4 ranks where the program
//! supports that count and the machine has the GPUs, and a bf16 program with every new op;
//! each compared with the level-1 reference (f32 rel err < 1e-5, bf16 < 1e-2).
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use meshflow::ir::{parse_program, parse_program_with, Params};
use meshflow::runtime::cuda::run_and_compare_cuda;
use meshflow::{compile, Options};
use support::*;

#[test]
fn conformance_cases_match_the_reference_on_gpus() {
    let counts = rank_counts("conformance_cases_match_the_reference_on_gpus");
    if counts.is_empty() {
        return;
    }
    let have = counts.iter().copied().max().unwrap_or(0);
    let mut runs = 0;
    for case in crate::support::conformance::cases() {
        if matches!(case.expect, crate::support::conformance::Expect::Refused(_)) {
            continue;
        }
        let name = case.path.display().to_string();
        for r in [1i64, 2, 4] {
            let mut params = Params::new();
            params.insert("ranks".into(), r);
            let Ok(program) = parse_program_with(&case.text, &params) else {
                eprintln!("skipped: {name} at {r} ranks (the program does not take that count)");
                continue;
            };
            let Ok(compiled) = compile(&program, &case.options()) else {
                eprintln!("skipped: {name} at {r} ranks (it does not lower at that count)");
                continue;
            };
            let world = compiled.host().world_size();
            if world > have {
                eprintln!("skipped: {name} at {r} ranks needs {world} GPUs, have {have}");
                continue;
            }
            let cmp = run_and_compare_cuda(
                compiled.level1().expect("lowered"),
                compiled.host(),
                world,
                7,
                &cuda_options(),
            )
            .unwrap_or_else(|e| panic!("{name} on {world} GPUs: {e}\n{}", compiled.host()));
            eprintln!("{name} d={world}: {cmp}");
            assert!(cmp.passed(), "{name} on {world} GPUs: {cmp}");
            runs += 1;
        }
    }
    assert!(runs > 10, "only {runs} runs");
    eprintln!("{runs} conformance runs on GPUs");
}

/// Every new op in bf16 on a 2-GPU mesh: rms_norm and softmax on split rows, reductions into
/// partial results, slices, cat, select, expand and a broadcasting batched matmul.
const BF16_OPS: &str = "program bf16_ops {
  mesh m = [0, 1]
  input x: bf16[4, 6, 16] on m {outer_split(0, 2), parallelize(0, DIDx)}
  input w: bf16[16] on m {}
  input b: bf16[1, 16, 8] on m {}
  tensor n: bf16[4, 6, 16] on m
  tensor s: bf16[4, 6, 16] on m
  tensor mx: bf16[4, r6, 16] on m
  tensor av: bf16[r4, 6, 16] on m {}
  tensor sl: bf16[4, 6, 8] on m
  tensor ct: bf16[4, 6, 24] on m
  tensor se: bf16[4, 24] on m
  tensor ex: bf16[2, 4, 24] on m
  tensor mm: bf16[4, 6, 8, r16] on m
  n = rms_norm(x, w, axis=2, eps=1e-5)
  s = softmax(n, axis=1)
  mx = max(s, axis=1)
  av = avg(s, axis=0)
  sl = slice(s, axis=2, start=4, end=12)
  ct = cat(s, sl, axis=2)
  se = select(ct, axis=1, index=3)
  ex = expand(se)
  mm = matmul(x, b)
  output mx, av, ex, mm
}
";

#[test]
fn new_ops_in_bf16_match_the_reference_on_two_gpus() {
    if skip_unless(2, "new_ops_in_bf16_match_the_reference_on_two_gpus") {
        return;
    }
    let program = parse_program(BF16_OPS).expect("parses");
    let compiled = compile(&program, &Options::new().check(false)).expect("lowers");
    let cmp = run_and_compare_cuda(
        compiled.level1().expect("lowered"),
        compiled.host(),
        2,
        3,
        &cuda_options(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", compiled.host()));
    eprintln!("bf16 ops: {cmp}");
    assert!(cmp.passed(), "{cmp}\n{}", compiled.host());
}
