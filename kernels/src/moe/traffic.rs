//! The bytes one dispatch / combine step moves, deduplicated: one row per (token, destination
//! rank), for bandwidth figures reported the way DeepEP reports them.
//!
//! **Formula.** Rank `d` receives, in a dispatch, one wire row for every token (of any rank,
//! itself included) with at least one expert on `d`; in the combine it receives one partial
//! row for every (token of its own, rank hosting one of the token's experts) pair. Counted per
//! row are the bytes that carry the token ([`WireLayout::token_bytes`]: the payload plus FP8
//! scales, without metadata or padding) and `F` elements of the dtype for a partial.
//!
//! - `dispatch bytes(d) = Σ_s rows(s → d) · token_bytes` (DeepEP's "logical" receive bytes:
//!   local rows included);
//! - `combine bytes(d) = Σ_r rows(d → r) · F · sizeof(dtype)`;
//! - the `remote_*` variants leave out `s = d` / `r = d` (the bytes that cross a link).
//!
//! A phase's bandwidth is `max_d bytes(d) / time` ([`MoeTraffic::gbps`]), the busiest rank
//! over the step time measured on the slowest rank.

use super::{MoeShape, MoeWire, WireLayout};
use crate::error::{KernelError, Result};

/// Rows per (source, destination) pair of one step, and the bytes each row counts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeTraffic {
    /// `rows[s][d]`: tokens of rank `s` that travel to rank `d` (deduplicated).
    pub rows: Vec<Vec<usize>>,
    /// Bytes a dispatched row counts for ([`WireLayout::token_bytes`]).
    pub dispatch_row_bytes: usize,
    /// Bytes a combine partial counts for (`F · sizeof(dtype)`).
    pub combine_row_bytes: usize,
}

impl MoeTraffic {
    /// The traffic of a step with every rank's `topk_idx[s]` (`[T, K]`); ids that are not
    /// experts are skipped, as the kernels do.
    pub fn from_routing(
        shape: &MoeShape,
        wire: MoeWire,
        topk_idx: &[Vec<i32>],
    ) -> Result<MoeTraffic> {
        shape.validate()?;
        let (w, t, k, l) = (
            shape.world,
            shape.tokens,
            shape.top_k,
            shape.local_experts(),
        );
        if topk_idx.len() != w {
            return Err(KernelError::InvalidArgument(format!(
                "MoE traffic: {} index sets for a team of {w}",
                topk_idx.len()
            )));
        }
        let mut rows = vec![vec![0usize; w]; w];
        let mut seen = vec![false; w];
        for (s, idx) in topk_idx.iter().enumerate() {
            if idx.len() != t * k {
                return Err(KernelError::InvalidArgument(format!(
                    "MoE traffic: topk_idx of rank {s} has {} entries, expected {}",
                    idx.len(),
                    t * k
                )));
            }
            for token in idx.chunks(k.max(1)) {
                seen.fill(false);
                for &e in token {
                    if let Ok(e) = usize::try_from(e) {
                        if e < shape.experts {
                            seen[e / l] = true;
                        }
                    }
                }
                for (d, _) in seen.iter().enumerate().filter(|(_, s)| **s) {
                    rows[s][d] += 1;
                }
            }
        }
        Ok(MoeTraffic::from_rows(shape, wire, rows))
    }

    /// The traffic with measured `rows[s][d]` (e.g. from [`MoeTransport::received_rows`] of
    /// every rank).
    ///
    /// [`MoeTransport::received_rows`]: super::MoeTransport::received_rows
    pub fn from_rows(shape: &MoeShape, wire: MoeWire, rows: Vec<Vec<usize>>) -> MoeTraffic {
        MoeTraffic {
            rows,
            dispatch_row_bytes: WireLayout::of(shape, wire).token_bytes(),
            combine_row_bytes: shape.y_row_bytes(),
        }
    }

    fn sum(
        &self,
        f: impl Fn(usize, usize) -> bool,
        pick: impl Fn(&Self, usize, usize) -> usize,
    ) -> u64 {
        let n = self.rows.len();
        (0..n)
            .flat_map(|s| (0..n).map(move |d| (s, d)))
            .filter(|&(s, d)| f(s, d))
            .map(|(s, d)| pick(self, s, d) as u64)
            .sum()
    }

