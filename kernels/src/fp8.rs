//! FP8 E4M3 (the OCP "e4m3fn" format of DeepEP and pplx-garden dispatch) and the row
//! quantization of MoE dispatch. Pure Rust; the CUDA kernels (`kernels/cuda/moe.cu`,
//! `f32_to_e4m3` / `e4m3_to_f32`) implement the same integer arithmetic bit for bit.
//!
//! E4M3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; `S.1111.111` is
//! NaN; the largest finite value is 448 (`0x7E`), the smallest subnormal 2^-9 (`0x01`).
//! Conversion from f32 rounds to nearest, ties to even, and **saturates**: every finite value
//! of magnitude 448 or more and every infinity becomes ±448; NaN becomes `0x7F` (`0xFF` when
//! the sign bit is set).
//!
//! Quantization of one group of values `v` (a whole token row, or 128 consecutive channels of
//! it, see [`Fp8Scales`]): `a = max |v|` over the group's finite values (0 if none),
//! `scale = a / 448` (f32 division) when `a > 0`, else `1`; each code is
//! `e4m3(v / scale)` (f32 division). Dequantization is `f32(code) * scale` (one f32
//! multiplication), then rounded to the destination type.

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Channels per scale in [`Fp8Scales::Block128`] quantization.
pub const SCALE_BLOCK: usize = 128;

/// How FP8 dispatch scales a token row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Scales {
    /// One f32 scale per token row.
    PerToken,
    /// One f32 scale per 128 consecutive channels (the row width must be a multiple of 128).
    Block128,
}

impl Fp8Scales {
    /// Scales per row of `width` channels (`None` when `Block128` does not divide `width`).
    pub fn per_row(self, width: usize) -> Option<usize> {
        match self {
            Fp8Scales::PerToken => Some(1),
            Fp8Scales::Block128 => width
                .is_multiple_of(SCALE_BLOCK)
                .then_some(width / SCALE_BLOCK),
        }
    }

    /// Channels that share one scale in a row of `width` channels.
    pub fn group(self, width: usize) -> usize {
        match self {
            Fp8Scales::PerToken => width.max(1),
            Fp8Scales::Block128 => SCALE_BLOCK,
        }
    }

    /// Short name (`token`, `block128`).
    pub fn name(self) -> &'static str {
        match self {
            Fp8Scales::PerToken => "token",
            Fp8Scales::Block128 => "block128",
        }
    }
}

/// `v` as E4M3: round to nearest even, saturating to ±448, NaN to `0x7F | sign`.
pub fn f32_to_e4m3(v: f32) -> u8 {
    let u = v.to_bits();
    let sign = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7f;
    }
    if a >= 0x43e0_0000 {
        // |v| >= 448 (infinity included): saturate.
        return sign | 0x7e;
    }
    if a >= 0x3c80_0000 {
        // |v| >= 2^-6: a normal E4M3 value. Round the f32 mantissa to 3 bits (ties to even);
        // a carry moves into the exponent, which stays below 448's by the test above.
        let rounded = (a + 0x7_ffff + ((a >> 20) & 1)) >> 20;
        return sign | (rounded - (120 << 3)) as u8;
    }
    // Subnormal E4M3 (or zero): code = round(|v| * 2^9) with ties to even, at most 8 (the
    // smallest normal, 0x08). An f32 subnormal is far below 2^-10 and rounds to zero.
    let exp = (a >> 23) as i32;
    if exp == 0 {
        return sign;
    }
    let mant = (a & 0x7f_ffff) | 0x80_0000;
    // |v| * 2^9 = mant * 2^(exp - 127 - 23 + 9); shift = 141 - exp >= 21 here.
    let shift = 141 - exp;
    if shift > 24 {
        return sign;
    }
    let q = mant >> shift;
    let rem = mant & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let q = if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    };
    sign | q as u8
}

/// The value of E4M3 code `b` (exact in f32).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = (b >> 3) & 0xf;
    let m = b & 7;
    if e == 0xf && m == 7 {
        return f32::NAN.copysign(sign);
    }
    if e == 0 {
        return sign * (m as f32) * (1.0 / 512.0);
    }
    let bits = ((e as u32 + 120) << 23) | ((m as u32) << 20);
    sign * f32::from_bits(bits)
}

