//! The reference's ops, written to be obviously right rather than fast: one loop nest per
//! op over full tensors, indices spelled out, floats accumulated in `f64` and rounded once
//! to the output's element type, integers in wrapping `i64`. Nothing here is shared with
//! the backends' kernels (`runtime::cpu_ops`), so a kernel bug cannot cancel out.
//!
//! Each op checks the shapes it is given before its loops, so every index is in range.
//! New ops follow the same pattern: a function from `&Dense` inputs and the declared output
//! type to a `Dense`, registered in [`run`].

use meshflow_ir::{DType, OpKind};

use super::dense::{numel, Dense};
use super::moe;

/// The declared type of an op output: element type and value shape.
pub(crate) type OutType = (DType, Vec<u64>);

/// Runs one (non-`custom`) level-1 op.
pub(crate) fn run(kind: &OpKind, ins: &[&Dense], outs: &[OutType]) -> Result<Vec<Dense>, String> {
    let input = |k: usize| {
        ins.get(k)
            .copied()
            .ok_or_else(|| format!("input #{k} is missing"))
    };
    let out = |k: usize| outs.get(k).ok_or_else(|| format!("output #{k} is missing"));
    let one = |d: Dense| Ok(vec![d]);
    match kind {
        OpKind::Set => one(convert(input(0)?, out(0)?, false)?),
        OpKind::Cast => one(convert(input(0)?, out(0)?, true)?),
        OpKind::Matmul => one(gemm(input(0)?, input(1)?, out(0)?, false)?),
        OpKind::Linear => one(gemm(input(0)?, input(1)?, out(0)?, true)?),
        OpKind::Add => one(binary(
            input(0)?,
            input(1)?,
            out(0)?,
            |a, b| a + b,
            i64::wrapping_add,
        )?),
        OpKind::Sub => one(binary(
            input(0)?,
            input(1)?,
            out(0)?,
            |a, b| a - b,
            i64::wrapping_sub,
        )?),
        OpKind::Mul => one(binary(
            input(0)?,
            input(1)?,
            out(0)?,
            |a, b| a * b,
            i64::wrapping_mul,
        )?),
        OpKind::Gelu => one(unary(input(0)?, out(0)?, gelu)?),
        OpKind::Silu => one(unary(input(0)?, out(0)?, silu)?),
        OpKind::Sum { axis } => one(sum(input(0)?, *axis, out(0)?)?),
        OpKind::GroupedMatmul => one(moe::grouped_matmul(
            input(0)?,
            input(1)?,
            input(2)?,
            out(0)?,
        )?),
        OpKind::MoeDispatch { wire } => moe::dispatch(input(0)?, input(1)?, *wire, outs),
        OpKind::MoeCombine => one(moe::combine(
            input(0)?,
            input(1)?,
            input(2)?,
            input(3)?,
            out(0)?,
        )?),
        OpKind::Custom(c) => Err(format!("custom kernel `{}` is not a built-in op", c.kernel)),
        other => Err(format!(
            "`{}` is evaluated by the reference's module for shape and row ops",
            other.name()
        )),
    }
}

/// True for the ops [`run`] evaluates (the others: `custom`, and the shape and row ops of
/// `runtime::reference_ops`).
pub(crate) fn handles(kind: &OpKind) -> bool {
    matches!(
        kind,
        OpKind::Set
            | OpKind::Cast
            | OpKind::Linear
            | OpKind::Add
            | OpKind::Sub
            | OpKind::Mul
            | OpKind::Gelu
            | OpKind::Silu
            | OpKind::Sum { .. }
            | OpKind::GroupedMatmul
            | OpKind::MoeDispatch { .. }
            | OpKind::MoeCombine
    )
}

/// Fails unless `got == want`.
pub(crate) fn same_shape(what: &str, got: &[u64], want: &[u64]) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} has shape {got:?}, expected {want:?}"))
    }
}

/// `set` (same number of elements, row-major) and `cast` (same shape): each element
/// converted to the output's type.
fn convert(x: &Dense, (dtype, shape): &OutType, same: bool) -> Result<Dense, String> {
    if same {
        same_shape("the output", shape, &x.shape)?;
    } else if numel(shape)? != numel(&x.shape)? {
        return Err(format!("cannot copy {:?} into {shape:?}", x.shape));
    }
    Ok(if dtype.is_float() {
        Dense::from_f64(*dtype, shape, x.floats())
    } else {
        Dense::from_i64(*dtype, shape, x.ints())
    })
}

