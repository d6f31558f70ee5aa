//! A rank started by `meshflow launch` takes its rank count from `WORLD_SIZE` when `--ranks`
//! is not given (the README's multi-process command; on GPUs see `cli_gpu`). The ranks of a
//! GPU run (`--backend cuda`) agree on the machine profile before lowering and check that they
//! lowered the same program: ranks told different GPU models (`MESHFLOW_GPU_MODEL`, set per
//! rank by a shell) take rank 0's profile, ranks given different profiles or options fail
//! naming them.

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

/// The program whose all-gather the profiles of H100 and H200 plan differently on two ranks.
const SEARCHED: &str = "tests/data/agree/allgather_linear_searched.mf";

/// `meshflow launch --nproc 2 -- sh -c SCRIPT`: each rank runs `SCRIPT` with `$RANK` set,
/// `$0` the binary and `$1` [`SEARCHED`]; returns whether the launch succeeded and its output.
fn launch_ranks(script: &str) -> (bool, String) {
    let exe = env!("CARGO_BIN_EXE_meshflow");
    let o = crate::meshflow(&[
        "launch", "--nproc", "2", "--", "sh", "-c", script, exe, SEARCHED,
    ]);
    let (out, err) = out_err(&o);
    (o.status.success(), format!("{out}{err}"))
}

/// The lines of rank `rank`'s output.
fn lines_of(text: &str, rank: usize) -> Vec<&str> {
    let prefix = format!("[rank {rank}] ");
    text.lines().filter(|l| l.starts_with(&prefix)).collect()
}

/// `--backend cuda` without the `cuda` feature: every rank agrees on the profile, lowers, checks
/// that it lowered rank 0's program, and only then finds it cannot run (on GPUs the same job
/// runs: `cli_gpu/profile.rs`).
#[cfg(not(feature = "cuda"))]
#[test]
fn launched_gpu_ranks_on_different_models_lower_with_rank_0s_profile() {
    const NO_CUDA: &str = "error: this meshflow was built without the `cuda` feature";
    let h100 = "NVIDIA H100 80GB HBM3";
    // Rank 0 on H200, rank 1 on H100: rank 1 takes rank 0's profile and says so.
    let (ok, text) = launch_ranks(
        r#"if [ "$RANK" = 0 ]; then export MESHFLOW_GPU_MODEL="NVIDIA H200"; else export MESHFLOW_GPU_MODEL="NVIDIA H100 80GB HBM3"; fi; exec "$0" run "$1" --backend cuda"#,
    );
    assert!(!ok, "{text}");
    let warning = format!(
        "rank 1 prices its plans with rank 0's machine profile h200x2 (built-in profile of \
         NVIDIA H200) instead of its own h100x2 (built-in profile of {h100}) so that every rank \
         lowers the same program (rank 1's GPU: {h100}; rank 0's GPU: NVIDIA H200)"
    );
    let rank1 = lines_of(&text, 1);
    assert!(
        rank1
            .iter()
            .any(|l| l.contains("WARN") && l.contains(&warning)),
        "{text}"
    );
    let rank0 = lines_of(&text, 0);
    assert!(!rank0.iter().any(|l| l.contains("WARN")), "{text}");
    // Past the agreement and the program check: the run itself is what fails (on the rank
    // that gets there first: the launcher may end the other before it says so).
    assert!(text.contains(NO_CUDA), "{text}");
    assert!(!text.contains("different"), "{text}");
    // A profile given to rank 1 wins over rank 0's GPU: rank 0 switches to it.
    let (ok, text) = launch_ranks(
        r#"if [ "$RANK" = 0 ]; then exec env MESHFLOW_GPU_MODEL="NVIDIA H100 80GB HBM3" "$0" run "$1" --backend cuda; else exec "$0" run "$1" --backend cuda --profile h200x2; fi"#,
    );
    assert!(!ok, "{text}");
    let warning = format!(
        "rank 0 prices its plans with rank 1's machine profile h200x2 (given) instead of its own \
         h100x2 (built-in profile of {h100})"
    );
    assert!(
        lines_of(&text, 0)
            .iter()
            .any(|l| l.contains("WARN") && l.contains(&warning)),
        "{text}"
    );
    assert!(text.contains(NO_CUDA), "{text}");
}

#[test]
fn launched_gpu_ranks_given_different_profiles_fail_naming_them() {
    let (ok, text) = launch_ranks(
        r#"if [ "$RANK" = 0 ]; then P=h200x2; else P=h100x2; fi; exec "$0" run "$1" --backend cuda --profile "$P""#,
    );
    assert!(!ok, "{text}");
    let reason = "the ranks of this job were given different machine profiles (rank 0 given \
                  `h200x2`; rank 1 given `h100x2`), so they would lower different programs: \
                  give every rank the same --profile (or none, and every rank takes rank 0's)";
    // Every rank stops with the same reason (the launcher may end the other rank first).
    let said = |rank: usize| {
        let want = format!("[rank {rank}] error: rank {rank}: {reason}");
        text.lines().any(|l| l == want)
    };
    assert!(said(0) || said(1), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn launched_gpu_ranks_that_lower_different_programs_fail_naming_them() {
    // The same profile but other options on rank 1: the program check catches it before the
    // first step.
    let (ok, text) = launch_ranks(
        r#"if [ "$RANK" = 0 ]; then S=2; else S=1; fi; exec "$0" run "$1" --backend cuda --profile h200x2 --streams "$S""#,
    );
    assert!(!ok, "{text}");
    let reason = "rank 1 lowered a different host program than rank 0 (rank 0: program ";
    let said = |rank: usize| {
        lines_of(&text, rank)
            .iter()
            .any(|l| l.contains("error:") && l.contains(reason))
    };
    assert!(said(0) || said(1), "{text}");
    assert!(
        text.contains("machine profile h200x2: given; rank 1: program "),
        "{text}"
    );
}