/// The scale of one group: `max |v| / 448` over its finite values, or 1 when that is 0.
pub fn group_scale(values: &[f32]) -> f32 {
    let amax = values
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantizes one row: returns its codes and its scales (see the module docs). `None` when
/// `scales` does not fit the row width.
pub fn quantize_row(row: &[f32], scales: Fp8Scales) -> Option<(Vec<u8>, Vec<f32>)> {
    let n = scales.per_row(row.len())?;
    if row.is_empty() {
        return Some((Vec::new(), vec![1.0; n]));
    }
    let group = scales.group(row.len());
    let mut codes = Vec::with_capacity(row.len());
    let mut out = Vec::with_capacity(n);
    for g in row.chunks(group) {
        let s = group_scale(g);
        out.push(s);
        codes.extend(g.iter().map(|v| f32_to_e4m3(v / s)));
    }
    Some((codes, out))
}

/// Dequantizes one row of `codes` with its `scales` into f32 (before rounding to the
/// destination type). `None` when the lengths do not fit.
pub fn dequantize_row(codes: &[u8], row_scales: &[f32], scales: Fp8Scales) -> Option<Vec<f32>> {
    if scales.per_row(codes.len())? != row_scales.len() {
        return None;
    }
    let group = scales.group(codes.len());
    Some(
        codes
            .iter()
            .enumerate()
            .map(|(i, &c)| e4m3_to_f32(c) * row_scales[i / group])
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite non-negative E4M3 value with its code, ascending.
    fn finite_codes() -> Vec<(u8, f64)> {
        (0u8..0x7f).map(|c| (c, e4m3_to_f32(c) as f64)).collect()
    }

    /// An independent oracle: the nearest finite code by exhaustive search, ties to the even
    /// code, saturating.
    fn nearest(v: f32) -> u8 {
        if v.is_nan() {
            return if v.is_sign_negative() { 0xff } else { 0x7f };
        }
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = (v as f64).abs();
        let codes = finite_codes();
        let mut best = (0u8, f64::INFINITY);
        for &(c, x) in &codes {
            let d = (x - a).abs();
            if d < best.1 || (d == best.1 && c & 1 == 0) {
                best = (c, d);
            }
        }
        sign | best.0
    }

    #[test]
    fn known_values() {
        let cases: &[(f32, u8)] = &[
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xb8),
            (0.5, 0x30),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (464.0, 0x7e),
            (500.0, 0x7e),
            (1e30, 0x7e),
            (f32::INFINITY, 0x7e),
            (f32::NEG_INFINITY, 0xfe),
            (240.0, 0x77),
            (0.1, 0x1d),
            (1.0 / 64.0, 0x08),
            (1.0 / 512.0, 0x01),
            (1.0 / 1024.0, 0x00),
            (3.0 / 1024.0, 0x02),
            (5.0 / 1024.0, 0x02),
            (7.0 / 1024.0, 0x04),
            (15.0 / 1024.0, 0x08),
            (1.0625, 0x38),
            (1.1875, 0x3a),
            (1e-30, 0x00),
            (f32::MIN_POSITIVE / 2.0, 0x00),
        ];
        for &(v, want) in cases {
            assert_eq!(f32_to_e4m3(v), want, "{v}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x1d), 0.1015625);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..=255 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                continue;
            }
            assert_eq!(f32_to_e4m3(v), c, "code {c:#x} = {v}");
        }
    }

    #[test]
    fn matches_exhaustive_nearest_even_on_midpoints_and_neighbours() {
        let codes = finite_codes();
        let mut probes = Vec::new();
        for w in codes.windows(2) {
            let (lo, hi) = (w[0].1 as f32, w[1].1 as f32);
            let mid = ((w[0].1 + w[1].1) / 2.0) as f32; // exact: codes have few bits
            for v in [lo, hi, mid, mid.next_up(), mid.next_down()] {
                probes.push(v);
                probes.push(-v);
            }
        }
        for v in [447.0f32, 448.0f32.next_up(), 463.9, 464.0, 464.1, 480.0] {
            probes.push(v);
            probes.push(-v);
        }
        for &v in &probes {
            assert_eq!(f32_to_e4m3(v), nearest(v), "{v:e} ({:#010x})", v.to_bits());
        }
    }

    #[test]
    fn matches_exhaustive_nearest_even_on_a_sweep_of_f32() {
        // Every 12289th f32 bit pattern (odd stride: the low mantissa bits vary).
        let mut bits = 0u32;
        let mut n = 0;
        while let Some(next) = bits.checked_add(12289) {
            let v = f32::from_bits(bits);
            assert_eq!(f32_to_e4m3(v), nearest(v), "{v:e} ({bits:#010x})");
            bits = next;
            n += 1;
        }
        assert!(n > 300_000);
    }

    #[test]
    fn row_quantization() {
        let row: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) * 0.37).collect();
        let (codes, s) = quantize_row(&row, Fp8Scales::PerToken).unwrap();
        assert_eq!(s, vec![155.0 * 0.37 / 448.0]);
        assert_eq!(codes.len(), 256);
        // The largest magnitude maps to ±448 exactly.
        assert_eq!(codes[255], 0x7e);
        let back = dequantize_row(&codes, &s, Fp8Scales::PerToken).unwrap();
        for (a, b) in row.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + s[0] / 64.0, "{a} vs {b}");
        }
        let (codes, s) = quantize_row(&row, Fp8Scales::Block128).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0], group_scale(&row[..128]));
        assert_eq!(codes[0], f32_to_e4m3(row[0] / s[0]));
        assert_eq!(codes[200], f32_to_e4m3(row[200] / s[1]));
        assert!(quantize_row(&row[..100], Fp8Scales::Block128).is_none());
        // An all-zero group has scale 1; non-finite values are ignored by the scale and
        // saturate (infinities) or stay NaN.
        let (codes, s) = quantize_row(&[0.0, 0.0], Fp8Scales::PerToken).unwrap();
        assert_eq!((codes, s), (vec![0, 0], vec![1.0]));
        let (codes, s) =
            quantize_row(&[f32::INFINITY, 2.0, f32::NAN], Fp8Scales::PerToken).unwrap();
        assert_eq!(s, vec![2.0 / 448.0]);
        assert_eq!(codes, vec![0x7e, 0x7e, 0x7f]);
        assert!(dequantize_row(&[1, 2], &[1.0, 1.0], Fp8Scales::PerToken).is_none());
    }
}
