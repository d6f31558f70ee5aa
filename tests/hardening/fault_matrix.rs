//! The fault matrix on the CPU backend: a rank that returns an error, panics or stops
//! responding in the middle of a collective (chunked all_reduce), a collective permute (ring
//! all-gather) and an MoE dispatch, on 2, 4 and 8 ranks. In every case every rank returns
//! an error naming the failed rank (an error or a panic stops the others through the abort
//! signal, none waiting for the receive timeout; a stall is detected by the timeout), every
//! rank thread is joined (none survives the run), every rank released its buffers, and the
//! messages nobody received were dropped with the run. See `tests/support/faults.rs` for why
//! no check races the wall clock.

use crate::support::faults::*;
use crate::support::hardening as hardening_support;
use crate::support::runtime as common;

use std::time::{Duration, Instant};

use common::*;
use hardening_support::*;
use meshflow::ir::{HostProgram, Program};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cpu::{Fault, FaultKind};
use meshflow::runtime::ranks::RunError;
use meshflow::runtime::{run_cpu_observed, RunInputs};

const RANKS: [i64; 3] = [2, 4, 8];
const KINDS: [FaultKind; 3] = [FaultKind::Error, FaultKind::Panic, FaultKind::Stall];

/// One operation of the matrix: its programs for `d` ranks and the communication index
/// (0-based, per rank) that lands in its middle.
struct Case {
    name: &'static str,
    build: fn(i64) -> (Program, HostProgram),
    at_comm: usize,
    /// Text every failing rank's own error contains (the instruction).
    inst: &'static str,
}

fn collective(d: i64) -> (Program, HostProgram) {
    let s = 3;
    (
        level1("row_parallel_chunked.mf", &[("d", d), ("s", s)]),
        row_parallel_host(d, s),
    )
}

fn permute(d: i64) -> (Program, HostProgram) {
    (level1("ring_linear.mf", &[("d", d)]), ring_host(d))
}

fn moe(d: i64) -> (Program, HostProgram) {
    let (t, e, k, h, f) = (3, 2, 2, 8, 4);
    (
        level1(
            "moe_layer.mf",
            &[("d", d), ("t", t), ("e", e), ("k", k), ("h", h), ("f", f)],
        ),
        moe_host(d, t, e, k, h, f),
    )
}

const CASES: [Case; 3] = [
    Case {
        name: "collective (all_reduce)",
        build: collective,
        at_comm: 1,
        inst: "all_reduce(",
    },
    Case {
        name: "collective permute",
        build: permute,
        at_comm: 1,
        inst: "collective_permute(",
    },
    Case {
        name: "moe_dispatch",
        build: moe,
        at_comm: 0,
        inst: "moe_dispatch(",
    },
];

fn kind_name(kind: FaultKind) -> &'static str {
    match kind {
        FaultKind::Error => "error",
        FaultKind::Panic => "panic",
        FaultKind::Stall => "stall",
        // Ends the whole process: tested by the multi-process runs, not in-process.
        FaultKind::Exit => "exit",
    }
}

/// Runs one cell of the matrix and checks every promise; returns the elapsed time.
fn run_cell(case: &Case, d: i64, kind: FaultKind) -> Duration {
    let (l1, host) = (case.build)(d);
    let failed = (d as usize) / 2;
    let inputs = random_inputs(&l1, 9).unwrap();
    let mut opts = options();
    opts.config.timeout = match kind {
        FaultKind::Stall => STALL_TIMEOUT,
        _ => ABORT_TIMEOUT,
    };
    opts.config.faults = vec![Fault {
        rank: failed,
        at_comm: case.at_comm,
        kind,
    }];
    let cell = format!("{} / {} ranks / {}", case.name, d, kind_name(kind));
    let fds = open_fds();
    let start = Instant::now();
    let (result, resources) = run_cpu_observed(
        &host,
        RunInputs::Full {
            program: &l1,
            inputs: &inputs,
        },
        &opts,
    );
    let elapsed = start.elapsed();
    let err = result
        .err()
        .unwrap_or_else(|| panic!("{cell}: the run succeeded"));
    let RunError::Failed(failure) = err else {
        panic!("{cell}: expected a run failure, got {err}");
    };
    // Every rank returns an error naming the failed rank.
    assert_eq!(
        failure.errors.len(),
        d as usize,
        "{cell}: every rank returns an error: {failure}"
    );
    for e in &failure.errors {
        let text = e.to_string();
        assert!(
            text.contains(&format!("rank {failed}")),
            "{cell}: rank {}'s error does not name rank {failed}: {text}",
            e.rank()
        );
    }
    let own = failure
        .errors
        .iter()
        .find(|e| e.rank() == failed)
        .map(|e| e.to_string())
        .unwrap_or_default();
    let texts: Vec<(usize, String)> = failure
        .errors
        .iter()
        .map(|e| (e.rank(), e.to_string()))
        .collect();
    match kind {
        FaultKind::Error => assert!(
            own.contains(case.inst) && own.contains("injected error"),
            "{cell}: {own}"
        ),
        FaultKind::Panic => assert!(
            own.contains(&format!("rank {failed} panicked at `")) && own.contains(case.inst),
            "{cell}: {own}"
        ),
        FaultKind::Stall | FaultKind::Exit => {}
    }
    // Stopped by the abort signal (an error, a panic) or by the timeout (a stall), and so
    // within the timeout.
    match kind {
        FaultKind::Stall | FaultKind::Exit => {
            assert_stall_detected_by_timeout(&texts, failed, &cell);
            assert!(
                elapsed >= STALL_TIMEOUT && elapsed < STALL_BOUND,
                "{cell}: took {elapsed:?}"
            );
        }
        FaultKind::Error | FaultKind::Panic => {
            assert_stopped_by_abort(&texts, failed, &cell);
            assert!(elapsed < ABORT_TIMEOUT, "{cell}: took {elapsed:?}");
        }
    }
    // Every thread joined, none left behind; every buffer released; no descriptor leaked.
    assert_eq!(resources.threads_started, d as usize, "{cell}");
    assert_eq!(resources.threads_joined, d as usize, "{cell}");
    assert_eq!(cpu_threads(), 0, "{cell}: a rank thread survived the run");
    for (rank, held) in &resources.held_at_exit {
        assert!(held.is_empty(), "{cell}: rank {rank} still holds {held}");
    }
    assert_eq!(open_fds(), fds, "{cell}: file descriptors leaked");
    row(
        "faults",
        &[
            "cpu".into(),
            case.name.into(),
            d.to_string(),
            kind_name(kind).into(),
            format!("{:.0} ms", elapsed.as_secs_f64() * 1e3),
            format!(
                "{} undelivered message(s) dropped",
                resources.undelivered.buffers
            ),
            "survived".into(),
        ],
    );
    elapsed
}

fn run_matrix(case: &Case) {
    // Serialized so that `cpu_threads()` sees only this test's ranks (libtest's own threads
    // come and go, so the process-wide `Threads:` count is only printed).
    let _serial = serial();
    let threads_before = status("Threads");
    for d in RANKS {
        for kind in KINDS {
            run_cell(case, d, kind);
        }
    }
    eprintln!(
        "{}: process threads before {threads_before}, after {}",
        case.name,
        status("Threads")
    );
}

#[test]
fn faults_mid_collective_on_2_4_8_ranks() {
    run_matrix(&CASES[0]);
}

#[test]
fn faults_mid_collective_permute_on_2_4_8_ranks() {
    run_matrix(&CASES[1]);
}

#[test]
fn faults_mid_moe_dispatch_on_2_4_8_ranks() {
    run_matrix(&CASES[2]);
}
