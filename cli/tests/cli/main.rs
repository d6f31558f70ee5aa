//! The `meshflow` binary as a user runs it: `parse`, `lower`, `check`, `run`, `trace`, and
//! multi-process CPU runs (`--nodes`), with their output and their errors (`error: ...`, exit
//! code 1, never a panic).

#[path = "../../../tests/support/mod.rs"]
mod support;

mod calibrate;
mod flags;
mod host_text;
mod launch;
mod lower;
mod messages;
mod nodes;
mod outputs;
mod run;
mod trace;

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the binary from the repository root.
pub fn meshflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshflow"))
        .args(args)
        .current_dir(support::root())
        .env_remove("RUST_LOG")
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("MESHFLOW_NODE_SIZE")
        .env_remove("MESHFLOW_GPU_MODEL")
        .output()
        .expect("the binary runs")
}

/// Standard output and error as text.
pub fn out_err(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs and expects exit code 1 with one `error: ...` (never a panic); returns stderr.
pub fn fails(args: &[&str]) -> String {
    let o = meshflow(args);
    let (out, err) = out_err(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {out}{err}");
    assert!(err.starts_with("error:"), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

/// Runs and expects success; returns stdout.
pub fn succeeds(args: &[&str]) -> String {
    let o = meshflow(args);
    let (out, err) = out_err(&o);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {out}{err}");
    out
}

/// A fresh scratch folder for one test.
pub fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshflow-cli-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// The ring example.
pub const RING: &str = "examples/programs/column_parallel_linear_ring.mf";
