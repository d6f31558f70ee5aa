//! MoE expert-parallel dispatch and combine (the host IR's `moe_dispatch` / `moe_combine`,
//! whose documentation in the `meshflow-ir` crate states the semantics these kernels implement
//! bit for bit).
//!
//! A team of `W` ranks holds `E` experts, `L = E / W` per rank; expert `e` lives on rank `e / L`
//! as local expert `e % L`. Every rank has `T` tokens `x[T, H]`, their top-k expert ids
//! `topk_idx[T, K]` (i32) and weights `w[T, K]` (f32).
//!
//! - **Dispatch** moves each token **once per destination rank** (a rank hosting at least one
//!   of its experts) as one *wire row* ([`WireLayout`]: the payload, FP8 scales if any, the
//!   token index, its `K` expert ids and, when given at dispatch, its `K` weights). On arrival
//!   the receiver fans the row out to its local experts: `expert_counts[L]` (i32),
//!   `expert_x[L, C, H]` and `routing[L, C, 2]` (i32: team-global token `src_rank * T + t`,
//!   and `k`). The row order inside an expert is unspecified (atomics); counts and the row
//!   multiset are exact. Rows past a count are padding (zeroed only on request,
//!   [`DispatchRequest::zero_padding`]). The outputs are the engine's own buffers, or the
//!   caller's ([`DispatchRequest::outputs`], written in place: no copy). `C` (the capacity) is a host-known upper bound: rows
//!   past it are dropped and [`MoeStatus::overflow`] is raised, never a memory corruption.
//!   With [`MoeWire::Fp8E4m3`] the payload is E4M3 codes plus f32 scales (per token or per 128
//!   channels, [`crate::fp8`]), dequantized into `expert_x` on arrival.
//! - **Combine** takes `expert_y[L, C, F]`. For every received token, the expert side reduces
//!   the weighted outputs of its local rows in `k` order (`P = Σ w[t, k] · y(t, k)` in f32,
//!   separate multiply and add, rounded once to the dtype) and sends **one row per (token,
//!   rank)** back; the token's rank sums the partials in ascending rank order in f32 and
//!   rounds once: `out[t] = Σ_r P_r(t)`. A `(t, k)` whose row was dropped contributes nothing.
//!   [`reference_combine`] computes exactly this.
//!
//! The weights travel with the dispatch ([`DispatchRequest::weights`], one pass) or are given
//! to the combine ([`CombineRequest::weights`]), which then first copies every rank's `[T, K]`
//! weights to every peer (one more exchange).
//!
//! Two engines implement [`MoeTransport`] (feature `cuda`); the GPU runtime runs them as its
//! MoE-over-NCCL and MoE-over-NVLink transports:
//! - [`NcclMoe`]: one kernel routes and packs the wire rows into per-destination blocks (a
//!   16-byte count header, then up to `T` rows), moved with one grouped send/recv per peer;
//!   one kernel fans out; the combine reduces into per-source blocks, one grouped send/recv,
//!   one kernel sums. No host reads of counts: blocks are sized by the bound `T` rows.
//! - [`NvlinkMoe`]: peer-mapped receive areas; one kernel per phase (dispatch send: route,
//!   stores into the receivers' areas, counts and release flags; dispatch receive: acquire,
//!   fan-out, counts; combine send: reduce, stores into the sources' areas, flags; combine
//!   receive: acquire, sum). The step number (epoch) lives on the device, so a step can be
//!   captured in a CUDA graph and replayed. Ranks live in one process ([`NvlinkMoe::team`])
//!   or in several (CUDA IPC: [`NvlinkMoe::new_ipc`], [`NvlinkMoe::export_handles`],
//!   [`NvlinkMoe::import_handles`]).
//!
//! Every method only enqueues work on the given stream: there is no GPU→CPU synchronization
//! and no allocation in dispatch or combine. The device-side status ([`MoeTransport::status`])
//! and the received row counts ([`MoeTransport::received_rows`]) are read separately, off the
//! hot path. [`MoeTraffic`] counts the bytes a step moves (deduplicated), for GB/s figures.
//!
//! **Protocol contract.** Each rank calls, per step and in this order, `dispatch_send`,
//! `dispatch_recv`, `combine_send`, `combine_recv` (the object checks the order), on streams of
//! its device that the caller keeps in this order (one stream is simplest; other work may run in
//! between). Every rank of the team takes part in every step. Reading `expert_x` (the expert
//! computation) must be ordered before this rank's `combine_send`, and reading `out` after
//! `combine_recv`: peers reuse the buffers in the next step, and the ordering chain
//! `combine_send(s)` → peers' `combine_recv(s)` → peers' `dispatch_send(s + 1)` is what makes
//! that safe without extra round trips.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod layout;
#[cfg(test)]
mod model;
mod reference;
mod traffic;
mod wire;

