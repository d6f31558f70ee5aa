//! FP8 dispatch of the reference: each token row quantized to E4M3 with f32 scales and
//! dequantized, exactly as the `meshflow_ir::moe` docs define it, written naively (the E4M3
//! value nearest to each quotient is found among the representable values) and sharing
//! nothing with the backends' FP8 code.

use meshflow_ir::{DType, Fp8Scales, MoeWire};

use super::dense::round_to;

/// The largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

/// Every non-negative finite E4M3 value, ascending: the subnormals `m · 2^-9` (`m` in 0..8),
/// then `(1 + m/8) · 2^(e-7)` for exponents 1..=15 (the top code, `e = 15, m = 7`, is NaN).
fn e4m3_values() -> Vec<f64> {
    let mut v: Vec<f64> = (0..8).map(|m| f64::from(m) / 512.0).collect();
    for e in 1..=15i32 {
        for m in 0..8 {
            if e == 15 && m == 7 {
                continue;
            }
            v.push((1.0 + f64::from(m) / 8.0) * 2f64.powi(e - 7));
        }
    }
    v
}

/// `q` rounded to E4M3: the nearest value (ties to the even code, i.e. the even index in
/// [`e4m3_values`]), saturating to ±448 (infinities too), NaN kept.
fn to_e4m3(values: &[f64], q: f32) -> f32 {
    if q.is_nan() {
        return q;
    }
    let a = f64::from(q.abs());
    let top = values.len() - 1;
    let mag = if a >= values[top] {
        values[top]
    } else {
        // values[i] <= a < values[i + 1]; both differences are exact (the two values are
        // within a factor of two of `a`, or the lower one is zero).
        let i = values.partition_point(|&v| v <= a) - 1;
        let (lo, hi) = (values[i], values[i + 1]);
        let (dl, dh) = (a - lo, hi - a);
        if dl < dh || (dl == dh && i % 2 == 0) {
            lo
        } else {
            hi
        }
    };
    (mag as f32).copysign(q)
}

/// One row after the wire: quantized per group and dequantized, rounded to `dtype`.
fn round_trip(values: &[f64], row: &[f64], group: usize, dtype: DType) -> Vec<f64> {
    let mut out = Vec::with_capacity(row.len());
    for g in row.chunks(group.max(1)) {
        let amax = g
            .iter()
            .map(|&v| v as f32)
            .filter(|v| v.is_finite())
            .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        for &v in g {
            let q = to_e4m3(values, v as f32 / scale);
            out.push(round_to(dtype, f64::from(q * scale)));
        }
    }
    out
}

/// `x` (`rows` rows of `h` values of type `dtype`) as the experts receive it over `wire`.
pub(crate) fn over_wire(x: &[f64], h: usize, wire: MoeWire, dtype: DType) -> Vec<f64> {
    let MoeWire::Fp8E4m3(scales) = wire else {
        return x.to_vec();
    };
    let group = match scales {
        Fp8Scales::PerToken => h,
        Fp8Scales::Block128 => meshflow_ir::moe::SCALE_BLOCK as usize,
    };
    let values = e4m3_values();
    x.chunks(h.max(1))
        .flat_map(|row| round_trip(&values, row, group, dtype))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_has_126_positive_finite_values_up_to_448() {
        let v = e4m3_values();
        assert_eq!(v.len(), 127);
        assert_eq!(v[1], 1.0 / 512.0);
        assert_eq!(v[8], 1.0 / 64.0);
        assert_eq!(v[126], 448.0);
        assert!(v.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn rounding_is_nearest_even_and_saturating() {
        let v = e4m3_values();
        assert_eq!(to_e4m3(&v, 1.0625), 1.0, "a tie goes to the even code");
        assert_eq!(to_e4m3(&v, 1.1875), 1.25, "a tie goes to the even code");
        assert_eq!(to_e4m3(&v, 1.07), 1.125);
        assert_eq!(to_e4m3(&v, -500.0), -448.0);
        assert_eq!(to_e4m3(&v, f32::INFINITY), 448.0);
        assert!(to_e4m3(&v, f32::NAN).is_nan());
        assert_eq!(
            to_e4m3(&v, 1.0 / 1024.0),
            0.0,
            "half the smallest subnormal: even"
        );
        assert_eq!(
            to_e4m3(&v, 3.0 / 1024.0),
            2.0 / 512.0,
            "1.5 subnormals: even"
        );
        assert!(to_e4m3(&v, -1e-30).is_sign_negative());
    }

    #[test]
    fn groups_scale_by_their_largest_value() {
        // amax 448: scale 1, so each value is just rounded to E4M3.
        let row = [1.07f64, -448.0, 0.5, 0.0];
        let fp8 = |s| MoeWire::Fp8E4m3(s);
        let got = over_wire(&row, 4, fp8(Fp8Scales::PerToken), DType::F32);
        assert_eq!(got, vec![1.125, -448.0, 0.5, 0.0]);
        // amax 224 in the second block of 128: scale 0.5, 1.07 / 0.5 = 2.14 -> 2.25 -> 1.125;
        // the first block's amax is 1.
        let mut wide = vec![0.0f64; 256];
        wide[0] = 1.0;
        wide[1] = 0.3;
        wide[128] = 224.0;
        wide[129] = 1.07;
        let got = over_wire(&wide, 256, fp8(Fp8Scales::Block128), DType::F32);
        assert_eq!((got[0], got[128], got[129]), (1.0, 224.0, 1.125));
        let s = 1.0f32 / 448.0;
        let want = f64::from(to_e4m3(&e4m3_values(), 0.3f32 / s) * s);
        assert_eq!(got[1], want);
        assert_eq!(
            over_wire(&row, 4, MoeWire::Native, DType::F32),
            row.to_vec()
        );
    }
}
