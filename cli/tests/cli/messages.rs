//! Messages as users meet them: a program with no meshes, and the cross-rank check's summary
//! on a large world.

use crate::{fails, scratch, succeeds};

#[test]
fn a_program_without_meshes_says_so() {
    let path = scratch("no-meshes").join("empty.mf");
    std::fs::write(&path, "program empty {\n}\n").expect("written");
    for cmd in ["run", "trace"] {
        let err = fails(&[cmd, path.to_str().unwrap()]);
        assert!(err.contains("`empty` has no meshes"), "{cmd}: {err}");
        assert!(!err.contains("0 requested"), "{cmd}: {err}");
    }
}

#[test]
fn the_check_summary_of_128_ranks_fits_on_a_line() {
    let out = succeeds(&[
        "check",
        "examples/programs/column_parallel_linear_collective.mf",
        "--ranks",
        "128",
    ]);
    let line = out.lines().next().unwrap_or_default();
    assert!(
        line.contains("128 ranks, 128 communications (1 per rank)"),
        "{line}"
    );
    assert!(line.len() < 200, "{} characters: {line}", line.len());
}
