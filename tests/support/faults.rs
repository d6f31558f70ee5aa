//! Timeouts and checks of the CPU fault tests (`tests/runtime/faults.rs`,
//! `tests/hardening/fault_matrix.rs`), free of wall-clock races on a loaded machine:
//!
//! - A rank that errors or panics stops the others through the run's abort signal, not through
//!   the receive timeout. The tests show it by what the other ranks return (every one "aborted
//!   because rank N failed", none "timed out"), under a timeout so long that no healthy rank,
//!   however late the machine schedules it, reaches it first.
//! - A rank that stalls is detected by the receive timeout itself, so a stalled run lasts at
//!   least the timeout. The tests show it by a peer's "timed out ... waiting for rank N" (a
//!   stalled rank that gave up by itself would only report its own injected stall) and by the
//!   run ending long before the stalled rank's own limit of 20 timeouts.

use std::time::Duration;

/// The receive timeout of runs where a rank errors or panics: the abort signal stops the run
/// long before it, so it only bounds a broken abort path.
pub const ABORT_TIMEOUT: Duration = Duration::from_secs(60);

/// The receive timeout of runs where a rank stalls: it detects the stall, so every such run
/// lasts at least this long. Long enough that a healthy rank delayed by a loaded machine is
/// never the one waited for when it expires (the timeout blames the end of the chain of
/// waiting ranks, which must be the stalled one).
pub const STALL_TIMEOUT: Duration = Duration::from_secs(2);

/// An upper bound on a stalled run: half of the stalled rank's own limit (the CPU backend ends
/// an injected stall after 20 timeouts), so a run that ends within it was ended by the timeout, with 8 timeouts
/// of slack for a loaded machine.
pub const STALL_BOUND: Duration = STALL_TIMEOUT.saturating_mul(10);

/// Checks that every rank of `errors` (rank, error text) but `failed` stopped because of the
/// abort signal raised by `failed`, and that no rank timed out.
pub fn assert_stopped_by_abort(errors: &[(usize, String)], failed: usize, cell: &str) {
    for (rank, text) in errors {
        assert!(
            !text.contains("timed out"),
            "{cell}: rank {rank} timed out instead of stopping on the abort signal: {text}"
        );
        if *rank != failed {
            assert!(
                text.contains(&format!("aborted because rank {failed} failed")),
                "{cell}: rank {rank} did not stop on the abort signal of rank {failed}: {text}"
            );
        }
    }
}

/// Checks that a rank of `errors` (rank, error text) timed out waiting for the stalled rank
/// `failed` (the others report that rank's timeout as the reason they stopped).
pub fn assert_stall_detected_by_timeout(errors: &[(usize, String)], failed: usize, cell: &str) {
    assert!(
        errors
            .iter()
            .any(|(_, text)| text.contains("timed out after")
                && text.contains(&format!("waiting for rank {failed}"))),
        "{cell}: no rank reports timing out waiting for rank {failed}: {errors:#?}"
    );
}
