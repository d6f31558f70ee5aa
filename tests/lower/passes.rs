//! File-driven pass tests (see `support::passes`): every `tests/data/passes/*.mf` compiles to
//! exactly the host program of the `.mfh` beside it, which parses back to the same program.
//! `MESHFLOW_BLESS=1 cargo test --test lower passes` rewrites the expectations.

use meshflow::ir::parse_host;
use meshflow::{compile, parse};

use crate::support::passes::{cases, expect_file, options};
use crate::support::root;

#[test]
fn every_program_lowers_to_its_expected_host_program() {
    let all = cases(&root().join("tests/data/passes"));
    assert!(all.len() >= 6, "only {} cases", all.len());
    let mut failures = Vec::new();
    for case in &all {
        let result = options(case).and_then(|o| {
            let program = parse(&case.text, &o).map_err(|e| e.to_string())?;
            let compiled = compile(&program, &o).map_err(|e| e.to_string())?;
            let text = compiled.host_text();
            let back = parse_host(&text).map_err(|e| format!("does not parse back: {e}"))?;
            if &back != compiled.host() {
                return Err("the printed host program parses to another program".into());
            }
            expect_file(&case.expected, &text)
        });
        if let Err(e) = result {
            failures.push(format!("{}: {e}", case.name));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_expectation_has_an_input() {
    let dir = root().join("tests/data/passes");
    let inputs: Vec<_> = cases(&dir).into_iter().map(|c| c.expected).collect();
    for entry in std::fs::read_dir(&dir).expect("the folder exists") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "mfh") {
            assert!(
                inputs.contains(&path),
                "{} has no `.mf` input",
                path.display()
            );
        }
    }
}
