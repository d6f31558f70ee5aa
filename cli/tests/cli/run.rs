//! The `meshflow run` and `meshflow check` subcommands: the README's main command, traces,
//! the cross-rank check on good and broken programs, and clear errors.

use std::process::{Command, Output};

fn meshflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshflow"))
        .args(args)
        .current_dir(crate::support::root())
        .env_remove("RUST_LOG")
        .output()
        .expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_readme_command_runs_the_ring_on_four_ranks_and_matches() {
    let o = meshflow(&[
        "run",
        "examples/programs/column_parallel_linear_ring.mf",
        "--ranks",
        "4",
    ]);
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", text(&o.stderr));
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("ok y: rel err"), "last line: {last}");
    assert!(out.contains("cross-rank check: 4 ranks"), "{out}");
    assert!(out.contains("no mismatch, no deadlock"), "{out}");
}

#[test]
fn every_example_runs_with_the_cli_on_three_ranks() {
    for name in [
        "column_parallel_linear_collective",
        "column_parallel_linear_broadcast",
        "column_parallel_linear_ring",
        "row_parallel_linear_chunked",
        "mlp_2d_mesh",
        "moe_layer",
        "pipeline_two_meshes",
        "fsdp_tp_weight",
    ] {
        let path = format!("examples/programs/{name}.mf");
        let o = meshflow(&["run", &path, "--ranks", "3", "--seed", "11"]);
        let out = text(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{name}: {out}{}", text(&o.stderr));
        assert!(
            out.lines().last().unwrap_or_default().starts_with("ok"),
            "{name}: {out}"
        );
    }
}

#[test]
fn a_trace_has_one_track_per_rank_and_stream() {
    let dir = std::env::temp_dir().join(format!("meshflow-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("ring.json");
    let path_s = path.to_string_lossy().into_owned();
    let o = meshflow(&[
        "run",
        "examples/programs/column_parallel_linear_ring.mf",
        "--ranks",
        "2",
        "--trace",
        &path_s,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let json = std::fs::read_to_string(&path).expect("the trace was written");
    assert!(
        json.starts_with("{\"traceEvents\":["),
        "{}",
        &json[..50.min(json.len())]
    );
    for pid in 0..2 {
        assert!(
            json.contains(&format!("\"pid\":{pid},\"tid\":1")),
            "rank {pid} worker 0"
        );
    }
    assert!(json.contains("collective_permute"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_accepts_a_lowered_example_and_rejects_a_broken_host_program() {
    let o = meshflow(&["check", "examples/programs/mlp_2d_mesh.mf", "--ranks", "8"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(text(&o.stdout).starts_with("ok mlp_2d_mesh: 8 ranks"));

    let o = meshflow(&[
        "check",
        "tests/data/mutations/wrong_recv_peer.mfh",
        "--ranks",
        "4",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: the cross-rank check rejects the program"),
        "{err}"
    );
    assert!(
        err.contains("wrong_recv_peer") || err.contains("rank"),
        "{err}"
    );
}

#[test]
fn bad_invocations_are_clear_errors() {
    let cases: [(&[&str], &str); 4] = [
        (&["run", "examples/programs/missing.mf"], "cannot read"),
        (
            &[
                "run",
                "examples/programs/pipeline_two_meshes.mf",
                "--ranks",
                "1",
            ],
            "iota(0) has no devices",
        ),
        (
            &[
                "run",
                "examples/programs/moe_layer.mf",
                "--param",
                "d=8",
                "--ranks",
                "2",
            ],
            "use 8 devices but only 2 ranks",
        ),
        (
            &["run", "examples/programs/moe_layer.mf", "--param", "d"],
            "expected NAME=VALUE",
        ),
    ];
    for (args, want) in cases {
        let o = meshflow(args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_cuda_backend_needs_the_cuda_feature() {
    let o = meshflow(&[
        "run",
        "examples/programs/column_parallel_linear_ring.mf",
        "--backend",
        "cuda",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("built without the `cuda` feature"), "{err}");
}

#[test]
fn the_proxy_wire_is_chosen_with_wire_and_auto_says_which() {
    let ring = "examples/programs/column_parallel_linear_ring.mf";
    let run = |wire: &str| {
        meshflow(&[
            "run",
            ring,
            "--ranks",
            "2",
            "--nodes",
            "2",
            "--wire",
            wire,
            "--explain",
        ])
    };
    let o = run("tcp");
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", text(&o.stderr));
    assert!(out.contains("proxy wire: tcp (requested)"), "{out}");
    assert!(out.contains("through the host proxy"), "{out}");
    // `auto` takes ibverbs only where every rank can; it says which wire and why.
    let o = run("auto");
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", text(&o.stderr));
    let line = out
        .lines()
        .find(|l| l.starts_with("proxy wire: "))
        .unwrap_or_else(|| panic!("no wire line in:\n{out}"));
    if meshflow::kernels::proxy::ibverbs_available().is_err() {
        assert!(line.starts_with("proxy wire: tcp (auto: rank"), "{line}");
        assert!(line.contains("cannot use ibverbs"), "{line}");
        // `ibverbs` without a device (or without the `rdma` feature) fails, saying why.
        let o = run("ibverbs");
        let err = text(&o.stderr);
        assert_ne!(o.status.code(), Some(0), "{}", text(&o.stdout));
        assert!(err.contains("ibverbs wire was requested"), "{err}");
    } else {
        assert!(line.starts_with("proxy wire: ibverbs (auto:"), "{line}");
    }
    let o = meshflow(&["run", ring, "--ranks", "2", "--wire", "udp"]);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert!(
        text(&o.stderr).contains("unknown wire `udp`"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn gpu_only_run_options_are_refused_on_the_cpu_backend() {
    let ring = "examples/programs/column_parallel_linear_ring.mf";
    let o = meshflow(&["run", ring, "--ranks", "2", "--graph"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stdout));
    assert!(err.contains("--graph records CUDA graphs"), "{err}");
    let o = meshflow(&["run", ring, "--ranks", "2", "--transport", "nvlink"]);
    let err = text(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert!(err.contains("prices nccl and copy-engine plans"), "{err}");
    let o = meshflow(&["run", ring, "--ranks", "2", "--explain"]);
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", text(&o.stderr));
    assert!(out.contains("transports: the CPU backend"), "{out}");
    // The CPU backend names no GPU: the default profile, said so.
    assert!(
        out.contains("profile: h200x2: default, no GPU named"),
        "{out}"
    );
}
