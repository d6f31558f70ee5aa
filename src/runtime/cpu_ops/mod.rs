//! Numeric CPU kernels on strided views: the CPU backend's kernels (the level-1 reference
//! has its own, independent ones in `runtime::reference`).
//!
//! Floating-point kernels read their inputs as `f32`, accumulate in `f32` in a fixed order and
//! round once to the output's element type; integer kernels use `i64`. Every kernel checks
//! the shapes it is given and returns an [`OpError`] that names the problem.

mod layout;
mod moe;
mod moe_combine;
mod rows;

pub use layout::{cat, expand, slice};
#[cfg(feature = "cuda")]
pub(crate) use moe::kernel_scales;
pub use moe::{moe_dispatch, pack_dispatch, unpack_dispatch, Fp8Rows, MoeRows};
pub use moe_combine::{moe_combine, pack_combine, unpack_combine};
pub use rows::{reduce, rms_norm, softmax, Reduce};

use std::borrow::Cow;

use meshflow_ir::ComputeOp;

use super::view::{View, ViewError, ViewMut};

/// Why a kernel could not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// Operand shapes do not fit the op.
    #[error("{op}: {message}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A view problem (out of bounds, length mismatch).
    #[error("{op}: {source}")]
    View {
        /// The op.
        op: &'static str,
        /// The view error.
        source: ViewError,
    },
    /// More rows routed to an expert than its capacity.
    #[error("moe_dispatch: expert {expert} receives more than its capacity of {capacity} rows")]
    Capacity {
        /// The global expert id.
        expert: i64,
        /// The capacity.
        capacity: u64,
    },
    /// Invalid routing data (expert ids, token indices, counts).
    #[error("{op}: {message}")]
    Routing {
        /// The op.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
}

pub(crate) fn shape_err(op: &'static str, message: impl Into<String>) -> OpError {
    OpError::Shape {
        op,
        message: message.into(),
    }
}

pub(crate) fn view_err(op: &'static str) -> impl Fn(ViewError) -> OpError {
    move |source| OpError::View { op, source }
}

pub(crate) fn expect_shape(
    op: &'static str,
    what: &str,
    got: &[u64],
    want: &[u64],
) -> Result<(), OpError> {
    if got == want {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("{what} must have shape {want:?}, has {got:?}"),
        ))
    }
}

/// `out = a @ b` with `a[B.., M, K]` and `b[K, N]` or `b[B.., K, N]`, `out[B.., M, N]`.
pub fn matmul(a: &View<'_>, b: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    gemm("matmul", a, b, out, false, false)
}

/// `out = x @ w^T` with `x[B.., M, K]`, `w[N, K]`, `out[B.., M, N]`.
pub fn linear(x: &View<'_>, w: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    gemm("linear", x, w, out, true, false)
}

/// `out += x @ w^T` with `x[B.., M, K]`, `w[N, K]`, `out[B.., M, N]`: each element is
/// `round(out + s)`, `s` the `f32` sum of products in the order [`linear`] takes, the add in
/// `f32`, one rounding to the output's type.
pub fn linear_accumulate(x: &View<'_>, w: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    gemm("linear_accumulate", x, w, out, true, true)
}

