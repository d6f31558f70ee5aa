//! Every subcommand that compiles takes the same flags with the same meaning: `--streams 0` is
//! refused by all of them, and `--decompose`, `--schedule` and `--disable-pass` reach the
//! lowering of `run`, `trace` and `check` as they reach `lower`'s.

use crate::{fails, scratch, succeeds, RING};

const COLLECTIVE: &str = "examples/programs/column_parallel_linear_collective.mf";

#[test]
fn zero_streams_are_refused_everywhere() {
    for cmd in ["lower", "check", "run", "trace"] {
        let err = fails(&[cmd, RING, "--streams", "0"]);
        assert!(err.contains("at least 1"), "{cmd}: {err}");
    }
}

#[test]
fn lowering_flags_reach_every_subcommand() {
    let json = scratch("flags-trace").join("t.json");
    let json = json.to_str().unwrap();
    // `ag` of the collective example is annotated: forcing a decomposition on it is refused
    // by every subcommand, so each of them passed the flag to the pipeline.
    for args in [
        vec!["lower", COLLECTIVE],
        vec!["check", COLLECTIVE],
        vec!["run", COLLECTIVE],
        vec!["trace", COLLECTIVE, "-o", json],
    ] {
        let mut args = args.clone();
        args.extend(["--decompose", "ag=ring"]);
        let err = fails(&args);
        assert!(err.contains("annotated by the user"), "{args:?}: {err}");
    }
    let out = succeeds(&[
        "run",
        RING,
        "--schedule",
        "prefetch",
        "--disable-pass",
        "defer_waits",
    ]);
    assert!(
        out.lines().last().unwrap_or_default().starts_with("ok y"),
        "{out}"
    );
    let err = fails(&["check", RING, "--disable-pass", "lower_to_host"]);
    assert!(err.contains("cannot be disabled"), "{err}");
}
