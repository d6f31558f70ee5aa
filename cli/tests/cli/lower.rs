//! The `meshflow parse` and `meshflow lower` subcommands: output, options, and errors printed
//! as `error: ...` with exit code 1 (never a panic).

use std::process::{Command, Output};

use meshflow::ir::parse_program;
use meshflow::{compile, Options};

fn meshflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshflow"))
        .args(args)
        .current_dir(crate::support::root())
        .env_remove("RUST_LOG")
        .output()
        .expect("the binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and expects failure with exit code 1 and an `error:` line; returns stderr.
fn fails(args: &[&str]) -> String {
    let o = meshflow(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.starts_with("error:"), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(stdout(&o).is_empty());
    err
}

const RING: &str = "examples/programs/column_parallel_linear_ring.mf";

#[test]
fn lower_prints_the_host_program() {
    let o = meshflow(&["lower", RING]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(crate::support::root().join(RING)).unwrap();
    let program = parse_program(&text).unwrap();
    let want = compile(&program, &Options::new().check(false))
        .unwrap()
        .host()
        .clone();
    assert_eq!(stdout(&o), want.to_string());
    assert!(stderr(&o).is_empty(), "nothing logged at the default level");
}

#[test]
fn ranks_and_params_override_the_defaults() {
    let o = meshflow(&["lower", RING, "--ranks", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("mesh m0 = [0, 1]\n"));
    let o = meshflow(&["parse", RING, "--param", "d=3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("mesh m0 = [0, 1, 2]\n"));
}

#[test]
fn parse_prints_the_canonical_program() {
    let o = meshflow(&["parse", RING]);
    assert!(o.status.success(), "{}", stderr(&o));
    let printed = stdout(&o);
    let reparsed = parse_program(&printed).unwrap();
    assert_eq!(reparsed.to_string(), printed);
}

#[test]
fn dump_after_explain_and_timings_go_to_stderr() {
    let o = meshflow(&[
        "lower",
        RING,
        "--dump-after",
        "all",
        "--explain",
        "--timings",
    ]);
    assert!(o.status.success());
    let err = stderr(&o);
    for pass in meshflow::pipeline::pass_names() {
        assert!(
            err.contains(&format!("// ===== after {pass} =====")),
            "{pass}"
        );
    }
    assert!(
        err.contains("ag = set(x) [collective_permute ring over DIDx]"),
        "{err}"
    );
    assert!(err.contains("// ===== pass timings ====="));
    let o = meshflow(&["lower", RING, "--dump-after", "lower_to_host"]);
    assert_eq!(stderr(&o).matches("// ===== after").count(), 1);
}

#[test]
fn disabling_and_stream_pool_options() {
    let o = meshflow(&[
        "lower",
        RING,
        "--disable-pass",
        "assign_streams",
        "--streams",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("get_current_stream"));
    let o = meshflow(&["lower", RING, "--streams", "3"]);
    assert!(stdout(&o).contains("worker(i0 % 3)"));
}

#[test]
fn forced_decompositions() {
    let path = "examples/programs/column_parallel_linear_collective.mf";
    // `ag` is annotated, so forcing is refused.
    let err = fails(&["lower", path, "--decompose", "ag=ring"]);
    assert!(err.contains("annotated by the user"), "{err}");
    let err = fails(&["lower", path, "--decompose", "ag=spiral"]);
    assert!(err.contains("unknown decomposition `spiral`"), "{err}");
}

#[test]
fn profiles_transports_and_schedules() {
    let rs = "examples/programs/row_parallel_linear_ring.mf";
    // `--explain` lists every candidate with its predicted time, per transport, and the
    // transport chosen for the program.
    let o = meshflow(&["lower", rs, "--explain", "--profile", "h100x2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("ring_forward(s=4, prefetch, nccl)"), "{err}");
    assert!(
        err.contains("ring_forward(s=8, prefetch, copy_engine)"),
        "{err}"
    );
    assert!(err.contains("the program [transport]: chose "), "{err}");
    // `--explain` names the profile and why.
    assert!(
        err.contains("profile: h100x2: given (--profile h100x2)\n"),
        "{err}"
    );
    // A profile file (the committed one, read from disk) gives the built-in's decisions.
    let by_file = meshflow(&[
        "lower",
        rs,
        "--explain",
        "--profile",
        "profiles/h100x2.json",
    ]);
    let file_err = stderr(&by_file);
    assert!(
        file_err.contains("profile: h100x2: given (--profile profiles/h100x2.json)\n"),
        "{file_err}"
    );
    let decisions = |text: &str| -> String {
        text.lines()
            .filter(|l| !l.starts_with("profile: "))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    assert_eq!(decisions(&file_err), decisions(&err));
    // Without `--profile`, `lower` cannot know the target: the default, said so.
    let o = meshflow(&["lower", rs, "--explain"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("profile: h200x2: default, no GPU named (the target machine is unknown)\n"),
        "{}",
        stderr(&o)
    );
    // A forced transport leaves only its candidates.
    let o = meshflow(&["lower", rs, "--explain", "--transport", "copy-engine"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains(", nccl)"), "{}", stderr(&o));
    // A forced schedule.
    let o = meshflow(&["lower", RING, "--schedule", "prefetch"]);
    assert!(
        stdout(&o).contains("set_current_stream worker(0)"),
        "{}",
        stdout(&o)
    );
    // Bad profiles are errors naming the problem.
    let err = fails(&["lower", rs, "--profile", "a100x8"]);
    assert!(err.contains("neither a built-in profile"), "{err}");
    let err = fails(&["lower", rs, "--profile", "Cargo.toml"]);
    assert!(err.contains("profile JSON"), "{err}");
}

#[test]
fn errors_are_one_line_with_exit_code_1() {
    let err = fails(&["lower", "no/such/file.mf"]);
    assert!(err.contains("cannot read `no/such/file.mf`"), "{err}");
    let err = fails(&["lower", RING, "--disable-pass", "nope"]);
    assert!(
        err.contains("unknown pass `nope`; valid passes: verify_program, propagate_shardings"),
        "{err}"
    );
    let err = fails(&["lower", RING, "--disable-pass", "lower_to_host"]);
    assert!(err.contains("cannot be disabled"), "{err}");
    let err = fails(&["lower", RING, "--dump-after", "nope"]);
    assert!(err.contains("unknown pass `nope`"), "{err}");
    let err = fails(&["lower", RING, "--param", "ranks"]);
    assert!(err.contains("expected NAME=VALUE"), "{err}");
    let err = fails(&["lower", RING, "--param", "ranks=four"]);
    assert!(err.contains("not an integer"), "{err}");
    let err = fails(&["lower", RING, "--streams", "0"]);
    assert!(err.contains("at least 1"), "{err}");
    let err = fails(&[
        "lower",
        "examples/programs/pipeline_two_meshes.mf",
        "--ranks",
        "1",
    ]);
    assert!(err.contains("pipeline_two_meshes.mf:"), "{err}");
    fails(&["frobnicate"]);
}

#[test]
fn syntax_and_lowering_errors_name_the_place() {
    let dir = std::env::temp_dir().join(format!("meshflow-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.mf");
    std::fs::write(
        &bad,
        "program p {\n  mesh m0 = [0, 1]\n  input x: f32[4 on m0\n}\n",
    )
    .unwrap();
    let err = fails(&["parse", bad.to_str().unwrap()]);
    assert!(err.contains("bad.mf:3:"), "{err}");
    // A strided shard (a device split inside a serial piece) whose serial piece does not
    // divide the axis is refused: the error names the tensor and what is missing.
    let unsupported = dir.join("unsupported.mf");
    std::fs::write(
        &unsupported,
        "program p {\n  mesh m0 = [0, 1]\n  \
         input x: f32[7, 3] on m0 {outer_split(0, 3), outer_split(1, 2), parallelize(1, DIDx)}\n  \
         tensor y: f32[7, 3] on m0 {}\n  \
         y = set(x)\n  output y\n}\n",
    )
    .unwrap();
    let err = fails(&["lower", unsupported.to_str().unwrap()]);
    assert!(
        err.contains("`x`") && err.contains("serial") && err.contains("divides"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn help_exits_successfully() {
    let o = meshflow(&["--help"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("lower"));
}

#[test]
fn forced_pieces() {
    let rs = "examples/programs/row_parallel_linear_ring.mf";
    // 4 ranks: the ring's chunk count is 4 x the pieces per step; only those candidates stay.
    for (pieces, chunks) in [("y=1", "s=4"), ("y=2", "s=8"), ("y=4", "s=16")] {
        let o = meshflow(&["lower", rs, "--explain", "--pieces", pieces]);
        assert!(o.status.success(), "{}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains(&format!("chose ring_forward({chunks}")),
            "{err}"
        );
        // Per transport: the ring with an add and the ring accumulating in place.
        assert_eq!(err.matches("  ring_forward(").count(), 4, "{err}");
        assert_eq!(err.matches(", accumulate)  ").count(), 2, "{err}");
    }
    let err = fails(&["lower", rs, "--pieces", "y=3"]);
    assert!(err.contains("cannot be cut into 3 pieces"), "{err}");
    let err = fails(&["lower", rs, "--pieces", "y"]);
    assert!(err.contains("expected TENSOR=N"), "{err}");
    let err = fails(&["lower", rs, "--pieces", "y=two"]);
    assert!(err.contains("not a positive integer"), "{err}");
}

#[test]
fn forced_accumulate() {
    let rs = "examples/programs/row_parallel_linear_ring.mf";
    // On: only the rings accumulating in place stay (every pieces count, every transport).
    let o = meshflow(&["lower", rs, "--explain", "--accumulate", "y=on"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(", accumulate) (forced by the options"),
        "{err}"
    );
    assert_eq!(
        err.matches("  ring_forward(").count(),
        err.matches(", accumulate)  ").count(),
        "{err}"
    );
    // With the pieces forced too: one candidate per transport.
    let o = meshflow(&[
        "lower",
        rs,
        "--explain",
        "--accumulate",
        "y=on",
        "--pieces",
        "y=2",
    ]);
    let err = stderr(&o);
    assert!(err.contains("chose ring_forward(s=8, prefetch,"), "{err}");
    assert_eq!(err.matches(", accumulate)  ").count(), 2, "{err}");
    // Off: no ring accumulating in place is left.
    let o = meshflow(&["lower", rs, "--explain", "--accumulate", "y=off"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("chose ring_forward("), "{err}");
    assert!(!err.contains("accumulate)"), "{err}");
    let err = fails(&["lower", rs, "--accumulate", "y=maybe"]);
    assert!(err.contains("neither on nor off"), "{err}");
    let err = fails(&["lower", rs, "--accumulate", "y"]);
    assert!(err.contains("expected TENSOR=on|off"), "{err}");
    let err = fails(&["lower", rs, "--accumulate", "nope=on"]);
    assert!(err.contains("no resharding decided by `nope`"), "{err}");
    // An all-gather has no ring of running sums.
    let ag = "examples/programs/column_parallel_linear_collective.mf";
    let err = fails(&["lower", ag, "--accumulate", "ag=on"]);
    assert!(err.contains("cannot accumulate in place"), "{err}");
    let o = meshflow(&["lower", "--help"]);
    assert!(stdout(&o).contains("--accumulate <TENSOR=on|off>"));
}