    /// Dispatch bytes rank `d` receives, its own rows included.
    pub fn dispatch_bytes(&self, d: usize) -> u64 {
        self.sum(|_, dd| dd == d, |m, s, d| m.rows[s][d]) * self.dispatch_row_bytes as u64
    }

    /// Dispatch bytes rank `d` receives from other ranks.
    pub fn dispatch_remote_bytes(&self, d: usize) -> u64 {
        self.sum(|s, dd| dd == d && s != d, |m, s, d| m.rows[s][d]) * self.dispatch_row_bytes as u64
    }

    /// Combine bytes rank `s` receives (partials of its tokens), its own included.
    pub fn combine_bytes(&self, s: usize) -> u64 {
        self.sum(|ss, _| ss == s, |m, s, d| m.rows[s][d]) * self.combine_row_bytes as u64
    }

    /// Combine bytes rank `s` receives from other ranks.
    pub fn combine_remote_bytes(&self, s: usize) -> u64 {
        self.sum(|ss, d| ss == s && d != s, |m, s, d| m.rows[s][d]) * self.combine_row_bytes as u64
    }

    /// The busiest rank's bytes of a phase: `(dispatch, combine)`, local rows included.
    pub fn max_bytes(&self) -> (u64, u64) {
        let n = self.rows.len();
        (
            (0..n).map(|d| self.dispatch_bytes(d)).max().unwrap_or(0),
            (0..n).map(|s| self.combine_bytes(s)).max().unwrap_or(0),
        )
    }

    /// The busiest rank's bytes that cross a link: `(dispatch, combine)`.
    pub fn max_remote_bytes(&self) -> (u64, u64) {
        let n = self.rows.len();
        (
            (0..n)
                .map(|d| self.dispatch_remote_bytes(d))
                .max()
                .unwrap_or(0),
            (0..n)
                .map(|s| self.combine_remote_bytes(s))
                .max()
                .unwrap_or(0),
        )
    }

    /// `bytes / micros` in GB/s (10^9 bytes per second); 0 for a non-positive time.
    pub fn gbps(bytes: u64, micros: f64) -> f64 {
        if micros > 0.0 {
            bytes as f64 / micros / 1e3
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::fp8::Fp8Scales;

    #[test]
    fn rows_are_counted_once_per_destination_rank() {
        let shape = MoeShape {
            world: 2,
            experts: 4,
            top_k: 2,
            tokens: 3,
            hidden: 128,
            out_hidden: 64,
            capacity: 8,
            dtype: DType::BF16,
        };
        // Rank 0: token 0 -> e0, e1 (rank 0 twice), token 1 -> e1, e2 (both), token 2 -> e3, 9 (bad).
        // Rank 1: token 0 -> e2, e3, token 1 -> e3, e0, token 2 -> e0, e1.
        let idx = vec![vec![0, 1, 1, 2, 3, 9], vec![2, 3, 3, 0, 0, 1]];
        let m = MoeTraffic::from_routing(&shape, MoeWire::Native, &idx).unwrap();
        assert_eq!(m.rows, vec![vec![2, 2], vec![2, 2]]);
        assert_eq!(m.dispatch_row_bytes, 256);
        assert_eq!(m.combine_row_bytes, 128);
        assert_eq!(m.dispatch_bytes(0), 4 * 256);
        assert_eq!(m.dispatch_remote_bytes(0), 2 * 256);
        assert_eq!(m.combine_bytes(1), 4 * 128);
        assert_eq!(m.combine_remote_bytes(1), 2 * 128);
        assert_eq!(m.max_bytes(), (1024, 512));
        assert_eq!(m.max_remote_bytes(), (512, 256));
        let fp8 =
            MoeTraffic::from_routing(&shape, MoeWire::Fp8E4m3(Fp8Scales::Block128), &idx).unwrap();
        assert_eq!(fp8.dispatch_row_bytes, 128 + 4);
        assert_eq!(MoeTraffic::gbps(1_000_000, 10.0), 100.0);
        assert_eq!(MoeTraffic::gbps(5, 0.0), 0.0);
        assert!(MoeTraffic::from_routing(&shape, MoeWire::Native, &idx[..1]).is_err());
    }
}
