//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use meshflow_ir::{
    parse_host, parse_program, verify_host, verify_program, Diagnostic, HostProgram, Program,
};

/// `examples/programs` of the workspace.
pub fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/programs")
}

/// `ir/tests/data/host`.
pub fn host_data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/host")
}

/// `(file stem, text)` of every file with extension `ext` in `dir`, sorted by name.
pub fn files(dir: &PathBuf, ext: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
            let stem = p
                .file_stem()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            (stem, text)
        })
        .collect();
    out.sort();
    out
}

/// Every example program.
pub fn examples() -> Vec<(String, String)> {
    let out = files(&examples_dir(), "mf");
    assert!(out.len() >= 10, "expected the ten example programs");
    out
}

/// Every hand-written host program.
pub fn host_examples() -> Vec<(String, String)> {
    let out = files(&host_data_dir(), "mfh");
    assert!(out.len() >= 4, "expected the hand-written host programs");
    out
}

/// `program t { <lines indented by 2> }`: line `k` of `lines` is text line `k + 2`, column 3.
pub fn program_text(lines: &[&str]) -> String {
    wrap("program t", lines)
}

/// `host t { <lines indented by 2> }`: line `k` of `lines` is text line `k + 2`, column 3.
pub fn host_text(lines: &[&str]) -> String {
    wrap("host t", lines)
}

fn wrap(header: &str, lines: &[&str]) -> String {
    let mut s = format!("{header} {{\n");
    for l in lines {
        s.push_str("  ");
        s.push_str(l);
        s.push('\n');
    }
    s.push_str("}\n");
    s
}

/// Parses (must succeed) and verifies (must fail); returns the diagnostics.
pub fn program_errors(text: &str) -> Vec<Diagnostic> {
    let p: Program = parse_program(text).unwrap_or_else(|e| panic!("parse error {e}\n{text}"));
    match verify_program(&p) {
        Ok(()) => panic!("expected verifier errors for\n{text}"),
        Err(e) => e.0,
    }
}

/// Parses (must succeed) and verifies (must fail); returns the diagnostics.
pub fn host_errors(text: &str) -> Vec<Diagnostic> {
    let p: HostProgram = parse_host(text).unwrap_or_else(|e| panic!("parse error {e}\n{text}"));
    match verify_host(&p) {
        Ok(()) => panic!("expected verifier errors for\n{text}"),
        Err(e) => e.0,
    }
}

/// Asserts one diagnostic contains `needle` and is located at `line:col`.
pub fn expect_diag(diags: &[Diagnostic], needle: &str, line: u32, col: u32) {
    let found: Vec<&Diagnostic> = diags
        .iter()
        .filter(|d| d.message.contains(needle))
        .collect();
    assert!(
        !found.is_empty(),
        "no diagnostic contains {needle:?}; got:\n{}",
        diags
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let span = found[0].location.loc().span().expect("a source location");
    assert_eq!(
        (span.line, span.col),
        (line, col),
        "diagnostic {} at the wrong place",
        found[0]
    );
}
