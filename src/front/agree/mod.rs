//! Ranks that lower a program each in their own process (`meshflow launch`, torchrun, several
//! nodes) must lower the *same* host program: its communications are matched across ranks,
//! so two ranks with different plans fail with a confusing error at best and hang at worst.
//! What a rank lowers depends on its [`Options`](crate::Options), and through the machine
//! profile ([`choose_profile`](crate::pipeline::choose_profile)) on the GPU model of its host,
//! which can differ between the nodes of one job. Two checks keep the ranks together:
//!
//! - [`agree_profile`], **before lowering**: every rank publishes the profile it would price
//!   its plans with ([`ProfileClaim`]: the profile's canonical JSON, whether it was given, its
//!   GPU model and the reason) at the job's rendezvous; rank 0 decides ([`agree_profiles`], a
//!   pure function) and every rank takes the decision. Ranks that differ only through their GPU
//!   model take rank 0's profile (a warning on each rank that switched names both GPU models
//!   and profiles); a profile given to some ranks wins over the GPU models; two *different*
//!   given profiles fail on every rank with an error naming the ranks and the profiles.
//!   [`Options::agree_profile`](crate::Options::agree_profile) does it for a rank's options.
//! - [`check_same_program`], **after lowering, before the first step**: every rank publishes a
//!   [`ProgramFingerprint`] of its host program (a hash of its text and transport, with the
//!   profile's reason); a rank whose program differs from rank 0's fails with an error naming
//!   both ranks and their profiles and aborts the rendezvous, so that every rank stops with
//!   that reason instead of waiting at a communication that never matches. This catches what
//!   the profile agreement cannot: ranks started with different options or builds.
//!
//! `meshflow run --backend cuda` under `meshflow launch` does both; a GPU job of the embedding
//! API whose ranks meet through a rendezvous that spans processes
//! (`CudaJob::for_program_with_rendezvous`) checks the fingerprint when a rank's backend is
//! made, and its front end calls [`Options::agree_profile`](crate::Options::agree_profile)
//! before compiling to agree on the profile; so does the Python package's torch executor given
//! a level-1 program (`Program.lower_for_rank`). See `docs/schedule-search.md` ("Profiles").

mod profile;
mod program;

pub use profile::{
    agree_profile, agree_profiles, switch_warning, ProfileClaim, ProfileDisagreement,
};
pub use program::{check_same_program, ProgramFingerprint};

use crate::runtime::rendezvous::RendezvousError;

/// Why the ranks of a job could not agree on what they lower.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AgreeError {
    /// Ranks were given different machine profiles (every rank reports the same text).
    #[error("{0}")]
    Profiles(String),
    /// A rank lowered a different host program than rank 0.
    #[error("{0}")]
    Programs(String),
    /// What a rank published cannot be read (another build of meshflow, or not a rank of ours).
    #[error("what rank {rank} published at the rendezvous cannot be read: {message}")]
    Malformed {
        /// The rank.
        rank: usize,
        /// What is wrong.
        message: String,
    },
    /// The rendezvous failed (a rank never arrived, or stopped).
    #[error("agreeing on the program to lower: {0}")]
    Rendezvous(#[from] RendezvousError),
}

/// Splits `bytes` into its first `n` lines and the rest (UTF-8), or says what is missing.
fn split_lines(bytes: &[u8], n: usize) -> Result<(Vec<&str>, &str), String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    let mut rest = text;
    let mut lines = Vec::with_capacity(n);
    for i in 0..n {
        let (line, tail) = rest
            .split_once('\n')
            .ok_or_else(|| format!("{} lines expected, found {i}", n + 1))?;
        lines.push(line);
        rest = tail;
    }
    Ok((lines, rest))
}

/// The value of a `name=value` line.
fn field<'a>(line: &'a str, name: &str) -> Result<&'a str, String> {
    line.strip_prefix(name)
        .and_then(|l| l.strip_prefix('='))
        .ok_or_else(|| format!("`{name}=...` expected, found `{line}`"))
}

/// `text` on one line (newlines of a GPU name or a reason would break the line format).
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// `ranks 0, 2` or `rank 1`.
fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list.join("")),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// How many agreements of kind `what` rank `rank` of this process has started on the store
/// `namespace`, this one included: a part of their keys, so that the agreements of successive
/// jobs on one long-lived store (a torch store, the rendezvous of a benchmark) never read each
/// other's values. The ranks of a job make their agreements in the same order, so their counts
/// match (as the communicators of `runtime::cuda` count their generations).
fn generation(namespace: &str, what: &'static str, rank: usize) -> u64 {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Counts = HashMap<(String, &'static str, usize), u64>;
    static COUNTS: OnceLock<Mutex<Counts>> = OnceLock::new();
    let mut counts = COUNTS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let n = counts
        .entry((namespace.to_string(), what, rank))
        .or_insert(0);
    *n += 1;
    *n
}
