//! `meshflow run --graph` on GPUs: a step recorded as a CUDA graph and replayed.

use crate::support::gpu::skip_unless;

/// The command line: `run --graph --explain` on 2 GPUs records the ring as a CUDA graph over
/// NCCL and says so; `--graph` in a run split into nodes is refused with the reason.
#[test]
fn run_graph_on_the_command_line() {
    if skip_unless(2, "run_graph_on_the_command_line") {
        return;
    }
    let ring = format!(
        "{}/examples/programs/column_parallel_linear_ring.mf",
        crate::support::root().display()
    );
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_meshflow"))
            .args([
                "run",
                &ring,
                "--backend",
                "cuda",
                "--ranks",
                "2",
                "--explain",
            ])
            .args(extra)
            .output()
            .expect("the meshflow binary runs")
    };
    let o = run(&["--graph"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{out}{err}");
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(out.lines().last().unwrap_or("").starts_with("ok "), "{out}");
    assert!(out.contains("recorded one step as a CUDA graph"), "{out}");
    assert!(
        out.contains("collective_permute: nccl (ranks 0,1)"),
        "{out}"
    );
    let o = run(&["--graph", "--nodes", "2"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("cannot be recorded as a CUDA graph") && err.contains("host-proxy"),
        "{err}"
    );
}