pub use reference::{reference_combine, reference_dispatch, round_to, ReferenceDispatch};
pub use traffic::MoeTraffic;
pub use wire::{MoeWire, WireLayout};

#[cfg(feature = "cuda")]
mod combine_block;
#[cfg(feature = "cuda")]
mod fused;
#[cfg(feature = "cuda")]
mod kernel_calls;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nvlink;
#[cfg(feature = "cuda")]
mod transport;

#[cfg(feature = "cuda")]
pub use combine_block::{CombineBlock, CombineShape, COMBINE_BLOCK_ENV};
#[cfg(feature = "cuda")]
pub use fused::{
    FusedCombineKernel, FusedDispatchKernel, FusedOptions, MoeKernels, FUSED_COMBINE_ENV,
    FUSED_DISPATCH_ENV, MOE_KERNELS_ENV,
};
#[cfg(feature = "cuda")]
pub use nccl::NcclMoe;
#[cfg(feature = "cuda")]
pub use nvlink::{NvlinkMoe, ABORT_POLL_ENV};
#[cfg(feature = "cuda")]
pub use transport::{CombineRequest, DispatchOutputs, DispatchRequest, MoeTransport};

use crate::dtype::DType;
use crate::error::{KernelError, Result};

/// The shape of one MoE layer on an expert-parallel team; identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Team size `W`.
    pub world: usize,
    /// Experts `E` (a multiple of `W`).
    pub experts: usize,
    /// Experts per token `K` (`1 ..= E`).
    pub top_k: usize,
    /// Tokens per rank `T` (may be 0).
    pub tokens: usize,
    /// Token width `H` (elements of `x` and `expert_x` rows).
    pub hidden: usize,
    /// Expert output width `F` (elements of `expert_y` and `out` rows).
    pub out_hidden: usize,
    /// Rows per local expert `C` (the host-known upper bound).
    pub capacity: usize,
    /// Element type of `x`, `expert_x`, `expert_y` and `out` (f32, bf16 or f16).
    pub dtype: DType,
}

impl MoeShape {
    /// Local experts per rank, `L = E / W`.
    pub fn local_experts(&self) -> usize {
        self.experts / self.world.max(1)
    }

    /// Bytes of one `x` / `expert_x` row.
    pub fn x_row_bytes(&self) -> usize {
        self.hidden * self.dtype.size_bytes()
    }

    /// Bytes of one `expert_y` / `out` row (and of one combine partial on the wire).
    pub fn y_row_bytes(&self) -> usize {
        self.out_hidden * self.dtype.size_bytes()
    }

    /// Checks the invariants (sizes, divisibility, dtype, index ranges that must fit in i32).
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(KernelError::InvalidArgument(format!(
                "MoE shape {self:?}: {why}"
            )))
        };
        if self.world == 0 {
            return bad("the team is empty".into());
        }
        if self.experts < self.world || !self.experts.is_multiple_of(self.world) {
            return bad(format!(
                "{} experts cannot be split evenly over {} ranks",
                self.experts, self.world
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!(
                "top-k {} is outside 1..={}",
                self.top_k, self.experts
            ));
        }
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return bad(format!("dtype {} is not a float type", self.dtype));
        }
        if self.hidden == 0 || self.out_hidden == 0 || self.capacity == 0 {
            return bad("hidden, out_hidden and capacity must be positive".into());
        }
        let limit = i32::MAX as usize;
        let fits = |v: Option<usize>| v.is_some_and(|v| v < limit);
        if !fits(
            self.world
                .checked_mul(self.tokens)
                .and_then(|v| v.checked_mul(self.top_k)),
        ) || !fits(self.local_experts().checked_mul(self.capacity))
            || !fits(self.hidden.checked_mul(8))
            || !fits(self.out_hidden.checked_mul(8))
        {
            return bad("row counts do not fit in i32".into());
        }
        Ok(())
    }
}

/// The device-side status word of a transport: sticky error bits raised by its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MoeStatus(pub u32);

impl MoeStatus {
    /// An expert received more than `C` rows; the extra rows were dropped.
    pub const OVERFLOW: u32 = 1;
    /// A `topk_idx` entry was not an expert id; it was skipped.
    pub const BAD_EXPERT: u32 = 2;
    /// A received row or count was out of range (a peer with another shape); it was skipped.
    pub const BAD_ROUTING: u32 = 4;
    /// A receiver gave up waiting for a peer's flag: it waited longer than the timeout, or
    /// [`Self::ABORTED`] (a dead or absent peer).
    pub const TIMEOUT: u32 = 8;
    /// The wait gave up because the host raised the engine's abort word (a peer known lost).
    pub const ABORTED: u32 = 16;
    /// A wait of a dispatch gave up.
    pub const GAVE_UP_DISPATCH: u32 = 32;
    /// A wait of a combine gave up.
    pub const GAVE_UP_COMBINE: u32 = 64;
    /// Bits `PEER_SHIFT..32` hold 1 + the team index of the first peer a wait gave up on
    /// (0: none recorded).
    pub const PEER_SHIFT: u32 = 16;

