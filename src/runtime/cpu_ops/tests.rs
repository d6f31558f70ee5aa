//! Kernels against naive loops, on contiguous and strided views.

use std::borrow::Cow;

use meshflow_ir::{ComputeOp, DType, Fp8Scales, MoeWire};

use super::*;
use crate::runtime::data::{DataError, TensorData};
use crate::runtime::view::{View, ViewMut};

fn rnd(dtype: DType, shape: &[u64], seed: u64) -> TensorData {
    TensorData::random(dtype, shape, seed).unwrap()
}

fn f(t: &TensorData) -> Vec<f32> {
    t.storage().to_f32_vec()
}

fn zeros(dtype: DType, shape: &[u64]) -> TensorData {
    TensorData::zeros(dtype, shape).unwrap()
}

/// [`dispatch`] into fresh outputs for `l` experts of capacity `c`, rows of `h` elements,
/// made by `make` (`TensorData::poison` or `TensorData::zeros`): `expert_x[l, c, h]` of
/// `dtype`, `counts[l]` and `routing[l, c, 2]`, returned in that order.
fn dispatch_fresh(
    x: &TensorData,
    idx: &TensorData,
    wire: MoeWire,
    make: fn(DType, &[u64]) -> Result<TensorData, DataError>,
    dtype: DType,
    [l, c, h]: [u64; 3],
) -> (TensorData, TensorData, TensorData) {
    let mut ex = make(dtype, &[l, c, h]).unwrap();
    let mut counts = make(DType::I32, &[l]).unwrap();
    let mut routing = make(DType::I32, &[l, c, 2]).unwrap();
    dispatch(x, idx, wire, &mut ex, &mut counts, &mut routing).unwrap();
    (ex, counts, routing)
}

/// [`moe_dispatch`] of whole tensors.
fn dispatch(
    x: &TensorData,
    idx: &TensorData,
    wire: MoeWire,
    ex: &mut TensorData,
    counts: &mut TensorData,
    routing: &mut TensorData,
) -> Result<(), OpError> {
    moe_dispatch(
        &View::of(x),
        &View::of(idx),
        wire,
        &mut ViewMut::of(ex),
        &mut ViewMut::of(counts),
        &mut ViewMut::of(routing),
    )
}

/// [`moe_combine`] of whole tensors.
fn combine(
    y: &TensorData,
    counts: &TensorData,
    routing: &TensorData,
    weights: &TensorData,
    groups: u64,
    out: &mut TensorData,
) -> Result<(), OpError> {
    moe_combine(
        &View::of(y),
        &View::of(counts),
        &View::of(routing),
        &View::of(weights),
        groups,
        &mut ViewMut::of(out),
    )
}

#[test]
fn matmul_matches_naive_batched_and_broadcast() {
    let (b, m, k, n) = (2usize, 3usize, 5usize, 4usize);
    let a = rnd(DType::F32, &[2, 3, 5], 1);
    let w2 = rnd(DType::F32, &[5, 4], 2);
    let w3 = rnd(DType::F32, &[2, 5, 4], 3);
    for (w, batched) in [(&w2, false), (&w3, true)] {
        let mut out = zeros(DType::F32, &[2, 3, 4]);
        matmul(&View::of(&a), &View::of(w), &mut ViewMut::of(&mut out)).unwrap();
        let (av, wv) = (f(&a), f(w));
        let mut want = vec![0f32; b * m * n];
        for bi in 0..b {
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0f32;
                    for kk in 0..k {
                        let wi = if batched { bi * k * n } else { 0 } + kk * n + j;
                        acc += av[bi * m * k + i * k + kk] * wv[wi];
                    }
                    want[bi * m * n + i * n + j] = acc;
                }
            }
        }
        assert_eq!(f(&out), want);
    }
}

