//! A rank started by `meshflow launch` takes its rank count from `WORLD_SIZE` when `--ranks`
//! is not given (the README's multi-process command; on GPUs see `cli_gpu`).

use crate::{out_err, succeeds, RING};

#[test]
fn a_launched_rank_compiles_and_runs_for_the_launch_size() {
    let exe = env!("CARGO_BIN_EXE_meshflow");
    let out = succeeds(&["launch", "--nproc", "2", "--", exe, "lower", RING]);
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}]   mesh m0 = [0, 1]\n")),
            "rank {rank}: {out}"
        );
    }
    let out = succeeds(&["launch", "--nproc", "2", "--", exe, "run", RING]);
    for rank in 0..2 {
        assert!(
            out.contains(&format!("[rank {rank}] ran on 2 CPU ranks")),
            "rank {rank}: {out}"
        );
        assert!(
            out.contains(&format!("[rank {rank}] ok y: rel err")),
            "rank {rank}: {out}"
        );
    }
}

#[test]
fn an_explicit_rank_count_wins_over_world_size() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_meshflow"))
        .args(["lower", RING, "--ranks", "3"])
        .current_dir(crate::support::root())
        .env("WORLD_SIZE", "2")
        .env("RANK", "0")
        .output()
        .expect("runs");
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("mesh m0 = [0, 1, 2]\n"), "{out}");
}
