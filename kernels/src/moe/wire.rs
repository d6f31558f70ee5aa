//! What a dispatched token row looks like on the wire: its encoding ([`MoeWire`]) and the
//! byte layout of one wire row ([`WireLayout`]), shared by both transports and their kernels.

use super::{round_to, MoeShape};
use crate::error::{KernelError, Result};
use crate::fp8::{self, Fp8Scales};

/// How dispatch encodes a token row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MoeWire {
    /// The row as it is (the shape's dtype).
    #[default]
    Native,
    /// E4M3 codes with f32 scales ([`crate::fp8`]); the receiver dequantizes into `expert_x`
    /// (the shape's dtype). Needs `H % 16 == 0` (and `H % 128 == 0` for block scales).
    Fp8E4m3(Fp8Scales),
}

impl MoeWire {
    /// Short name (`native`, `fp8-token`, `fp8-block128`).
    pub fn name(self) -> &'static str {
        match self {
            MoeWire::Native => "native",
            MoeWire::Fp8E4m3(Fp8Scales::PerToken) => "fp8-token",
            MoeWire::Fp8E4m3(Fp8Scales::Block128) => "fp8-block128",
        }
    }

    /// The kernels' code for this encoding (`WIRE_*` in `moe.cu`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn code(self) -> u32 {
        match self {
            MoeWire::Native => 0,
            MoeWire::Fp8E4m3(Fp8Scales::PerToken) => 1,
            MoeWire::Fp8E4m3(Fp8Scales::Block128) => 2,
        }
    }

    /// Errors unless rows of `shape` can be encoded this way.
    pub fn validate(self, shape: &MoeShape) -> Result<()> {
        let MoeWire::Fp8E4m3(scales) = self else {
            return Ok(());
        };
        let h = shape.hidden;
        if !h.is_multiple_of(16) || scales.per_row(h).is_none() {
            return Err(KernelError::InvalidArgument(format!(
                "FP8 dispatch with {} scales needs a token width H divisible by {} (H = {h})",
                scales.name(),
                if scales == Fp8Scales::Block128 {
                    fp8::SCALE_BLOCK
                } else {
                    16
                }
            )));
        }
        Ok(())
    }

    /// The values a row of `x` (values of the shape's dtype) has once it arrived in
    /// `expert_x`: itself, or quantized, dequantized and rounded to the dtype.
    pub fn arrived_row(self, shape: &MoeShape, row: &[f32]) -> Result<Vec<f32>> {
        match self {
            MoeWire::Native => Ok(row.to_vec()),
            MoeWire::Fp8E4m3(scales) => {
                let bad = || {
                    KernelError::InvalidArgument(format!(
                        "FP8 dispatch: a row of {} values cannot have {} scales",
                        row.len(),
                        scales.name()
                    ))
                };
                let (codes, s) = fp8::quantize_row(row, scales).ok_or_else(bad)?;
                let v = fp8::dequantize_row(&codes, &s, scales).ok_or_else(bad)?;
                Ok(v.into_iter().map(|v| round_to(shape.dtype, v)).collect())
            }
        }
    }
}

/// Byte layout of one wire row (every offset and the stride are multiples of 16):
/// `[payload][scales: f32 × n][meta: token i32, topk_idx i32 × K, weights f32 × K]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLayout {
    /// Bytes of the payload: `H` elements of the dtype, or `H` E4M3 codes.
    pub payload_bytes: usize,
    /// f32 scales per row (0 for [`MoeWire::Native`]).
    pub scales: usize,
    /// Offset of the scales.
    pub scale_off: usize,
    /// Offset of the metadata.
    pub meta_off: usize,
    /// Bytes from one row to the next.
    pub stride: usize,
}

fn round16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

impl WireLayout {
    /// The layout of `shape`'s rows encoded as `wire`.
    pub fn of(shape: &MoeShape, wire: MoeWire) -> WireLayout {
        let (payload_bytes, scales) = match wire {
            MoeWire::Native => (shape.x_row_bytes(), 0),
            MoeWire::Fp8E4m3(s) => (shape.hidden, s.per_row(shape.hidden).unwrap_or(0)),
        };
        let scale_off = round16(payload_bytes);
        let meta_off = scale_off + round16(scales * 4);
        let stride = meta_off + round16((1 + 2 * shape.top_k) * 4);
        WireLayout {
            payload_bytes,
            scales,
            scale_off,
            meta_off,
            stride,
        }
    }