fn gemm(
    op: &'static str,
    a: &View<'_>,
    b: &View<'_>,
    out: &mut ViewMut<'_>,
    transposed_b: bool,
    accumulate: bool,
) -> Result<(), OpError> {
    let (sa, sb) = (a.shape(), b.shape());
    if sa.len() < 2 || sb.len() < 2 {
        return Err(shape_err(
            op,
            format!("operands need at least 2 axes, have {sa:?} and {sb:?}"),
        ));
    }
    let nb = sa.len() - 2;
    let (m, k) = (sa[nb], sa[nb + 1]);
    let batch: u64 = sa[..nb].iter().product();
    let (kb, n, b_batched) = if transposed_b {
        if sb.len() != 2 {
            return Err(shape_err(op, format!("weight must be [N, K], has {sb:?}")));
        }
        (sb[1], sb[0], false)
    } else if sb.len() == 2 {
        (sb[0], sb[1], false)
    } else if sb[..sb.len() - 2] == sa[..nb] {
        (sb[sb.len() - 2], sb[sb.len() - 1], true)
    } else {
        return Err(shape_err(
            op,
            format!("batch axes differ: {sa:?} and {sb:?}"),
        ));
    };
    if k != kb {
        return Err(shape_err(
            op,
            format!("contraction extents differ: {sa:?} and {sb:?}"),
        ));
    }
    let mut want = sa[..nb].to_vec();
    want.extend([m, n]);
    expect_shape(op, "the output", out.shape(), &want)?;
    let (av, bv) = (a.to_f32(), b.to_f32());
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let mut res = vec![0f32; batch as usize * m * n];
    for bi in 0..batch as usize {
        let ab = &av[bi * m * k..(bi + 1) * m * k];
        let bb = if b_batched {
            &bv[bi * k * n..(bi + 1) * k * n]
        } else {
            &bv[..]
        };
        let rb = &mut res[bi * m * n..(bi + 1) * m * n];
        for i in 0..m {
            let arow = &ab[i * k..(i + 1) * k];
            let orow = &mut rb[i * n..(i + 1) * n];
            if transposed_b {
                for (j, o) in orow.iter_mut().enumerate() {
                    let wrow = &bb[j * k..(j + 1) * k];
                    *o = arow.iter().zip(wrow).fold(0f32, |acc, (x, w)| acc + x * w);
                }
            } else {
                for (kk, &x) in arow.iter().enumerate() {
                    let brow = &bb[kk * n..(kk + 1) * n];
                    for (o, &w) in orow.iter_mut().zip(brow) {
                        *o += x * w;
                    }
                }
            }
        }
    }
    if accumulate {
        for (r, acc) in res.iter_mut().zip(out.as_view().to_f32()) {
            *r += acc;
        }
    }
    out.assign_f32(&res).map_err(view_err(op))
}

/// An elementwise binary op.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
}

/// `out = a (op) b`, all three of the same shape.
pub fn binary(
    op: Binary,
    a: &View<'_>,
    b: &View<'_>,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    let name = match op {
        Binary::Add => "add",
        Binary::Sub => "sub",
        Binary::Mul => "mul",
    };
    expect_shape(name, "the second input", b.shape(), a.shape())?;
    expect_shape(name, "the output", out.shape(), a.shape())?;
    if out.dtype().is_float() {
        let (x, y) = (a.to_f32(), b.to_f32());
        let r: Vec<f32> = match op {
            Binary::Add => x.iter().zip(&y).map(|(p, q)| p + q).collect(),
            Binary::Sub => x.iter().zip(&y).map(|(p, q)| p - q).collect(),
            Binary::Mul => x.iter().zip(&y).map(|(p, q)| p * q).collect(),
        };
        out.assign_f32(&r).map_err(view_err(name))
    } else {
        let (x, y) = (a.to_i64(), b.to_i64());
        let r: Vec<i64> = match op {
            Binary::Add => x.iter().zip(&y).map(|(p, q)| p.wrapping_add(*q)).collect(),
            Binary::Sub => x.iter().zip(&y).map(|(p, q)| p.wrapping_sub(*q)).collect(),
            Binary::Mul => x.iter().zip(&y).map(|(p, q)| p.wrapping_mul(*q)).collect(),
        };
        out.assign_i64(&r).map_err(view_err(name))
    }
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_scalar(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
                                // 0.5 x (1 + tanh z) written as x / (1 + e^(-2z)): the same function, without the
                                // cancellation of 1 + tanh z in f32 for negative z (where the result is tiny).
    x / (1.0 + (-2.0 * C * (x + 0.044_715 * x * x * x)).exp())
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// An elementwise unary op.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Unary {
    /// [`gelu_scalar`].
    Gelu,
    /// [`silu_scalar`].
    Silu,
}

