//! MoE dispatch and combine: their semantics, bit for bit, and the wire format of dispatch.
//!
//! `moe_dispatch` and `moe_combine` (level 1: [`OpKind::MoeDispatch`] / [`OpKind::MoeCombine`];
//! host IR: [`InstKind::MoeDispatch`] / [`InstKind::MoeCombine`]) route tokens to experts and
//! back across an expert-parallel **team** of `W` members. Every backend (the CPU backend, the
//! GPU transports) computes exactly what this page says; the unsharded reference computes the
//! dispatch exactly and the combine in f64 (see [Combine](#combine)).
//!
//! ## Experts and ranks
//!
//! There are `E` experts, `E` a multiple of `W`; member `r` holds the `L = E / W` experts
//! `r·L ..= r·L + L - 1` (expert `e` lives on member `e / L` as local expert `e % L`). At level
//! 1, `W` is the number of device shards of the expert axis of `expert_x` / `expert_y` (1 when
//! that axis is not split); in the host IR it is the size of the op's team. Member `s` holds
//! `T` tokens; token `t` of member `s` is the team-global token `s·T + t`. Its expert ids are
//! `topk_idx[t, 0..K]` and its weights `topk_weights[t, 0..K]` (converted to f32). The
//! **destinations** of a token are the members hosting at least one of its experts.
//!
//! ## Dispatch
//!
//! A token travels **once to each destination** (not once per expert), encoded as the op's
//! [`MoeWire`]. On arrival the destination fans it out to its local experts: for every `k` (in
//! order) with `topk_idx[t, k]` on this member, local expert `topk_idx[t, k] % L` gets one row
//! holding the (dequantized) token, `routing = (s·T + t, k)`. `expert_counts[l]` is the number
//! of rows of local expert `l`; rows past it are padding (the CPU backend and the reference
//! write zeros there; GPU transports may leave other values, see their documentation). The
//! order of rows inside an expert is **unspecified** (the CPU backend and the reference use
//! ascending `(s, t, k)`): compare per-expert multisets. An expert receiving more rows than
//! its capacity `C` is an error on the CPU backend; GPU transports drop the extra rows and
//! report the overflow when the run finishes.
//!
//! ## Combine
//!
//! `expert_y` holds one output row per dispatched row (padding rows are never read). The
//! combine runs in two stages, each accumulating in f32 and rounding once:
//!
//! 1. **Per destination** `r` of token `(s, t)`, the member `r` reduces the weighted outputs
//!    of the token's experts it hosts, in ascending `k`:
//!    `P_r = ((0 + w[t, k₁]·y(t, k₁)) + w[t, k₂]·y(t, k₂)) + …` over the `k` with
//!    `topk_idx[t, k]` on `r`, each product and each sum a separately rounded f32 operation
//!    (no fused multiply-add), starting from +0. `P_r` is then **rounded once to the dtype of
//!    `expert_y`** (it travels back as one row per (token, destination)).
//! 2. **On the token's member**, `out[t] = (((0 + P_{r₁}) + P_{r₂}) + …)` over the token's
//!    destinations in **ascending member order** `r₁ < r₂ < …`, in f32 from +0, rounded once
//!    to the dtype of `out` (that of `expert_y`).
//!
//! With `W = 1` (or all of a token's experts on one member) this is `Σ_k w·y` in `k` order,
//! rounded once. A row dropped for capacity (GPU) contributes nothing to its `P_r`. Because
//! stage 1 rounds, the result depends on `W`, by at most the rounding of the dtype: the
//! unsharded reference sums `Σ_k w·y` in f64 and rounds once, and comparisons with it allow
//! the dtype's rounding.
//!
//! ## FP8 dispatch
//!
//! With [`MoeWire::Fp8E4m3`] each travelling token is quantized to E4M3 (1 sign, 4 exponent
//! bits with bias 7, 3 mantissa bits; largest finite value 448; no infinities). For each
//! group of values `v` (the whole row for [`Fp8Scales::PerToken`], each run of 128 channels
//! for [`Fp8Scales::Block128`]): `a = max |v|` over the group's finite values (0 if none),
//! `scale = a / 448` (an f32 division) when `a > 0`, else 1; each value becomes
//! `e4m3(v / scale)` (f32 division, then rounding to nearest, ties to even, saturating to ±448
//! — infinities included — with NaN kept as NaN). The receiver writes `expert_x = round(f32(q)
//! · scale)` (one f32 multiplication, rounded to the dtype of `x`). `expert_x` keeps the dtype
//! of `x`; only the wire carries FP8 (half the bytes of bf16, plus 4 bytes per scale). The
//! combine is unchanged (it moves `expert_y`'s dtype). FP8 needs the token width `H` to be a
//! multiple of 16, and of 128 for block scales.
//!
//! [`OpKind::MoeDispatch`]: crate::OpKind::MoeDispatch
//! [`OpKind::MoeCombine`]: crate::OpKind::MoeCombine
//! [`InstKind::MoeDispatch`]: crate::InstKind::MoeDispatch
//! [`InstKind::MoeCombine`]: crate::InstKind::MoeCombine

