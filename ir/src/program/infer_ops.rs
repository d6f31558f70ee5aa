//! Output types of `set` (partial placements), `matmul` (batch broadcasting), the shape ops,
//! the reductions `max`/`min`/`avg` and the row-wise ops `softmax`/`rms_norm`.

use super::infer::{err, shape_str};
use super::{Axis, InferError, OpKind, TensorType};

fn iters(shape: &[u64]) -> Vec<Axis> {
    shape.iter().map(|&e| Axis::iter(e)).collect()
}

fn value(dtype: crate::DType, shape: &[u64]) -> TensorType {
    TensorType {
        dtype,
        axes: iters(shape),
    }
}

/// `set(x)`: the value of `x`, or `x`'s full type (reduction axes included) when the output
/// is declared with reduction axes: a set between two partial placements. A set cannot create
/// reduction axes (Replicate -> Partial is refused, as in DTensor).
pub(super) fn set_type(
    kind: &OpKind,
    input: &TensorType,
    declared: Option<&&TensorType>,
) -> Result<TensorType, InferError> {
    match declared {
        Some(d) if d.axes.iter().any(|a| a.reduction) => {
            if d.axes == input.axes {
                Ok(TensorType {
                    dtype: input.dtype,
                    axes: input.axes.clone(),
                })
            } else {
                Err(err(
                    kind,
                    format!(
                        "the output is declared {d}, with reduction axes the input {input} does \
                         not hold in the same places; a set keeps partial results (same \
                         reduction axes) or reduces them (none), it cannot create them \
                         (Replicate -> Partial is refused, as in DTensor)"
                    ),
                ))
            }
        }
        _ => Ok(value(input.dtype, &input.value_shape())),
    }
}

/// `add`/`sub` of two tensors with the same reduction axes, or `mul` of one such tensor by a
/// tensor without reduction axes, declared with those reduction axes: the op on partial sums
/// keeps them partial (`sum_k a_k + sum_k b_k = sum_k (a_k + b_k)`, `(sum_k a_k) * b =
/// sum_k a_k * b`). Any other declared reduction axes are an error.
pub(super) fn partial_pointwise_type(
    kind: &OpKind,
    inputs: &[&TensorType],
    declared: &TensorType,
) -> Result<TensorType, InferError> {
    let (a, b) = (inputs[0], inputs[1]);
    let same = |t: &TensorType| t.axes == declared.axes;
    let plain = |t: &TensorType| !t.axes.iter().any(|x| x.reduction);
    let ok = match kind {
        OpKind::Add | OpKind::Sub => same(a) && same(b),
        OpKind::Mul => (same(a) && plain(b)) || (plain(a) && same(b)),
        _ => false,
    };
    if !ok {
        return Err(err(
            kind,
            format!(
                "the output is declared {declared} with reduction axes; `{}` keeps partial sums \
                 only for {} (inputs {a} and {b})",
                kind.name(),
                if *kind == OpKind::Mul {
                    "one input with exactly those reduction axes and one with none"
                } else {
                    "two inputs with exactly those reduction axes"
                }
            ),
        ));
    }
    Ok(TensorType {
        dtype: a.dtype,
        axes: declared.axes.clone(),
    })
}