/// `out = f(x)`, same shapes.
pub fn unary(op: Unary, x: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    let (name, f): (&'static str, fn(f32) -> f32) = match op {
        Unary::Gelu => ("gelu", gelu_scalar),
        Unary::Silu => ("silu", silu_scalar),
    };
    expect_shape(name, "the output", out.shape(), x.shape())?;
    let r: Vec<f32> = x.to_f32().into_iter().map(f).collect();
    out.assign_f32(&r).map_err(view_err(name))
}

/// `out = sum of x over axis` (the axis removed), accumulated in `f32` (`i64` for integers)
/// in ascending index order.
pub fn sum(x: &View<'_>, axis: usize, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    let s = x.shape();
    if axis >= s.len() {
        return Err(shape_err(
            "sum",
            format!("axis {axis} out of range for {s:?}"),
        ));
    }
    let mut want = s.to_vec();
    want.remove(axis);
    expect_shape("sum", "the output", out.shape(), &want)?;
    let outer: u64 = s[..axis].iter().product();
    let (n, inner) = (
        s[axis] as usize,
        s[axis + 1..].iter().product::<u64>() as usize,
    );
    let outer = outer as usize;
    if out.dtype().is_float() {
        let v = x.to_f32();
        let mut r = vec![0f32; outer * inner];
        for o in 0..outer {
            for j in 0..n {
                let src = &v[(o * n + j) * inner..(o * n + j + 1) * inner];
                for (acc, &e) in r[o * inner..(o + 1) * inner].iter_mut().zip(src) {
                    *acc += e;
                }
            }
        }
        out.assign_f32(&r).map_err(view_err("sum"))
    } else {
        let v = x.to_i64();
        let mut r = vec![0i64; outer * inner];
        for o in 0..outer {
            for j in 0..n {
                let src = &v[(o * n + j) * inner..(o * n + j + 1) * inner];
                for (acc, &e) in r[o * inner..(o + 1) * inner].iter_mut().zip(src) {
                    *acc = acc.wrapping_add(e);
                }
            }
        }
        out.assign_i64(&r).map_err(view_err("sum"))
    }
}

/// `out = x` converted to the output's element type (same shape).
pub fn cast(x: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    expect_shape("cast", "the output", out.shape(), x.shape())?;
    out.copy_from(x).map_err(view_err("cast"))
}

/// `out = x` element by element in row-major order (same number of elements).
pub fn copy(x: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    out.copy_from(x).map_err(view_err("copy"))
}

/// `out = x` with axes permuted: output axis `k` is input axis `perm[k]`.
pub fn permute(x: &View<'_>, perm: &[usize], out: &mut ViewMut<'_>) -> Result<(), OpError> {
    let rank = x.shape().len();
    let mut seen = vec![false; rank];
    let ok = perm.len() == rank
        && perm
            .iter()
            .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
    if !ok {
        return Err(shape_err(
            "permute",
            format!(
                "{perm:?} is not a permutation of the {rank} axes of {:?}",
                x.shape()
            ),
        ));
    }
    let shape: Vec<u64> = perm.iter().map(|&p| x.shape()[p]).collect();
    let strides: Vec<u64> = perm.iter().map(|&p| x.strides()[p]).collect();
    expect_shape("permute", "the output", out.shape(), &shape)?;
    let pv = View::new(
        x.storage_ref(),
        x.offset(),
        Cow::Owned(shape),
        Cow::Owned(strides),
    )
    .map_err(view_err("permute"))?;
    out.copy_from(&pv).map_err(view_err("permute"))
}