#[test]
fn linear_matches_naive_on_transposed_view_and_rounds_once() {
    // x is read through a transposed (strided) view of a [K, M] buffer.
    let (m, k, n) = (3usize, 6usize, 2usize);
    let xt = rnd(DType::BF16, &[6, 3], 4);
    let x = View::new(
        xt.storage(),
        0,
        Cow::Owned(vec![3, 6]),
        Cow::Owned(vec![1, 3]),
    )
    .unwrap();
    let w = rnd(DType::BF16, &[2, 6], 5);
    let mut out = zeros(DType::BF16, &[3, 2]);
    linear(&x, &View::of(&w), &mut ViewMut::of(&mut out)).unwrap();
    let (xv, wv) = (f(&xt), f(&w));
    let mut want = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for kk in 0..k {
                acc += xv[kk * m + i] * wv[j * k + kk];
            }
            want[i * n + j] = half::bf16::from_f32(acc).to_f32();
        }
    }
    assert_eq!(f(&out), want);
    let mut bad = zeros(DType::BF16, &[3, 3]);
    assert!(linear(&x, &View::of(&w), &mut ViewMut::of(&mut bad)).is_err());
}

#[test]
fn linear_accumulate_adds_onto_the_output_with_one_rounding() {
    let (m, k, n) = (5usize, 7usize, 3usize);
    let x = rnd(DType::BF16, &[5, 7], 11);
    let w = rnd(DType::BF16, &[3, 7], 12);
    let acc = rnd(DType::BF16, &[5, 3], 13);
    let mut out = acc.clone();
    run_compute(
        &ComputeOp::LinearAccumulate,
        &[View::of(&x), View::of(&w)],
        &mut ViewMut::of(&mut out),
    )
    .unwrap();
    let (xv, wv, av) = (f(&x), f(&w), f(&acc));
    let mut want = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for kk in 0..k {
                s += xv[i * k + kk] * wv[j * k + kk];
            }
            // One rounding of (acc + sum), not of each.
            want[i * n + j] = half::bf16::from_f32(av[i * n + j] + s).to_f32();
        }
    }
    assert_eq!(f(&out), want);
    // Onto zeros it is the plain linear.
    let mut from_zero = zeros(DType::BF16, &[5, 3]);
    let mut plain = zeros(DType::BF16, &[5, 3]);
    linear_accumulate(
        &View::of(&x),
        &View::of(&w),
        &mut ViewMut::of(&mut from_zero),
    )
    .unwrap();
    linear(&View::of(&x), &View::of(&w), &mut ViewMut::of(&mut plain)).unwrap();
    assert_eq!(f(&from_zero), f(&plain));
    let mut bad = zeros(DType::BF16, &[5, 4]);
    let e = linear_accumulate(&View::of(&x), &View::of(&w), &mut ViewMut::of(&mut bad));
    assert!(e.unwrap_err().to_string().contains("linear_accumulate"));
}

#[test]
fn elementwise_ops_match_naive() {
    let a = rnd(DType::F32, &[4, 5], 6);
    let b = rnd(DType::F32, &[4, 5], 7);
    for (op, g) in [
        (Binary::Add, (|x, y| x + y) as fn(f32, f32) -> f32),
        (Binary::Sub, |x, y| x - y),
        (Binary::Mul, |x, y| x * y),
    ] {
        let mut out = zeros(DType::F32, &[4, 5]);
        binary(op, &View::of(&a), &View::of(&b), &mut ViewMut::of(&mut out)).unwrap();
        let want: Vec<f32> = f(&a).iter().zip(f(&b)).map(|(&x, y)| g(x, y)).collect();
        assert_eq!(f(&out), want);
    }
    let ints = TensorData::from_i64(DType::I32, &[3], &[1, -2, 7]).unwrap();
    let mut out = zeros(DType::I32, &[3]);
    binary(
        Binary::Mul,
        &View::of(&ints),
        &View::of(&ints),
        &mut ViewMut::of(&mut out),
    )
    .unwrap();
    assert_eq!(out.storage().to_i64_vec(), vec![1, 4, 49]);
    for (op, g) in [
        (Unary::Gelu, gelu_scalar as fn(f32) -> f32),
        (Unary::Silu, silu_scalar),
    ] {
        let mut out = zeros(DType::F32, &[4, 5]);
        unary(op, &View::of(&a), &mut ViewMut::of(&mut out)).unwrap();
        assert_eq!(f(&out), f(&a).into_iter().map(g).collect::<Vec<_>>());
    }
    // Spot values of the formulas.
    assert!((gelu_scalar(1.0) - 0.841_192).abs() < 1e-5);
    assert!((silu_scalar(1.0) - 0.731_058_6).abs() < 1e-6);
    assert!(binary(
        Binary::Add,
        &View::of(&a),
        &View::of(&ints),
        &mut ViewMut::of(&mut zeros(DType::F32, &[4, 5]))
    )
    .is_err());
}

