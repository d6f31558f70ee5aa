//! [`Plan`]: one point of the schedule search (decomposition, chunk count, stream schedule,
//! transport), which `choose_decompositions` picks and `lower_to_host` follows.

use crate::manager::{Decomposition, StreamSchedule};
use crate::profile::transport_key;
use crate::Transport;

/// How one resharding runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The decomposition.
    pub decomposition: Decomposition,
    /// Pieces each step's compute is cut into (1, or more for the reduce-scatter ring, whose adds
    /// then run under the next piece's GEMM).
    pub pieces: u64,
    /// How the stream loop uses streams: [`StreamSchedule::PerIteration`] or
    /// [`StreamSchedule::Prefetch`] (never `Auto`). Neighbour rings always place their own
    /// streams (compute on the main stream, transfers ahead on workers): `Prefetch`.
    pub schedule: StreamSchedule,
    /// The transport the bytes move over.
    pub transport: Transport,
    /// Reduce-scatter ring only: the running sum received from rank − 1 lands in this step's
    /// accumulator (the result itself at the last step) and the step's chunk GEMM adds onto
    /// it in place (`linear_accumulate`), each piece's transfer starting once that piece is
    /// computed; no separate add. Only where the producer of the partial sums is a `linear`
    /// read by the reduce alone, all of one dtype (see `docs/schedule-search.md`).
    pub accumulate: bool,
}

impl Plan {
    /// The chunk count over a team of `team`: 1 for a collective, `team` (times the pieces)
    /// for the stream decompositions, `2 * team` for the bidirectional ring.
    pub fn chunks(&self, team: u64) -> u64 {
        match self.decomposition {
            Decomposition::Collective => 1,
            Decomposition::RingBidirectional => 2 * team,
            _ => team * self.pieces.max(1),
        }
    }

    /// E.g. `ring(s=2, prefetch, copy_engine)`, `ring_forward(s=8, prefetch, copy_engine,
    /// accumulate)`.
    pub fn label(&self, team: u64) -> String {
        let schedule = match self.decomposition {
            Decomposition::Collective => String::new(),
            _ => format!(", {}", self.schedule.name()),
        };
        let accumulate = if self.accumulate { ", accumulate" } else { "" };
        format!(
            "{}(s={}{schedule}, {}{accumulate})",
            self.decomposition.name(),
            self.chunks(team),
            transport_key(self.transport)
        )
    }

    /// How much simpler this plan is than others of about the same predicted time (lower is
    /// simpler): fewer instructions and streams win ties.
    pub fn complexity(&self) -> u64 {
        let base = match (self.decomposition, self.schedule) {
            (Decomposition::Collective, _) => 0,
            (Decomposition::StreamBroadcast | Decomposition::StreamReduce, _) => 1,
            (Decomposition::Ring, StreamSchedule::Prefetch) => 3,
            (Decomposition::Ring, _) => 2,
            (Decomposition::RingForward, _) => 4,
            (Decomposition::RingBidirectional, _) => 6,
        };
        base + self.pieces.max(1) - 1
    }
}
