//! Byte layouts of the transports' buffers, shared by the transports, their kernels and the
//! CPU model of the kernels in the tests: the NVLink symmetric allocation ([`SymLayout`]) and
//! the NCCL dispatch blocks ([`nccl_block_bytes`]).

use super::{MoeShape, MoeWire, WireLayout};

/// Bytes of the count header of an NCCL dispatch block.
pub(crate) const NCCL_HEADER: usize = 16;

/// Bytes of one NCCL dispatch block: the count header and `T` wire rows.
pub(crate) fn nccl_block_bytes(shape: &MoeShape, wire: MoeWire) -> usize {
    NCCL_HEADER + shape.tokens * WireLayout::of(shape, wire).stride
}

/// Byte offsets of the regions of the symmetric allocation (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SymLayout {
    /// `[W, T]` received wire rows (slot `[s][pos]` written by rank `s`).
    pub rows: usize,
    /// `[W]` i32 received row counts.
    pub counts: usize,
    /// `[W]` u32 dispatch flags, one per sender.
    pub dispatch_flags: usize,
    /// `[W, T]` combine partial rows (slot `[r][pos]` written by rank `r`).
    pub partials: usize,
    /// `[W]` u32 combine flags, one per sender.
    pub combine_flags: usize,
    /// `[W, T, K]` f32 weights (slot `[s]` written by rank `s`) when a combine brings them.
    pub weights: usize,
    /// `[W]` u32 weight flags.
    pub weight_flags: usize,
    /// `[W, T]` u32 per-token dispatch release flags of the fused kernels (slot `[s][t]`
    /// written by rank `s` once token `t`'s rows are in place).
    pub dispatch_token_flags: usize,
    /// `[W, T]` u32 per-chunk combine release flags of the fused kernels.
    pub combine_chunks: usize,
    pub total: usize,
}

impl SymLayout {
    pub(crate) fn of(shape: &MoeShape, wire: MoeWire) -> SymLayout {
        let (w, t, k) = (shape.world, shape.tokens, shape.top_k);
        let mut at = 0usize;
        let mut region = |bytes: usize| {
            let start = at;
            at = (at + bytes).div_ceil(256) * 256;
            start
        };
        SymLayout {
            rows: region(w * t * WireLayout::of(shape, wire).stride),
            counts: region(w * 4),
            dispatch_flags: region(w * 4),
            partials: region(w * t * shape.y_row_bytes()),
            combine_flags: region(w * 4),
            weights: region(w * t * k * 4),
            weight_flags: region(w * 4),
            dispatch_token_flags: region(w * t * 4),
            combine_chunks: region(w * t * 4),
            total: at.max(256),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::fp8::Fp8Scales;

    #[test]
    fn symmetric_layout_regions_are_aligned_and_disjoint() {
        let shape = MoeShape {
            world: 2,
            experts: 256,
            top_k: 8,
            tokens: 128,
            hidden: 7168,
            out_hidden: 7168,
            capacity: 32,
            dtype: DType::BF16,
        };
        for wire in [MoeWire::Native, MoeWire::Fp8E4m3(Fp8Scales::Block128)] {
            let l = SymLayout::of(&shape, wire);
            let stride = WireLayout::of(&shape, wire).stride;
            let regions = [
                (l.rows, 2 * 128 * stride),
                (l.counts, 8),
                (l.dispatch_flags, 8),
                (l.partials, 2 * 128 * 14336),
                (l.combine_flags, 8),
                (l.weights, 2 * 128 * 8 * 4),
                (l.weight_flags, 8),
                (l.dispatch_token_flags, 2 * 128 * 4),
                (l.combine_chunks, 2 * 128 * 4),
            ];
            let mut end = 0;
            for (off, bytes) in regions {
                assert_eq!(off % 256, 0);
                assert!(off >= end, "{l:?}");
                end = off + bytes;
            }
            assert!(l.total >= end && l.total.is_multiple_of(256));
            assert_eq!(nccl_block_bytes(&shape, wire), 16 + 128 * stride);
        }
    }
}