#[test]
fn sum_cast_copy_permute_match_naive() {
    let x = rnd(DType::F16, &[2, 3, 4], 8);
    let xv = f(&x);
    for axis in 0..3 {
        let mut shape = vec![2u64, 3, 4];
        shape.remove(axis);
        let mut out = zeros(DType::F32, &shape);
        sum(&View::of(&x), axis, &mut ViewMut::of(&mut out)).unwrap();
        let mut want = vec![0f32; 8 * 3 / [2, 3, 4][axis]];
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    let o = match axis {
                        0 => j * 4 + k,
                        1 => i * 4 + k,
                        _ => i * 3 + j,
                    };
                    want[o] += xv[i * 12 + j * 4 + k];
                }
            }
        }
        assert_eq!(f(&out), want, "axis {axis}");
    }
    let mut c = zeros(DType::F32, &[2, 3, 4]);
    cast(&View::of(&x), &mut ViewMut::of(&mut c)).unwrap();
    assert_eq!(f(&c), xv);
    let mut flat = zeros(DType::F16, &[24]);
    copy(&View::of(&x), &mut ViewMut::of(&mut flat)).unwrap();
    assert!(flat.storage() == x.storage());
    let mut p = zeros(DType::F16, &[4, 2, 3]);
    permute(&View::of(&x), &[2, 0, 1], &mut ViewMut::of(&mut p)).unwrap();
    let pv = f(&p);
    for i in 0..2 {
        for j in 0..3 {
            for k in 0..4 {
                assert_eq!(pv[k * 6 + i * 3 + j], xv[i * 12 + j * 4 + k]);
            }
        }
    }
    assert!(permute(&View::of(&x), &[0, 0, 1], &mut ViewMut::of(&mut p)).is_err());
}

#[test]
fn grouped_matmul_zeroes_rows_past_the_count() {
    let (e, c, h, fo) = (3usize, 4usize, 5usize, 2usize);
    let ex = rnd(DType::F32, &[3, 4, 5], 9);
    let counts = TensorData::from_i64(DType::I32, &[3], &[4, 0, 2]).unwrap();
    let w = rnd(DType::F32, &[3, 5, 2], 10);
    let mut out = TensorData::poison(DType::F32, &[3, 4, 2]).unwrap();
    grouped_matmul(
        &View::of(&ex),
        &View::of(&counts),
        &View::of(&w),
        &mut ViewMut::of(&mut out),
    )
    .unwrap();
    let (xv, wv) = (f(&ex), f(&w));
    let mut want = vec![0f32; e * c * fo];
    for (ei, &n) in [4usize, 0, 2].iter().enumerate() {
        for r in 0..n {
            for j in 0..fo {
                let mut acc = 0f32;
                for kk in 0..h {
                    acc += xv[(ei * c + r) * h + kk] * wv[(ei * h + kk) * fo + j];
                }
                want[(ei * c + r) * fo + j] = acc;
            }
        }
    }
    assert_eq!(f(&out), want);
    let too_many = TensorData::from_i64(DType::I32, &[3], &[5, 0, 0]).unwrap();
    assert!(grouped_matmul(
        &View::of(&ex),
        &View::of(&too_many),
        &View::of(&w),
        &mut ViewMut::of(&mut out)
    )
    .is_err());
}

