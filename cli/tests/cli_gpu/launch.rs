//! The README's multi-process GPU command: `meshflow launch --nproc 2 -- meshflow run
//! examples/programs/column_parallel_linear_ring.mf --backend cuda`. Each rank takes its rank
//! count from `WORLD_SIZE` (the example's own default is 4 ranks), and rank 0 compares.

use std::process::Command;

use crate::support::gpu::skip_unless;

#[test]
fn the_readme_launch_command_runs_on_two_gpus() {
    if skip_unless(2, "the_readme_launch_command_runs_on_two_gpus") {
        return;
    }
    let exe = env!("CARGO_BIN_EXE_meshflow");
    let ring = crate::support::root().join("examples/programs/column_parallel_linear_ring.mf");
    let o = Command::new(exe)
        .args(["launch", "--nproc", "2", "--", exe, "run"])
        .arg(&ring)
        .args(["--backend", "cuda"])
        .env_remove("MESHFLOW_NODE_SIZE")
        .env_remove("MESHFLOW_FAULT_EXIT")
        .output()
        .expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{out}{err}");
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("[rank 0] ok y: rel err"), "{out}");
    assert!(out.contains("[rank 1] rank 1 of 2 (GPU 1) ran in"), "{out}");
}
