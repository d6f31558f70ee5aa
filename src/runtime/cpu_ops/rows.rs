//! Kernels along one axis: `max`, `min` and `avg` reductions, `softmax` and `rms_norm`.
//!
//! The input is read as `f32` and viewed as `[outer, n, inner]` around the axis; each of the
//! `outer * inner` rows is processed in ascending index order with `f32` arithmetic and the
//! result rounded once to the output's element type.

use super::{expect_shape, shape_err, view_err, OpError};
use crate::runtime::view::{View, ViewMut};

/// `(outer, n, inner)` of `shape` around `axis`.
fn split_at(
    op: &'static str,
    shape: &[u64],
    axis: usize,
) -> Result<(usize, usize, usize), OpError> {
    let n = *shape
        .get(axis)
        .ok_or_else(|| shape_err(op, format!("axis {axis} out of range for {shape:?}")))?;
    let outer: u64 = shape[..axis].iter().product();
    let inner: u64 = shape[axis + 1..].iter().product();
    Ok((outer as usize, n as usize, inner as usize))
}

fn need_float(op: &'static str, x: &View<'_>, out: &ViewMut<'_>) -> Result<(), OpError> {
    if x.dtype().is_float() && out.dtype().is_float() {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("needs float tensors, has {} -> {}", x.dtype(), out.dtype()),
        ))
    }
}

/// A reduction over one axis.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Mean.
    Avg,
}

/// `out = reduce(x) over axis` (the axis removed).
pub fn reduce(op: Reduce, x: &View<'_>, axis: usize, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    let name = match op {
        Reduce::Max => "max",
        Reduce::Min => "min",
        Reduce::Avg => "avg",
    };
    need_float(name, x, out)?;
    let (outer, n, inner) = split_at(name, x.shape(), axis)?;
    let mut want = x.shape().to_vec();
    want.remove(axis);
    expect_shape(name, "the output", out.shape(), &want)?;
    let v = x.to_f32();
    let mut r = vec![0f32; outer * inner];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| v[(o * n + k) * inner + i];
            let mut acc = match op {
                Reduce::Max => f32::NEG_INFINITY,
                Reduce::Min => f32::INFINITY,
                Reduce::Avg => 0.0,
            };
            for k in 0..n {
                acc = match op {
                    Reduce::Max => acc.max(at(k)),
                    Reduce::Min => acc.min(at(k)),
                    Reduce::Avg => acc + at(k),
                };
            }
            if op == Reduce::Avg && n > 0 {
                acc /= n as f32;
            }
            r[o * inner + i] = acc;
        }
    }
    out.assign_f32(&r).map_err(view_err(name))
}

/// `out = softmax(x)` along `axis` (max-subtracted).
pub fn softmax(x: &View<'_>, axis: usize, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    const OP: &str = "softmax";
    need_float(OP, x, out)?;
    let (outer, n, inner) = split_at(OP, x.shape(), axis)?;
    expect_shape(OP, "the output", out.shape(), x.shape())?;
    let v = x.to_f32();
    let mut r = vec![0f32; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |k: usize| (o * n + k) * inner + i;
            let max = (0..n).fold(f32::NEG_INFINITY, |m, k| m.max(v[idx(k)]));
            let mut sum = 0f32;
            for k in 0..n {
                let e = (v[idx(k)] - max).exp();
                r[idx(k)] = e;
                sum += e;
            }
            for k in 0..n {
                r[idx(k)] /= sum;
            }
        }
    }
    out.assign_f32(&r).map_err(view_err(OP))
}

/// `out = x / sqrt(mean(x^2) + eps) * w` along `axis`, `w` of shape `[extent of axis]`.
pub fn rms_norm(
    x: &View<'_>,
    w: &View<'_>,
    axis: usize,
    eps: f32,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    const OP: &str = "rms_norm";
    need_float(OP, x, out)?;
    let (outer, n, inner) = split_at(OP, x.shape(), axis)?;
    expect_shape(OP, "the weight", w.shape(), &[n as u64])?;
    expect_shape(OP, "the output", out.shape(), x.shape())?;
    let (v, wv) = (x.to_f32(), w.to_f32());
    let mut r = vec![0f32; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |k: usize| (o * n + k) * inner + i;
            let ms = (0..n).fold(0f32, |acc, k| acc + v[idx(k)] * v[idx(k)]) / n.max(1) as f32;
            let scale = 1.0 / (ms + eps).sqrt();
            for k in 0..n {
                r[idx(k)] = v[idx(k)] * scale * wv[k];
            }
        }
    }
    out.assign_f32(&r).map_err(view_err(OP))
}