    /// The bytes of a row that carry the token (payload and scales, without metadata or
    /// padding): what traffic figures count, as DeepEP does.
    pub fn token_bytes(&self) -> usize {
        self.payload_bytes + 4 * self.scales
    }

    /// Offset of the `K` expert ids inside a row.
    pub fn idx_off(&self) -> usize {
        self.meta_off + 4
    }

    /// Offset of the `K` weights inside a row.
    pub fn weights_off(&self, top_k: usize) -> usize {
        self.meta_off + 4 + 4 * top_k
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn shape(hidden: usize, top_k: usize, dtype: DType) -> MoeShape {
        MoeShape {
            world: 2,
            experts: 16,
            top_k,
            tokens: 4,
            hidden,
            out_hidden: hidden,
            capacity: 8,
            dtype,
        }
    }

    #[test]
    fn layouts() {
        let s = shape(7168, 8, DType::BF16);
        let native = WireLayout::of(&s, MoeWire::Native);
        assert_eq!(
            native,
            WireLayout {
                payload_bytes: 14336,
                scales: 0,
                scale_off: 14336,
                meta_off: 14336,
                stride: 14336 + 80,
            }
        );
        assert_eq!(native.token_bytes(), 14336);
        assert_eq!(native.idx_off(), 14340);
        assert_eq!(native.weights_off(8), 14372);
        let block = WireLayout::of(&s, MoeWire::Fp8E4m3(Fp8Scales::Block128));
        assert_eq!(
            (block.scales, block.scale_off, block.meta_off),
            (56, 7168, 7392)
        );
        assert_eq!(block.stride, 7392 + 80);
        assert_eq!(block.token_bytes(), 7168 + 224);
        let token = WireLayout::of(&s, MoeWire::Fp8E4m3(Fp8Scales::PerToken));
        assert_eq!(
            (token.scales, token.meta_off, token.stride),
            (1, 7184, 7264)
        );
        // Odd widths pad every region to 16 bytes.
        let odd = WireLayout::of(&shape(5, 1, DType::F16), MoeWire::Native);
        assert_eq!((odd.payload_bytes, odd.meta_off, odd.stride), (10, 16, 32));
        for l in [native, block, token, odd] {
            assert!(l.scale_off % 16 == 0 && l.meta_off % 16 == 0 && l.stride % 16 == 0);
        }
    }

    #[test]
    fn fp8_needs_aligned_widths() {
        let fp8 = |s| MoeWire::Fp8E4m3(s);
        assert!(fp8(Fp8Scales::PerToken)
            .validate(&shape(48, 2, DType::BF16))
            .is_ok());
        assert!(fp8(Fp8Scales::PerToken)
            .validate(&shape(40, 2, DType::BF16))
            .is_err());
        assert!(fp8(Fp8Scales::Block128)
            .validate(&shape(48, 2, DType::BF16))
            .is_err());
        assert!(fp8(Fp8Scales::Block128)
            .validate(&shape(256, 2, DType::F32))
            .is_ok());
        assert!(MoeWire::Native.validate(&shape(5, 2, DType::F16)).is_ok());
    }

    #[test]
    fn arrived_rows_are_dequantized_and_rounded() {
        let s = shape(16, 1, DType::BF16);
        let row: Vec<f32> = (0..16).map(|i| round_to(s.dtype, i as f32 * 0.3)).collect();
        assert_eq!(MoeWire::Native.arrived_row(&s, &row).unwrap(), row);
        let got = MoeWire::Fp8E4m3(Fp8Scales::PerToken)
            .arrived_row(&s, &row)
            .unwrap();
        let (codes, sc) = fp8::quantize_row(&row, Fp8Scales::PerToken).unwrap();
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, round_to(s.dtype, fp8::e4m3_to_f32(codes[i]) * sc[0]));
        }
        assert_ne!(got, row, "FP8 loses precision");
    }
}