/// The broadcast of two batch shapes, aligned from the last axis.
pub(super) fn broadcast(a: &[u64], b: &[u64]) -> Option<Vec<u64>> {
    let n = a.len().max(b.len());
    let at = |s: &[u64], k: usize| {
        let off = n - s.len();
        if k < off {
            1
        } else {
            s[k - off]
        }
    };
    (0..n)
        .map(|k| match (at(a, k), at(b, k)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// `matmul(a, b)` with torch.matmul batch broadcasting (both operands at least 2-D).
pub(super) fn matmul_type(
    kind: &OpKind,
    a: &TensorType,
    b: &TensorType,
) -> Result<Vec<TensorType>, InferError> {
    if !a.dtype.is_float() {
        return Err(err(
            kind,
            format!("the first input must be a float type, not {}", a.dtype),
        ));
    }
    if a.dtype != b.dtype {
        return Err(err(
            kind,
            format!("input dtypes differ: {} and {}", a.dtype, b.dtype),
        ));
    }
    let (va, vb) = (a.value_shape(), b.value_shape());
    for (v, what) in [(&va, "first"), (&vb, "second")] {
        if v.len() < 2 {
            return Err(err(
                kind,
                format!(
                    "the {what} input must have at least 2 axes, has shape {}",
                    shape_str(v)
                ),
            ));
        }
    }
    let (ba, m, k) = (&va[..va.len() - 2], va[va.len() - 2], va[va.len() - 1]);
    let (bb, kb, n) = (&vb[..vb.len() - 2], vb[vb.len() - 2], vb[vb.len() - 1]);
    if k != kb {
        return Err(err(
            kind,
            format!(
                "contraction extents differ: {} has K={k}, {} has K={kb}",
                shape_str(&va),
                shape_str(&vb)
            ),
        ));
    }
    let batch = broadcast(ba, bb).ok_or_else(|| {
        err(
            kind,
            format!(
                "batch axes {} and {} do not broadcast (aligned from the last batch axis, each \
                 pair must be equal or one of them 1)",
                shape_str(ba),
                shape_str(bb)
            ),
        )
    })?;
    let mut axes = iters(&batch);
    axes.extend([Axis::iter(m), Axis::iter(n), Axis::reduce(k)]);
    Ok(vec![TensorType {
        dtype: a.dtype,
        axes,
    }])
}

fn need_axis(kind: &OpKind, axis: usize, shape: &[u64]) -> Result<u64, InferError> {
    shape.get(axis).copied().ok_or_else(|| {
        err(
            kind,
            format!("axis {axis} is out of range for shape {}", shape_str(shape)),
        )
    })
}

fn need_float(kind: &OpKind, t: &TensorType, what: &str) -> Result<(), InferError> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(err(
            kind,
            format!("{what} must be a float type, not {}", t.dtype),
        ))
    }
}

fn declared_shape<'a>(
    kind: &OpKind,
    declared: &'a [&TensorType],
) -> Result<&'a TensorType, InferError> {
    let d = declared.first().ok_or_else(|| {
        err(
            kind,
            "the output shape comes from the declared output type, which is missing",
        )
    })?;
    if d.axes.iter().any(|a| a.reduction) {
        return Err(err(
            kind,
            format!("the output is declared {d}; a shape op's output has no reduction axes"),
        ));
    }
    Ok(d)
}

