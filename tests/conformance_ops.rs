//! Conformance cases of `tests/data/conformance/<dtensor|nvfuser>/*.mf`: sharding programs
//! transcribed from PyTorch DTensor's and nvFuser's multi-device tests. Each file starts with
//! header comments:
//!
//! ```text
//! # source: pytorch test/distributed/tensor/test_view_ops.py::TestViewOps::test_view_ops
//! # expect: all_gather=1            (or `none`, or `refused "substring of the error"`)
//! # ranks: 6 4                      (the peer's rank count first, then others)
//! ```
//!
//! and is a level-1 program with `param ranks`. At every listed rank count the case is
//! lowered; a refused case must fail with an error containing the substring, any other case
//! must lower to exactly the expected static counts of communication instructions (by their
//! host-text name; `none` means no communication), pass the cross-rank check and match the
//! unsharded reference on the sim backend.

#[path = "data/conformance/cases.rs"]
mod cases;

use std::collections::BTreeMap;

use cases::{cases, Case, Expect};
use meshflow::check::check_program;
use meshflow::ir::{parse_program_with, HostProgram, Params};
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::launch::SimOptions;

/// Static counts of communication instructions by host-text name.
fn comm_counts(host: &HostProgram) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    host.walk(&mut |inst, _| {
        if inst.kind.is_communication() {
            *counts.entry(inst.kind.name().to_string()).or_insert(0) += 1;
        }
    });
    counts
}

fn run_case(case: &Case, ranks: i64) -> Result<(), String> {
    let mut params = Params::new();
    params.insert("ranks".into(), ranks);
    let parsed = parse_program_with(&case.text, &params).map_err(|e| e.to_string());
    let compiled = parsed.and_then(|p| {
        compile(&p, &CompileOptions::default())
            .map_err(|e| e.to_string())
            .map(|c| (p, c))
    });
    match (&case.expect, compiled) {
        (Expect::Refused(needle), Err(e)) => {
            if e.contains(needle.as_str()) {
                Ok(())
            } else {
                Err(format!("refused, but without {needle:?}: {e}"))
            }
        }
        (Expect::Refused(needle), Ok(_)) => Err(format!(
            "expected a refusal containing {needle:?}, but it lowered"
        )),
        (Expect::Counts(_), Err(e)) => Err(format!("lowering failed: {e}")),
        (Expect::Counts(want), Ok((_, compiled))) => {
            let got = comm_counts(&compiled.host);
            if &got != want {
                return Err(format!(
                    "communications {got:?}, expected {want:?}\n{}",
                    compiled.host
                ));
            }
            let world = compiled.host.world_size();
            check_program(&compiled.host, world)
                .map_err(|e| format!("cross-rank check failed: {e}\n{}", compiled.host))?;
            let cmp = run_and_compare(
                &compiled.program,
                &compiled.host,
                world,
                11,
                &SimOptions::default(),
            )
            .map_err(|e| format!("run failed: {e}"))?;
            if cmp.passed() {
                Ok(())
            } else {
                Err(format!("mismatch: {cmp}"))
            }
        }
    }
}

#[test]
fn every_conformance_case_behaves_as_its_source_expects() {
    let cases = cases();
    assert!(cases.len() >= 20, "found only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        for &r in &case.ranks {
            if let Err(e) = run_case(case, r) {
                failures.push(format!(
                    "{} at {r} ranks (source: {}): {e}",
                    case.path.display(),
                    case.source
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