/// `out[b, i, j] = sum_k a[b, i, k] * w(k, j)`, with `w(k, j) = b[j, k]` for `linear`,
/// `b[k, j]` for a 2-D `matmul` operand and `b[b, k, j]` for a batched one.
fn gemm(a: &Dense, b: &Dense, (dtype, shape): &OutType, linear: bool) -> Result<Dense, String> {
    let (sa, sb) = (&a.shape, &b.shape);
    if sa.len() < 2 || sb.len() < 2 {
        return Err(format!("operands {sa:?} and {sb:?} need at least 2 axes"));
    }
    let nb = sa.len() - 2;
    let (m, k) = (sa[nb], sa[nb + 1]);
    let batched = !linear && sb.len() > 2;
    let (kb, n) = if linear {
        (sb[1], sb[0])
    } else {
        (sb[sb.len() - 2], sb[sb.len() - 1])
    };
    if (linear && sb.len() != 2) || (batched && sb[..sb.len() - 2] != sa[..nb]) || kb != k {
        return Err(format!("operands {sa:?} and {sb:?} do not fit"));
    }
    let mut want = sa[..nb].to_vec();
    want.extend([m, n]);
    same_shape("the output", shape, &want)?;
    let batch = numel(&sa[..nb])?;
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let (av, bv) = (a.floats(), b.floats());
    let mut res = vec![0.0f64; numel(&want)?];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for kk in 0..k {
                    let x = av[(bi * m + i) * k + kk];
                    let w = if linear {
                        bv[j * k + kk]
                    } else if batched {
                        bv[(bi * k + kk) * n + j]
                    } else {
                        bv[kk * n + j]
                    };
                    acc += x * w;
                }
                res[(bi * m + i) * n + j] = acc;
            }
        }
    }
    Ok(Dense::from_f64(*dtype, shape, res))
}

/// `out[i] = f(a[i], b[i])` (floats) or `g(a[i], b[i])` (integers), all of one shape.
fn binary(
    a: &Dense,
    b: &Dense,
    (dtype, shape): &OutType,
    f: fn(f64, f64) -> f64,
    g: fn(i64, i64) -> i64,
) -> Result<Dense, String> {
    same_shape("the second input", &b.shape, &a.shape)?;
    same_shape("the output", shape, &a.shape)?;
    Ok(if dtype.is_float() {
        let (x, y) = (a.floats(), b.floats());
        let r = x.iter().zip(&y).map(|(&p, &q)| f(p, q)).collect();
        Dense::from_f64(*dtype, shape, r)
    } else {
        let (x, y) = (a.ints(), b.ints());
        let r = x.iter().zip(&y).map(|(&p, &q)| g(p, q)).collect();
        Dense::from_i64(*dtype, shape, r)
    })
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
fn gelu(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// SiLU: `x / (1 + e^-x)`.
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `out[i] = f(x[i])`.
fn unary(x: &Dense, (dtype, shape): &OutType, f: fn(f64) -> f64) -> Result<Dense, String> {
    same_shape("the output", shape, &x.shape)?;
    Ok(Dense::from_f64(
        *dtype,
        shape,
        x.floats().into_iter().map(f).collect(),
    ))
}

/// `out[o, i] = sum_j x[o, j, i]` with `j` running over `axis`.
fn sum(x: &Dense, axis: usize, (dtype, shape): &OutType) -> Result<Dense, String> {
    let s = &x.shape;
    if axis >= s.len() {
        return Err(format!("axis {axis} out of range for {s:?}"));
    }
    let mut want = s.clone();
    want.remove(axis);
    same_shape("the output", shape, &want)?;
    let outer = numel(&s[..axis])?;
    let n = s[axis] as usize;
    let inner = numel(&s[axis + 1..])?;
    if dtype.is_float() {
        let v = x.floats();
        let mut r = vec![0.0f64; outer * inner];
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = 0.0f64;
                for j in 0..n {
                    acc += v[(o * n + j) * inner + i];
                }
                r[o * inner + i] = acc;
            }
        }
        Ok(Dense::from_f64(*dtype, shape, r))
    } else {
        let v = x.ints();
        let mut r = vec![0i64; outer * inner];
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = 0i64;
                for j in 0..n {
                    acc = acc.wrapping_add(v[(o * n + j) * inner + i]);
                }
                r[o * inner + i] = acc;
            }
        }
        Ok(Dense::from_i64(*dtype, shape, r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(shape: &[u64], v: &[f64]) -> Dense {
        Dense::from_f64(DType::F32, shape, v.to_vec())
    }

    #[test]
    fn small_cases_by_hand() {
        let a = f32s(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
        let b = f32s(&[3, 2], &[1., 0., 0., 1., 1., 1.]);
        let out = run(&OpKind::Matmul, &[&a, &b], &[(DType::F32, vec![2, 2])]).unwrap();
        assert_eq!(out[0].floats(), vec![4., 5., 10., 11.]);
        let w = f32s(&[2, 3], &[1., 0., 0., 0., 0., 1.]);
        let out = run(&OpKind::Linear, &[&a, &w], &[(DType::F32, vec![2, 2])]).unwrap();
        assert_eq!(out[0].floats(), vec![1., 3., 4., 6.]);
        let s = run(&OpKind::Sum { axis: 0 }, &[&a], &[(DType::F32, vec![3])]).unwrap();
        assert_eq!(s[0].floats(), vec![5., 7., 9.]);
        let bad = run(&OpKind::Matmul, &[&a, &a], &[(DType::F32, vec![2, 2])]);
        assert!(bad.is_err());
        // bf16 output: every element is a bf16 value.
        let third = f32s(&[1], &[1.0 / 3.0]);
        let c = run(&OpKind::Cast, &[&third], &[(DType::BF16, vec![1])]).unwrap();
        assert_eq!(c[0].floats(), vec![0.333984375]);
    }
}