    /// Whether no bit is set.
    pub fn is_ok(self) -> bool {
        self.0 == 0
    }
    /// [`Self::OVERFLOW`] is set.
    pub fn overflow(self) -> bool {
        self.0 & Self::OVERFLOW != 0
    }
    /// [`Self::BAD_EXPERT`] is set.
    pub fn bad_expert(self) -> bool {
        self.0 & Self::BAD_EXPERT != 0
    }
    /// [`Self::BAD_ROUTING`] is set.
    pub fn bad_routing(self) -> bool {
        self.0 & Self::BAD_ROUTING != 0
    }
    /// [`Self::TIMEOUT`] is set.
    pub fn timeout(self) -> bool {
        self.0 & Self::TIMEOUT != 0
    }
    /// [`Self::ABORTED`] is set.
    pub fn aborted(self) -> bool {
        self.0 & Self::ABORTED != 0
    }
    /// The phase whose wait gave up first: `dispatch` or `combine` (both when both did).
    pub fn gave_up_in(self) -> Option<&'static str> {
        match (
            self.0 & Self::GAVE_UP_DISPATCH != 0,
            self.0 & Self::GAVE_UP_COMBINE != 0,
        ) {
            (true, false) => Some("dispatch"),
            (false, true) => Some("combine"),
            (true, true) => Some("dispatch and combine"),
            (false, false) => None,
        }
    }
    /// The team index of the first peer a wait gave up on.
    pub fn waited_for(self) -> Option<usize> {
        (self.0 >> Self::PEER_SHIFT)
            .checked_sub(1)
            .map(|p| p as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> MoeShape {
        MoeShape {
            world: 2,
            experts: 256,
            top_k: 8,
            tokens: 128,
            hidden: 7168,
            out_hidden: 7168,
            capacity: 32,
            dtype: DType::BF16,
        }
    }

    #[test]
    fn derived_sizes() {
        let s = shape();
        assert_eq!(s.local_experts(), 128);
        assert_eq!(s.x_row_bytes(), 14336);
        assert_eq!(s.y_row_bytes(), 14336);
        assert!(s.validate().is_ok());
    }

    #[test]
    fn invalid_shapes_are_errors() {
        let s = shape();
        for bad in [
            MoeShape { world: 0, ..s },
            MoeShape { experts: 255, ..s },
            MoeShape { experts: 1, ..s },
            MoeShape { top_k: 0, ..s },
            MoeShape { top_k: 257, ..s },
            MoeShape {
                dtype: DType::I32,
                ..s
            },
            MoeShape { capacity: 0, ..s },
            MoeShape {
                tokens: usize::MAX / 4,
                ..s
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn status_bits() {
        let s = MoeStatus(MoeStatus::OVERFLOW | MoeStatus::TIMEOUT);
        assert!(s.overflow() && s.timeout() && !s.bad_expert() && !s.bad_routing() && !s.is_ok());
        assert!(MoeStatus::default().is_ok());
        assert_eq!(
            (s.aborted(), s.gave_up_in(), s.waited_for()),
            (false, None, None)
        );
        let lost = MoeStatus(
            MoeStatus::TIMEOUT
                | MoeStatus::ABORTED
                | MoeStatus::GAVE_UP_COMBINE
                | (4 << MoeStatus::PEER_SHIFT),
        );
        assert!(lost.timeout() && lost.aborted() && !lost.overflow());
        assert_eq!(lost.gave_up_in(), Some("combine"));
        assert_eq!(lost.waited_for(), Some(3));
    }

    #[test]
    fn status_bits_match_the_kernels() {
        let src = include_str!("../../cuda/moe.cu");
        for (name, v) in [
            ("MOE_TIMEOUT", MoeStatus::TIMEOUT),
            ("MOE_ABORTED", MoeStatus::ABORTED),
            ("MOE_GAVE_UP_DISPATCH", MoeStatus::GAVE_UP_DISPATCH),
            ("MOE_GAVE_UP_COMBINE", MoeStatus::GAVE_UP_COMBINE),
        ] {
            let line = format!("#define {name} {v}u\n");
            assert!(src.contains(&line), "moe.cu must define {name} as {v}u");
        }
        let shift = format!("#define MOE_PEER_SHIFT {}\n", MoeStatus::PEER_SHIFT);
        assert!(src.contains(&shift), "moe.cu must define MOE_PEER_SHIFT");
    }
}
