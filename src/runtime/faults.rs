//! Fault injection, for tests only (feature `fault-injection`, off in normal builds; the
//! workspace's test builds turn it on): a rank that fails on purpose at a chosen
//! communication, to check that the others stop with an error naming it instead of hanging.
//!
//! - CPU backend: [`Fault`]s in `CpuConfig::faults` (an error, a panic, a stall, or the whole
//!   process exiting).
//! - CUDA backend: `CudaConfig::exit_at_comm` (the process exits).
//! - The `meshflow` binary reads `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]` ([`exits_from_env`]): the
//!   process of `RANK` of a multi-process run exits at its `N`-th communication.

use meshflow_ir::DeviceId;

/// What an injected fault does.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The communication returns an error.
    Error,
    /// The rank thread panics.
    Panic,
    /// The rank stops (blocks) until the run is aborted.
    Stall,
    /// The whole process exits at once with status [`FAULT_EXIT_STATUS`], as if it were
    /// killed (for multi-process tests: the other nodes lose this node mid-run).
    Exit,
}

/// The exit status of a process stopped by [`FaultKind::Exit`].
pub const FAULT_EXIT_STATUS: i32 = 86;

/// A fault injected for testing: rank `rank` fails when it posts its `at_comm`-th
/// communication (0-based, counting every collective, permute and MoE op it posts).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The rank.
    pub rank: DeviceId,
    /// Which communication (0-based).
    pub at_comm: usize,
    /// What happens.
    pub kind: FaultKind,
}

/// The variable [`exits_from_env`] reads.
pub const FAULT_EXIT_ENV: &str = "MESHFLOW_FAULT_EXIT";

/// `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]`: `(rank, n)` pairs, the process of `rank` exiting at
/// its `n`-th communication (0-based). Empty when the variable is not set.
pub fn exits_from_env() -> Result<Vec<(DeviceId, usize)>, String> {
    let Ok(spec) = std::env::var(FAULT_EXIT_ENV) else {
        return Ok(Vec::new());
    };
    spec.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            item.split_once(':')
                .and_then(|(r, n)| Some((r.trim().parse().ok()?, n.trim().parse().ok()?)))
                .ok_or_else(|| format!("{FAULT_EXIT_ENV}: `{item}` is not RANK:N"))
        })
        .collect()
}
