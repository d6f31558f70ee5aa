//! Output files: traces name their processes and threads (rank, stream), output paths are
//! checked before anything runs, and multi-process runs refuse `--trace` instead of dropping
//! it.

use crate::{fails, meshflow, out_err, scratch, RING};

#[test]
fn traces_name_every_rank_and_stream() {
    let dir = scratch("trace-names");
    let run_json = dir.join("run.json");
    let o = meshflow(&["run", RING, "--trace", run_json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", out_err(&o).1);
    let trace_json = dir.join("trace.json");
    let o = meshflow(&["trace", RING, "-o", trace_json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", out_err(&o).1);
    for path in [run_json, trace_json] {
        let json = std::fs::read_to_string(&path).expect("written");
        for rank in 0..4 {
            let process = format!(
                r#"{{"ph":"M","name":"process_name","pid":{rank},"args":{{"name":"rank {rank}"}}}}"#
            );
            assert!(json.contains(&process), "{}: {process}", path.display());
            let main = format!(
                r#"{{"ph":"M","name":"thread_name","pid":{rank},"tid":0,"args":{{"name":"main"}}}}"#
            );
            assert!(json.contains(&main), "{}: {main}", path.display());
        }
        let worker = r#""tid":1,"args":{"name":"worker 0"}"#;
        assert!(json.contains(worker), "{}: {worker}", path.display());
    }
}

#[test]
fn an_unwritable_trace_fails_before_anything_runs() {
    // The program does not even exist: the output path is what is checked first.
    let err = fails(&[
        "run",
        "examples/programs/missing.mf",
        "--trace",
        "/nonexistent-dir/t.json",
    ]);
    assert!(
        err.contains("cannot write the trace `/nonexistent-dir/t.json`"),
        "{err}"
    );
    // `trace`: the timeline's path is checked before the trace is run or written.
    let dir = scratch("unwritable-svg");
    let json = dir.join("t.json");
    let err = fails(&[
        "trace",
        RING,
        "-o",
        json.to_str().unwrap(),
        "--svg",
        "/nonexistent-dir/t.svg",
    ]);
    assert!(err.contains("cannot write the timeline"), "{err}");
    assert!(!json.exists(), "nothing was written");
}

#[test]
fn a_run_that_fails_leaves_no_trace_file_behind() {
    let dir = scratch("failed-run-trace");
    let json = dir.join("t.json");
    fails(&[
        "run",
        "examples/programs/moe_layer.mf",
        "--ranks",
        "2",
        "--param",
        "d=8",
        "--trace",
        json.to_str().unwrap(),
    ]);
    assert!(!json.exists());
}

#[test]
fn multi_process_runs_refuse_trace() {
    let dir = scratch("nodes-trace");
    let json = dir.join("t.json");
    let err = fails(&[
        "run",
        RING,
        "--nodes",
        "2",
        "--trace",
        json.to_str().unwrap(),
    ]);
    assert!(
        err.contains("--trace is recorded in single-process runs only"),
        "{err}"
    );
    assert!(!json.exists());
}
