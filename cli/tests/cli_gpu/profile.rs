//! The machine profile of a GPU run: without `--profile`, `meshflow run --backend cuda` (in
//! one process and under `meshflow launch`, every rank) prices its plans with the built-in
//! profile of the GPU model it runs on, and `--explain` and the log say so; a given profile
//! wins.

use std::process::{Command, Output};

use meshflow::passes::profile::DEFAULT;
use meshflow::passes::Profile;

use crate::support::gpu::skip_unless;

fn meshflow(args: &[&str], log: bool) -> (Output, String, String) {
    let ring = crate::support::root().join("examples/programs/column_parallel_linear_ring.mf");
    let exe = env!("CARGO_BIN_EXE_meshflow");
    let mut cmd = Command::new(exe);
    for a in args {
        match *a {
            "EXE" => cmd.arg(exe),
            "RING" => cmd.arg(&ring),
            a => cmd.arg(a),
        };
    }
    cmd.env_remove("MESHFLOW_NODE_SIZE")
        .env_remove("MESHFLOW_FAULT_EXIT");
    if log {
        cmd.env("RUST_LOG", "meshflow::pipeline=info");
    }
    let o = cmd.output().expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{out}{err}");
    (o, out, err)
}

#[test]
fn gpu_runs_price_plans_with_the_profile_of_their_gpu() {
    if skip_unless(2, "gpu_runs_price_plans_with_the_profile_of_their_gpu") {
        return;
    }
    let name = meshflow::kernels::Device::name_of(0).expect("GPU 0 has a name");
    let want = match Profile::builtin_for_device(&name) {
        Some(p) => format!("{p}: built-in profile of {name}"),
        None => format!("{DEFAULT}: default, no built-in profile for {name}"),
    };
    eprintln!("GPU 0: {name}; expecting the profile {want}");
    // In one process: `--explain` names the profile, the log says it too.
    let run = [
        "run",
        "RING",
        "--ranks",
        "2",
        "--backend",
        "cuda",
        "--explain",
    ];
    let (o, out, err) = meshflow(&run, true);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains(&format!("profile: {want}\n")), "{out}");
    assert!(err.contains(&format!("machine profile {want}")), "{err}");
    // A given profile wins over the GPU's.
    let given = [&run[..], &["--profile", "h200x2"]].concat();
    let (o, out, err) = meshflow(&given, false);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains("profile: h200x2: given (--profile h200x2)\n"),
        "{out}"
    );
    // One process per GPU: every rank lowers with the same profile.
    let launch = [
        "launch",
        "--nproc",
        "2",
        "--",
        "EXE",
        "run",
        "RING",
        "--backend",
        "cuda",
        "--explain",
    ];
    let (o, out, err) = meshflow(&launch, false);
    assert!(o.status.success(), "{out}{err}");
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}] profile: {want}\n")),
            "rank {rank}: {out}"
        );
    }
}

#[test]
fn launched_ranks_told_different_gpu_models_run_rank_0s_program() {
    if skip_unless(
        2,
        "launched_ranks_told_different_gpu_models_run_rank_0s_program",
    ) {
        return;
    }
    // Hosts with different GPUs, simulated by `MESHFLOW_GPU_MODEL` per rank: rank 0 is told
    // H200, rank 1 H100. On their own they would lower different all-gathers (h200x2: a ring
    // of sends and receives; h100x2: one NCCL all-gather) and never match; agreeing, both run
    // rank 0's program and the outputs match the reference.
    let program = crate::support::root().join("tests/data/agree/allgather_linear_searched.mf");
    let exe = env!("CARGO_BIN_EXE_meshflow");
    let script = r#"if [ "$RANK" = 0 ]; then export MESHFLOW_GPU_MODEL="NVIDIA H200"; else export MESHFLOW_GPU_MODEL="NVIDIA H100 80GB HBM3"; fi; exec "$0" run "$1" --backend cuda --explain"#;
    let o = Command::new(exe)
        .args(["launch", "--nproc", "2", "--", "sh", "-c", script, exe])
        .arg(&program)
        .env_remove("MESHFLOW_NODE_SIZE")
        .env_remove("MESHFLOW_FAULT_EXIT")
        .env_remove("RUST_LOG")
        .output()
        .expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{out}{err}");
    assert!(o.status.success(), "{out}{err}");
    let h200 = "h200x2: built-in profile of NVIDIA H200";
    assert!(
        out.contains(&format!("[rank 0] profile: {h200}\n")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "[rank 1] profile: {h200}, rank 0's, which every rank takes (this rank's own: \
             h100x2: built-in profile of NVIDIA H100 80GB HBM3)\n"
        )),
        "{out}"
    );
    assert!(
        err.contains("rank 1 prices its plans with rank 0's machine profile h200x2"),
        "{err}"
    );
    assert!(out.contains("[rank 0] ok y: rel err"), "{out}");
}