/// `out[.., e, r, :] = expert_x[.., e, r, :] @ w[e]` for rows `r < counts[.., e]`, zero for
/// the rows past the count. `expert_x[B.., E, C, H]`, `counts[B.., E]`, `w[E, H, F]`,
/// `out[B.., E, C, F]`.
pub fn grouped_matmul(
    expert_x: &View<'_>,
    counts: &View<'_>,
    w: &View<'_>,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    const OP: &str = "grouped_matmul";
    let sx = expert_x.shape();
    if sx.len() < 3 {
        return Err(shape_err(
            OP,
            format!("expert_x must be [B.., E, C, H], has {sx:?}"),
        ));
    }
    let nb = sx.len() - 3;
    let (e, c, h) = (sx[nb], sx[nb + 1], sx[nb + 2]);
    let mut want = sx[..nb].to_vec();
    want.push(e);
    expect_shape(OP, "expert_counts", counts.shape(), &want)?;
    let sw = w.shape();
    if sw.len() != 3 || sw[0] != e || sw[1] != h {
        return Err(shape_err(
            OP,
            format!("weights must be [E={e}, H={h}, F], have {sw:?}"),
        ));
    }
    let f = sw[2];
    want.extend([c, f]);
    expect_shape(OP, "the output", out.shape(), &want)?;
    let (xv, cv, wv) = (expert_x.to_f32(), counts.to_i64(), w.to_f32());
    let (e, c, h, f) = (e as usize, c as usize, h as usize, f as usize);
    let mut res = vec![0f32; cv.len() * c * f];
    for (g, &count) in cv.iter().enumerate() {
        let ei = g % e.max(1);
        let valid = usize::try_from(count)
            .ok()
            .filter(|&n| n <= c)
            .ok_or_else(|| OpError::Routing {
                op: OP,
                message: format!("expert count {count} is outside 0..={c}"),
            })?;
        let wm = &wv[ei * h * f..(ei + 1) * h * f];
        for r in 0..valid {
            let xrow = &xv[(g * c + r) * h..(g * c + r + 1) * h];
            let orow = &mut res[(g * c + r) * f..(g * c + r + 1) * f];
            for (kk, &x) in xrow.iter().enumerate() {
                for (o, &wk) in orow.iter_mut().zip(&wm[kk * f..(kk + 1) * f]) {
                    *o += x * wk;
                }
            }
        }
    }
    out.assign_f32(&res).map_err(view_err(OP))
}

/// Runs one host compute op on views (used by the CPU backend).
pub fn run_compute(
    op: &ComputeOp,
    inputs: &[View<'_>],
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    let (want, _) = op.arity();
    if inputs.len() != want || inputs.is_empty() {
        return Err(shape_err(
            op.name(),
            format!("takes {want} inputs, got {}", inputs.len()),
        ));
    }
    match op {
        ComputeOp::Copy => copy(&inputs[0], out),
        ComputeOp::Matmul => matmul(&inputs[0], &inputs[1], out),
        ComputeOp::Linear => linear(&inputs[0], &inputs[1], out),
        ComputeOp::LinearAccumulate => linear_accumulate(&inputs[0], &inputs[1], out),
        ComputeOp::Add => binary(Binary::Add, &inputs[0], &inputs[1], out),
        ComputeOp::Sub => binary(Binary::Sub, &inputs[0], &inputs[1], out),
        ComputeOp::Mul => binary(Binary::Mul, &inputs[0], &inputs[1], out),
        ComputeOp::Gelu => unary(Unary::Gelu, &inputs[0], out),
        ComputeOp::Silu => unary(Unary::Silu, &inputs[0], out),
        ComputeOp::Sum { axis } => sum(&inputs[0], *axis, out),
        ComputeOp::Cast => cast(&inputs[0], out),
        ComputeOp::Permute { perm } => permute(&inputs[0], perm, out),
        ComputeOp::GroupedMatmul => grouped_matmul(&inputs[0], &inputs[1], &inputs[2], out),
        ComputeOp::Max { axis } => reduce(Reduce::Max, &inputs[0], *axis, out),
        ComputeOp::Min { axis } => reduce(Reduce::Min, &inputs[0], *axis, out),
        ComputeOp::Avg { axis } => reduce(Reduce::Avg, &inputs[0], *axis, out),
        ComputeOp::Softmax { axis } => softmax(&inputs[0], *axis, out),
        ComputeOp::RmsNorm { axis, eps } => {
            rms_norm(&inputs[0], &inputs[1], *axis, eps.value(), out)
        }
        ComputeOp::Expand => expand(&inputs[0], out),
        ComputeOp::Slice { axis, start } => slice(&inputs[0], *axis, *start, out),
        ComputeOp::Cat { axis, .. } => cat(inputs, *axis, out),
    }
}

#[cfg(test)]
mod tests;
