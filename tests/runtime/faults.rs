//! Fault handling: a rank that errors, panics or stalls (mid-collective, mid-collective-permute,
//! mid-moe_dispatch) makes every other rank return an error naming it: an error or a panic
//! stops the others through the abort signal (none waits for the timeout), a stall is detected
//! by the timeout; all threads are joined (run_cpu returns). See `tests/support/faults.rs` for
//! why no check races the wall clock.

use crate::support::faults::*;
use crate::support::runtime as common;

use std::time::{Duration, Instant};

use common::*;
use meshflow::ir::{HostProgram, Program};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cpu::{Fault, FaultKind};
use meshflow::runtime::ranks::RunError;

/// The receive timeout of a run with `fault`.
fn timeout_for(fault: &Fault) -> Duration {
    match fault.kind {
        FaultKind::Stall => STALL_TIMEOUT,
        _ => ABORT_TIMEOUT,
    }
}

/// Runs with one fault and returns (every rank's error text, elapsed).
fn run_faulty(l1: &Program, host: &HostProgram, fault: Fault) -> (Vec<(usize, String)>, Duration) {
    let inputs = random_inputs(l1, 9).unwrap();
    let mut opts = options();
    opts.config.timeout = timeout_for(&fault);
    opts.config.faults = vec![fault];
    let start = Instant::now();
    let err = run_full(host, l1, &inputs, &opts).unwrap_err();
    let elapsed = start.elapsed();
    let RunError::Failed(f) = err else {
        panic!("expected a run failure, got {err}");
    };
    eprintln!("{f}\n  elapsed {elapsed:?}");
    let errors: Vec<(usize, String)> = f.errors.iter().map(|e| (e.rank(), e.to_string())).collect();
    for (r, e) in &errors {
        eprintln!("  rank {r}: {e}");
    }
    (errors, elapsed)
}

fn assert_everyone_names(errors: &[(usize, String)], ranks: usize, failed: usize) {
    assert_eq!(
        errors.len(),
        ranks,
        "every rank returns an error: {errors:#?}"
    );
    for (r, e) in errors {
        assert!(
            e.contains(&format!("rank {failed}")),
            "rank {r}'s error does not name rank {failed}: {e}"
        );
    }
}

#[test]
fn a_rank_that_errors_stops_the_others_quickly() {
    let (d, failed) = (4, 2);
    let l1 = level1("ring_linear.mf", &[("d", d)]);
    let fault = Fault {
        rank: failed,
        at_comm: 1,
        kind: FaultKind::Error,
    };
    let (errors, elapsed) = run_faulty(&l1, &ring_host(d), fault);
    assert_everyone_names(&errors, d as usize, failed);
    let own = &errors.iter().find(|(r, _)| *r == failed).unwrap().1;
    assert!(
        own.contains("c0 = collective_permute(x -> ag_chunk"),
        "{own}"
    );
    assert!(own.contains("at i0=1"), "{own}");
    assert!(own.contains("injected error at communication #1"), "{own}");
    assert_stopped_by_abort(&errors, failed, "error");
    assert!(elapsed < ABORT_TIMEOUT, "took {elapsed:?}");
}

#[test]
fn a_rank_that_panics_stops_the_others_quickly() {
    let (d, failed) = (4, 1);
    let l1 = level1("row_parallel_chunked.mf", &[("d", d), ("s", 3)]);
    let fault = Fault {
        rank: failed,
        at_comm: 2,
        kind: FaultKind::Panic,
    };
    let (errors, elapsed) = run_faulty(&l1, &row_parallel_host(d, 3), fault);
    assert_everyone_names(&errors, d as usize, failed);
    let own = &errors.iter().find(|(r, _)| *r == failed).unwrap().1;
    assert!(
        own.contains("rank 1 panicked at `c0 = all_reduce(y_chunk -> z_chunk"),
        "{own}"
    );
    assert!(own.contains("at i0=2"), "{own}");
    assert_stopped_by_abort(&errors, failed, "panic");
    assert!(elapsed < ABORT_TIMEOUT, "took {elapsed:?}");
}

/// Checks a stalled run: detected by the timeout (a peer timed out waiting for `failed`), and
/// so no sooner than the timeout and well before the stalled rank gives up by itself.
fn assert_stall_detected(errors: &[(usize, String)], failed: usize, elapsed: Duration) {
    assert_stall_detected_by_timeout(errors, failed, "stall");
    assert!(
        elapsed >= STALL_TIMEOUT && elapsed < STALL_BOUND,
        "took {elapsed:?}"
    );
}

#[test]
fn a_rank_that_stalls_mid_collective_is_detected_within_the_timeout() {
    let (d, failed) = (4, 3);
    let l1 = level1("row_parallel_chunked.mf", &[("d", d), ("s", 3)]);
    let fault = Fault {
        rank: failed,
        at_comm: 1,
        kind: FaultKind::Stall,
    };
    let (errors, elapsed) = run_faulty(&l1, &row_parallel_host(d, 3), fault);
    assert_everyone_names(&errors, d as usize, failed);
    assert_stall_detected(&errors, failed, elapsed);
}

#[test]
fn a_rank_that_stalls_mid_collective_permute_is_detected_within_the_timeout() {
    let (d, failed) = (4, 2);
    let l1 = level1("ring_linear.mf", &[("d", d)]);
    let fault = Fault {
        rank: failed,
        at_comm: 1,
        kind: FaultKind::Stall,
    };
    let (errors, elapsed) = run_faulty(&l1, &ring_host(d), fault);
    assert_everyone_names(&errors, d as usize, failed);
    assert_stall_detected(&errors, failed, elapsed);
}

#[test]
fn a_rank_that_stalls_mid_moe_dispatch_is_detected_within_the_timeout() {
    let (d, failed) = (8, 5);
    let l1 = level1(
        "moe_layer.mf",
        &[("d", d), ("t", 3), ("e", 2), ("k", 2), ("h", 8), ("f", 4)],
    );
    let fault = Fault {
        rank: failed,
        at_comm: 0,
        kind: FaultKind::Stall,
    };
    let (errors, elapsed) = run_faulty(&l1, &moe_host(d, 3, 2, 2, 8, 4), fault);
    assert_everyone_names(&errors, d as usize, failed);
    assert!(errors.iter().any(|(_, e)| e.contains("moe_dispatch")));
    assert_stall_detected(&errors, failed, elapsed);
}