use std::fmt;

/// Channels per scale of [`Fp8Scales::Block128`].
pub const SCALE_BLOCK: u64 = 128;

/// How FP8 dispatch scales a token row (see the [module docs](self)).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fp8Scales {
    /// One f32 scale per token row (`scale=token`).
    PerToken,
    /// One f32 scale per 128 consecutive channels (`scale=block128`).
    Block128,
}

impl Fp8Scales {
    /// Both granularities.
    pub const ALL: [Fp8Scales; 2] = [Fp8Scales::PerToken, Fp8Scales::Block128];

    /// The name in the text format (`token`, `block128`).
    pub fn name(self) -> &'static str {
        match self {
            Fp8Scales::PerToken => "token",
            Fp8Scales::Block128 => "block128",
        }
    }

    /// The granularity named `name` in the text format.
    pub fn from_name(name: &str) -> Option<Fp8Scales> {
        Fp8Scales::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// How `moe_dispatch` encodes a travelling token (see the [module docs](self)).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum MoeWire {
    /// The token as it is (the dtype of `x`); the default, not printed.
    #[default]
    Native,
    /// E4M3 codes with f32 scales (`wire=f8e4m3, scale=token|block128`).
    Fp8E4m3(Fp8Scales),
}

impl MoeWire {
    /// Every encoding.
    pub const ALL: [MoeWire; 3] = [
        MoeWire::Native,
        MoeWire::Fp8E4m3(Fp8Scales::PerToken),
        MoeWire::Fp8E4m3(Fp8Scales::Block128),
    ];

    /// The name of the `wire=` attribute value (`native`, `f8e4m3`).
    pub fn name(self) -> &'static str {
        match self {
            MoeWire::Native => "native",
            MoeWire::Fp8E4m3(_) => "f8e4m3",
        }
    }

    /// Why a token width `h` cannot be encoded this way, if it cannot.
    pub fn width_error(self, h: u64) -> Option<String> {
        match self {
            MoeWire::Native => None,
            MoeWire::Fp8E4m3(scales) => {
                let need = if scales == Fp8Scales::Block128 {
                    SCALE_BLOCK
                } else {
                    16
                };
                (!h.is_multiple_of(need)).then(|| {
                    format!(
                        "FP8 dispatch with {} scales needs a token width divisible by {need}, \
                         the tokens have {h} channels",
                        scales.name()
                    )
                })
            }
        }
    }
}

impl fmt::Display for MoeWire {
    /// The attributes as printed after the operands (empty for [`MoeWire::Native`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MoeWire::Native => Ok(()),
            MoeWire::Fp8E4m3(s) => write!(f, "wire=f8e4m3, scale={}", s.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_widths() {
        assert_eq!(MoeWire::Native.to_string(), "");
        assert_eq!(
            MoeWire::Fp8E4m3(Fp8Scales::Block128).to_string(),
            "wire=f8e4m3, scale=block128"
        );
        for s in Fp8Scales::ALL {
            assert_eq!(Fp8Scales::from_name(s.name()), Some(s));
        }
        assert_eq!(Fp8Scales::from_name("tile"), None);
        assert!(MoeWire::Native.width_error(5).is_none());
        assert!(MoeWire::Fp8E4m3(Fp8Scales::PerToken)
            .width_error(48)
            .is_none());
        assert!(MoeWire::Fp8E4m3(Fp8Scales::PerToken)
            .width_error(40)
            .is_some());
        assert!(MoeWire::Fp8E4m3(Fp8Scales::Block128)
            .width_error(256)
            .is_none());
        let e = MoeWire::Fp8E4m3(Fp8Scales::Block128)
            .width_error(48)
            .unwrap();
        assert!(
            e.contains("divisible by 128") && e.contains("48 channels"),
            "{e}"
        );
    }
}