#[test]
fn moe_dispatch_and_combine_reference_semantics() {
    // 4 tokens, top-2 over 3 experts, capacity 4.
    let x =
        TensorData::from_f32(DType::F32, &[4, 2], &[0., 1., 10., 11., 20., 21., 30., 31.]).unwrap();
    let idx = TensorData::from_i64(DType::I32, &[4, 2], &[2, 0, 0, 2, 2, 0, 0, 2]).unwrap();
    let (mut ex, mut counts, mut routing) = dispatch_fresh(
        &x,
        &idx,
        MoeWire::Native,
        TensorData::poison,
        DType::F32,
        [3, 4, 2],
    );
    assert_eq!(counts.storage().to_i64_vec(), vec![4, 0, 4]);
    // Expert 0 gets (0,1), (1,0), (2,1), (3,0) in ascending (t, k) order.
    assert_eq!(
        routing.storage().to_i64_vec()[..8],
        [0, 1, 1, 0, 2, 1, 3, 0]
    );
    assert_eq!(f(&ex)[..8], [0., 1., 10., 11., 20., 21., 30., 31.]);
    // Expert 1 receives nothing: zero padding.
    assert!(f(&ex)[8..16].iter().all(|&v| v == 0.0));
    // Combine with y = 2 x (as if the expert doubled its rows).
    let y = TensorData::from_f32(
        DType::F32,
        &[3, 4, 2],
        &f(&ex).iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
    )
    .unwrap();
    let w = TensorData::from_f32(
        DType::F32,
        &[4, 2],
        &[0.5, 0.25, 1., 1., 0.1, 0.2, 0.3, 0.4],
    )
    .unwrap();
    let mut out = TensorData::poison(DType::F32, &[4, 2]).unwrap();
    combine(&y, &counts, &routing, &w, 1, &mut out).unwrap();
    let xv = f(&x);
    let wv = f(&w);
    let want: Vec<f32> = (0..4)
        .flat_map(|t| {
            let (xv, wv) = (&xv, &wv);
            (0..2).map(move |j| {
                let mut acc = 0f32;
                for k in 0..2 {
                    acc += wv[t * 2 + k] * (2.0 * xv[t * 2 + j]);
                }
                acc
            })
        })
        .collect();
    assert_eq!(f(&out), want);
    // Capacity overflow names the expert.
    let mut small = TensorData::zeros(DType::F32, &[3, 3, 2]).unwrap();
    let mut r3 = TensorData::zeros(DType::I32, &[3, 3, 2]).unwrap();
    let err = dispatch(&x, &idx, MoeWire::Native, &mut small, &mut counts, &mut r3).unwrap_err();
    assert_eq!(
        err,
        OpError::Capacity {
            expert: 0,
            capacity: 3
        }
    );
    // Invalid expert ids are rejected.
    let bad = TensorData::from_i64(DType::I32, &[4, 2], &[3, 0, 0, 2, 2, 0, 0, 2]).unwrap();
    assert!(dispatch(
        &x,
        &bad,
        MoeWire::Native,
        &mut ex,
        &mut counts,
        &mut routing
    )
    .is_err());
}

