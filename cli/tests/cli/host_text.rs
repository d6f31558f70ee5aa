//! Host IR text (what `lower` prints) is taken by every subcommand, recognised by its content
//! whatever the file is called; parameters, which host IR does not have, are refused.

use crate::{fails, scratch, succeeds, RING};

/// The ring example lowered to host IR, in a file whose name says nothing about its format.
fn ring_host_text(test: &str) -> String {
    let host = succeeds(&["lower", RING]);
    let path = scratch(test).join("ring.txt");
    std::fs::write(&path, &host).expect("written");
    path.display().to_string()
}

#[test]
fn parse_lower_check_run_and_trace_take_host_ir_by_content() {
    let file = ring_host_text("host-by-content");
    let host = succeeds(&["lower", RING]);
    assert_eq!(
        succeeds(&["parse", &file]),
        host,
        "parse prints it canonically"
    );
    assert_eq!(
        succeeds(&["lower", &file]),
        host,
        "lower prints it as it is"
    );
    let out = succeeds(&["check", &file]);
    assert!(
        out.starts_with("ok column_parallel_linear_ring: 4 ranks"),
        "{out}"
    );
    let out = succeeds(&["run", &file]);
    assert!(out.contains("cross-rank check: 4 ranks"), "{out}");
    assert!(out.contains("ran on 4 CPU ranks"), "{out}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("ok column_parallel_linear_ring:"), "{out}");
    assert!(last.contains("no reference"), "{out}");
    let json = std::path::Path::new(&file).with_extension("json");
    let out = succeeds(&["trace", &file, "-o", json.to_str().unwrap()]);
    assert!(out.contains("trace written to"), "{out}");
}

#[test]
fn a_host_program_with_moe_runs_with_valid_routing() {
    let host = succeeds(&["lower", "examples/programs/moe_layer.mf"]);
    let path = scratch("host-moe").join("moe");
    std::fs::write(&path, host).expect("written");
    let out = succeeds(&["run", path.to_str().unwrap()]);
    assert!(out.contains("ran on 4 CPU ranks"), "{out}");
}

#[test]
fn parameters_and_lowering_options_on_host_ir_are_refused() {
    let file = ring_host_text("host-params");
    for cmd in ["check", "run", "parse", "lower", "trace"] {
        let err = fails(&[cmd, &file, "--param", "d=3"]);
        assert!(
            err.contains("host IR text has no parameters") && err.contains("`d=3`"),
            "{cmd}: {err}"
        );
    }
    let err = fails(&["run", &file, "--decompose", "ag=ring"]);
    assert!(
        err.contains("--decompose applies to level-1 programs only"),
        "{err}"
    );
    let err = fails(&["lower", &file, "--explain", "--schedule", "prefetch"]);
    assert!(err.contains("--schedule"), "{err}");
    // The job size is still taken (it is not a parameter of the text).
    let out = succeeds(&["check", &file, "--ranks", "5"]);
    assert!(out.contains(": 5 ranks"), "{out}");
}

#[test]
fn level_1_text_is_recognised_whatever_its_name() {
    let text = std::fs::read_to_string(crate::support::root().join(RING)).expect("the example");
    let path = scratch("level1-named-mfh").join("ring.mfh");
    std::fs::write(&path, text).expect("written");
    let out = succeeds(&[
        "check",
        path.to_str().unwrap(),
        "--param",
        "d=2",
        "--ranks",
        "2",
    ]);
    assert!(out.contains(": 2 ranks"), "{out}");
}