/// Output types of the shape ops, `max`/`min`/`avg`, `softmax` and `rms_norm` (arity checked
/// by the caller).
pub(super) fn infer(
    kind: &OpKind,
    inputs: &[&TensorType],
    declared: &[&TensorType],
) -> Result<Vec<TensorType>, InferError> {
    let Some(&x) = inputs.first() else {
        return Err(err(kind, "takes at least one input"));
    };
    let v = x.value_shape();
    let dtype = x.dtype;
    let out = match kind {
        OpKind::Max { axis } | OpKind::Min { axis } | OpKind::Avg { axis } => {
            need_float(kind, x, "the input")?;
            need_axis(kind, *axis, &v)?;
            let mut axes = iters(&v);
            axes[*axis].reduction = true;
            TensorType { dtype, axes }
        }
        OpKind::Reshape | OpKind::View => {
            let d = declared_shape(kind, declared)?;
            let want = d.value_shape();
            if super::view_groups::view_groups(&v, &want).is_none() {
                return Err(err(
                    kind,
                    format!(
                        "cannot reshape {} into {}: the element counts differ",
                        shape_str(&v),
                        shape_str(&want)
                    ),
                ));
            }
            value(dtype, &want)
        }
        OpKind::Permute { perm } => {
            let rank = v.len();
            let mut seen = vec![false; rank];
            let ok = perm.len() == rank
                && perm
                    .iter()
                    .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
            if !ok {
                return Err(err(
                    kind,
                    format!(
                        "perm {perm:?} is not a permutation of the {rank} axes of {}",
                        shape_str(&v)
                    ),
                ));
            }
            let shape: Vec<u64> = perm.iter().map(|&p| v[p]).collect();
            value(dtype, &shape)
        }
        OpKind::Expand => {
            let d = declared_shape(kind, declared)?;
            let want = d.value_shape();
            let off = want.len().checked_sub(v.len());
            let ok = off.is_some_and(|off| {
                v.iter()
                    .enumerate()
                    .all(|(k, &e)| e == 1 || e == want[k + off])
            });
            if !ok {
                return Err(err(
                    kind,
                    format!(
                        "cannot expand {} to {}: aligned from the last axis, every input axis \
                         must equal the output's or be 1",
                        shape_str(&v),
                        shape_str(&want)
                    ),
                ));
            }
            value(dtype, &want)
        }
        OpKind::Squeeze { axis } => {
            let e = need_axis(kind, *axis, &v)?;
            if e != 1 {
                return Err(err(
                    kind,
                    format!(
                        "axis {axis} of {} has extent {e}; only an axis of extent 1 can be \
                         squeezed",
                        shape_str(&v)
                    ),
                ));
            }
            let mut shape = v.clone();
            shape.remove(*axis);
            value(dtype, &shape)
        }
        OpKind::Unsqueeze { axis } => {
            if *axis > v.len() {
                return Err(err(
                    kind,
                    format!(
                        "axis {axis} is out of range for inserting into shape {} (at most {})",
                        shape_str(&v),
                        v.len()
                    ),
                ));
            }
            let mut shape = v.clone();
            shape.insert(*axis, 1);
            value(dtype, &shape)
        }
        OpKind::Slice { axis, start, end } => {
            let e = need_axis(kind, *axis, &v)?;
            if start >= end || *end > e {
                return Err(err(
                    kind,
                    format!(
                        "slice {start}..{end} of axis {axis} (extent {e}) is empty or out of \
                         range"
                    ),
                ));
            }
            let mut shape = v.clone();
            shape[*axis] = end - start;
            value(dtype, &shape)
        }
        OpKind::Select { axis, index } => {
            let e = need_axis(kind, *axis, &v)?;
            if *index >= e {
                return Err(err(
                    kind,
                    format!("index {index} is out of range for axis {axis} of extent {e}"),
                ));
            }
            let mut shape = v.clone();
            shape.remove(*axis);
            value(dtype, &shape)
        }
        OpKind::Cat { axis, .. } => {
            need_axis(kind, *axis, &v)?;
            let mut total = 0u64;
            for (j, t) in inputs.iter().enumerate() {
                let s = t.value_shape();
                if t.dtype != dtype {
                    return Err(err(
                        kind,
                        format!("input #{j} is {}, input #0 is {dtype}", t.dtype),
                    ));
                }
                let same_rest = s.len() == v.len()
                    && s.iter()
                        .zip(&v)
                        .enumerate()
                        .all(|(k, (a, b))| k == *axis || a == b);
                if !same_rest {
                    return Err(err(
                        kind,
                        format!(
                            "input #{j} has shape {} but input #0 has {}; they may differ only \
                             along axis {axis}",
                            shape_str(&s),
                            shape_str(&v)
                        ),
                    ));
                }
                total = total.checked_add(s[*axis]).ok_or_else(|| {
                    err(
                        kind,
                        format!("the concatenated extent of axis {axis} overflows"),
                    )
                })?;
            }
            let mut shape = v.clone();
            shape[*axis] = total;
            value(dtype, &shape)
        }
        OpKind::Softmax { axis } => {
            need_float(kind, x, "the input")?;
            need_axis(kind, *axis, &v)?;
            value(dtype, &v)
        }
        OpKind::RmsNorm { axis, .. } => {
            need_float(kind, x, "the input")?;
            let e = need_axis(kind, *axis, &v)?;
            let w = inputs[1];
            if w.dtype != dtype {
                return Err(err(
                    kind,
                    format!("the weight is {}, the input {dtype}", w.dtype),
                ));
            }
            if w.value_shape() != [e] {
                return Err(err(
                    kind,
                    format!(
                        "the weight must have shape [{e}] (the extent of axis {axis}), has {}",
                        shape_str(&w.value_shape())
                    ),
                ));
            }
            value(dtype, &v)
        }
        _ => return Err(err(kind, "not a shape, reduction or row-wise op")),
    };
    Ok(vec![out])
}