#[test]
fn moe_fp8_dispatch_quantizes_each_token_once_and_combine_sums_groups_in_order() {
    use meshflow_kernels::fp8;
    // 2 tokens of 128 channels (bf16), 4 experts, top-3.
    let xv: Vec<f32> = (0..256)
        .map(|i| half::bf16::from_f32((i as f32 - 90.0) * 0.173).to_f32())
        .collect();
    let x = TensorData::from_f32(DType::BF16, &[2, 128], &xv).unwrap();
    let idx = TensorData::from_i64(DType::I32, &[2, 3], &[3, 0, 1, 2, 3, 0]).unwrap();
    for scales in Fp8Scales::ALL {
        let (ex, counts, _routing) = dispatch_fresh(
            &x,
            &idx,
            MoeWire::Fp8E4m3(scales),
            TensorData::poison,
            DType::BF16,
            [4, 2, 128],
        );
        let ks = match scales {
            Fp8Scales::PerToken => fp8::Fp8Scales::PerToken,
            Fp8Scales::Block128 => fp8::Fp8Scales::Block128,
        };
        let (codes, sc) = fp8::quantize_row(&xv[..128], ks).unwrap();
        let want: Vec<f32> = fp8::dequantize_row(&codes, &sc, ks)
            .unwrap()
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        // Token 0 went to experts 3, 0 and 1: the same dequantized row in each.
        let got = f(&ex);
        assert_eq!(&got[..128], &want[..]);
        assert_eq!(&got[256..384], &want[..]);
        assert_eq!(&got[3 * 256..3 * 256 + 128], &want[..]);
        assert_ne!(&got[..128], &xv[..128], "FP8 changes the values");
        assert_eq!(counts.storage().to_i64_vec(), vec![2, 1, 1, 2]);
    }
    // Combine over 2 groups of 2 experts: token 0 has experts 3 (group 1), 0 and 1 (group 0).
    let (ex, mut counts, mut routing) = dispatch_fresh(
        &x,
        &idx,
        MoeWire::Native,
        TensorData::zeros,
        DType::BF16,
        [4, 2, 128],
    );
    let w = TensorData::from_f32(DType::F32, &[2, 3], &[0.3, 0.7, 1.1, 0.9, 0.45, 0.2]).unwrap();
    let wv = f(&w);
    let r = |v: f32| half::bf16::from_f32(v).to_f32();
    for groups in [1u64, 2, 4] {
        let mut out = TensorData::poison(DType::BF16, &[2, 128]).unwrap();
        combine(&ex, &counts, &routing, &w, groups, &mut out).unwrap();
        let per = 4 / groups as usize;
        for t in 0..2 {
            let e = &idx.storage().to_i64_vec()[t * 3..t * 3 + 3];
            for c in [0usize, 17, 127] {
                let xval = xv[t * 128 + c];
                let mut acc = 0f32;
                for g in 0..groups as usize {
                    let mut p = 0f32;
                    let mut any = false;
                    for k in 0..3 {
                        if e[k] as usize / per == g {
                            p += wv[t * 3 + k] * xval;
                            any = true;
                        }
                    }
                    if any {
                        acc += r(p);
                    }
                }
                assert_eq!(
                    f(&out)[t * 128 + c].to_bits(),
                    r(acc).to_bits(),
                    "groups {groups}"
                );
            }
        }
    }
    // Experts that cannot be split over the groups are an error.
    let mut out = TensorData::zeros(DType::BF16, &[2, 128]).unwrap();
    assert!(combine(&ex, &counts, &routing, &w, 3, &mut out).is_err());
    // FP8 needs a width the scales divide.
    let narrow = TensorData::zeros(DType::BF16, &[2, 40]).unwrap();
    let mut ex = TensorData::zeros(DType::BF16, &[4, 2, 40]).unwrap();
    let err = dispatch(
        &narrow,
        &idx,
        MoeWire::Fp8E4m3(Fp8Scales::PerToken),
        &mut ex,
        &mut counts,
        &mut routing,
    )
    .unwrap_err();
    assert!(err.to_string().contains("divisible by 16"), "{err}");
}

#[test]
fn run_compute_dispatches_every_op() {
    let a = rnd(DType::F32, &[2, 2], 11);
    let mut out = zeros(DType::F32, &[2, 2]);
    run_compute(
        &ComputeOp::Add,
        &[View::of(&a), View::of(&a)],
        &mut ViewMut::of(&mut out),
    )
    .unwrap();
    assert_eq!(f(&out), f(&a).iter().map(|v| v + v).collect::<Vec<_>>());
    assert!(run_compute(&ComputeOp::Add, &[View::of(&a)], &mut ViewMut::of(&mut out)).is_err());
}

/// The f32 GELU keeps its relative accuracy in the negative tail, where `1 + tanh z` would
/// cancel (the f64 tanh form is the reference).
#[test]
fn gelu_is_accurate_in_the_negative_tail() {
    for x in [
        -9.0f32, -6.0, -4.0, -2.5, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0, 8.0,
    ] {
        let xd = f64::from(x);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let want = 0.5 * xd * (1.0 + (c * (xd + 0.044715 * xd * xd * xd)).tanh());
        let got = f64::from(super::gelu_scalar(x));
        let err = if want == 0.0 {
            got.abs()
        } else {
            ((got - want) / want).abs()
        };
        assert!(
            err < 1e-5,
            "gelu({x}) = {got}, want {want} (rel err {err:.2e})"
        );
    }
}
