//! The whole pipeline on fuzzed level-1 text: parse -> verify -> lower
//! (`meshflow::compile`, verifying after every pass) -> cross-rank check
//! (`meshflow::check::check_program`) -> for small programs (at most 8 ranks, small tensors) a
//! CPU run against the level-1 reference with a short receive timeout.
//!
//! Every stage may reject its input with an error; none may panic, overflow its stack, hang or
//! allocate absurdly. A program the cross-rank check accepts must not deadlock, so the run uses
//! a short timeout and a small memory limit per rank.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use meshflow::check::check_program;
use meshflow::ir::{parse_program, verify_program, Program};
use meshflow::{compile, Options};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::{CpuConfig, CpuOptions};

/// Largest world size that is checked across ranks: the check is linear in the world size
/// (`tests/check/programs.rs` checks a million ranks), but a fuzzer iteration must stay short.
const MAX_CHECK_RANKS: usize = 1 << 16;
/// Largest world size that is run on the CPU backend.
const MAX_RUN_RANKS: usize = 8;
/// Largest total element count of the level-1 tensors of a program that is run.
const MAX_RUN_ELEMENTS: u64 = 1 << 16;

/// Total elements of every level-1 tensor (None on overflow).
fn total_elements(program: &Program) -> Option<u64> {
    program.tensors.iter().try_fold(0u64, |acc, (_, t)| {
        let n =
            t.ty.axes
                .iter()
                .try_fold(1u64, |n, a| n.checked_mul(a.extent))?;
        acc.checked_add(n)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(program) = parse_program(text) else {
        return;
    };
    if verify_program(&program).is_err() {
        return;
    }
    let options = Options::new().check(false).verify_each_pass(true);
    let Ok(compiled) = compile(&program, &options) else {
        return;
    };
    let world = compiled.host().world_size();
    if world > MAX_CHECK_RANKS {
        return;
    }
    if check_program(compiled.host(), world).is_err() {
        return;
    }
    if world == 0 || world > MAX_RUN_RANKS {
        return;
    }
    if total_elements(&program).is_none_or(|n| n > MAX_RUN_ELEMENTS) {
        return;
    }
    let cpu = CpuOptions {
        ranks: None,
        config: CpuConfig {
            timeout: Duration::from_millis(200),
            memory_limit: Some(64 << 20),
            ..CpuConfig::default()
        },
        trace: false,
    };
    let _ = run_and_compare(&program, compiled.host(), world, 7, &cpu);
});
