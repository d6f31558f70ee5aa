//! Shape and dtype rules of the host compute ops for reductions other than `sum`, the layout
//! ops `expand`, `slice` and `cat`, and the row-wise `softmax` and `rms_norm`.

use crate::host::{ComputeOp, HostTensor};

fn shape_str(s: &[u64]) -> String {
    format!("{s:?}")
}

fn same_dtype(a: &HostTensor, b: &HostTensor) -> Option<String> {
    (a.dtype != b.dtype).then(|| {
        format!(
            "dtypes differ: `{}` is {} but `{}` is {}",
            a.name, a.dtype, b.name, b.dtype
        )
    })
}

fn need_float(t: &HostTensor) -> Option<String> {
    (!t.dtype.is_float()).then(|| format!("`{}` must have a float dtype, not {}", t.name, t.dtype))
}

fn out_shape(out: &HostTensor, want: &[u64]) -> Option<String> {
    (out.shape != want).then(|| {
        format!(
            "output `{}` must have shape {}, has {}",
            out.name,
            shape_str(want),
            shape_str(&out.shape)
        )
    })
}

fn axis_of(t: &HostTensor, axis: usize) -> Result<u64, String> {
    t.shape.get(axis).copied().ok_or_else(|| {
        format!(
            "axis {axis} is out of range for `{}` of shape {}",
            t.name,
            shape_str(&t.shape)
        )
    })
}

/// What is wrong with `op(ins -> out)` for the ops of this module, if anything (arity
/// already checked; `ins` is not empty).
pub(super) fn problem(op: &ComputeOp, ins: &[HostTensor], out: &HostTensor) -> Option<String> {
    let a = ins.first()?;
    let first = |r: Result<Option<String>, String>| r.unwrap_or_else(Some);
    match op {
        ComputeOp::Max { axis } | ComputeOp::Min { axis } | ComputeOp::Avg { axis } => {
            need_float(a).or_else(|| same_dtype(a, out)).or_else(|| {
                first(axis_of(a, *axis).map(|_| {
                    let mut want = a.shape.clone();
                    want.remove(*axis);
                    out_shape(out, &want)
                }))
            })
        }
        ComputeOp::Softmax { axis } => need_float(a)
            .or_else(|| same_dtype(a, out))
            .or_else(|| first(axis_of(a, *axis).map(|_| out_shape(out, &a.shape)))),
        ComputeOp::RmsNorm { axis, .. } => {
            let w = ins.get(1)?;
            need_float(a)
                .or_else(|| same_dtype(a, w))
                .or_else(|| same_dtype(a, out))
                .or_else(|| {
                    first(axis_of(a, *axis).map(|e| {
                        if w.shape != [e] {
                            Some(format!(
                                "the weight `{}` must have shape [{e}] (axis {axis} of `{}`), \
                                 has {}",
                                w.name,
                                a.name,
                                shape_str(&w.shape)
                            ))
                        } else {
                            out_shape(out, &a.shape)
                        }
                    }))
                })
        }
        ComputeOp::Expand => same_dtype(a, out).or_else(|| {
            let off = out.shape.len().checked_sub(a.shape.len());
            let ok = off.is_some_and(|off| {
                a.shape
                    .iter()
                    .enumerate()
                    .all(|(k, &e)| e == 1 || e == out.shape[k + off])
            });
            (!ok).then(|| {
                format!(
                    "`{}` of shape {} does not expand to `{}` of shape {} (aligned from the \
                     last axis, every input axis must equal the output's or be 1)",
                    a.name,
                    shape_str(&a.shape),
                    out.name,
                    shape_str(&out.shape)
                )
            })
        }),
        ComputeOp::Slice { axis, start } => same_dtype(a, out).or_else(|| {
            first(axis_of(a, *axis).map(|e| {
                let n = out.shape.get(*axis).copied().unwrap_or(0);
                let rest_equal = out.shape.len() == a.shape.len()
                    && out
                        .shape
                        .iter()
                        .zip(&a.shape)
                        .enumerate()
                        .all(|(k, (o, i))| k == *axis || o == i);
                if !rest_equal {
                    Some(format!(
                        "output `{}` of shape {} must equal `{}` of shape {} except along axis \
                         {axis}",
                        out.name,
                        shape_str(&out.shape),
                        a.name,
                        shape_str(&a.shape)
                    ))
                } else if start.checked_add(n).is_none_or(|end| end > e) {
                    Some(format!(
                        "slice {start}..{start}+{n} is out of range for axis {axis} of `{}` \
                         (extent {e})",
                        a.name
                    ))
                } else {
                    None
                }
            }))
        }),
        ComputeOp::Cat { axis, .. } => {
            let mut total = 0u64;
            for t in ins {
                if let Some(p) = same_dtype(a, t) {
                    return Some(p);
                }
                let e = match axis_of(t, *axis) {
                    Ok(e) => e,
                    Err(p) => return Some(p),
                };
                let rest_equal = t.shape.len() == a.shape.len()
                    && t.shape
                        .iter()
                        .zip(&a.shape)
                        .enumerate()
                        .all(|(k, (x, y))| k == *axis || x == y);
                if !rest_equal {
                    return Some(format!(
                        "`{}` of shape {} and `{}` of shape {} differ along an axis other than \
                         {axis}",
                        t.name,
                        shape_str(&t.shape),
                        a.name,
                        shape_str(&a.shape)
                    ));
                }
                total = total.saturating_add(e);
            }
            let mut want = a.shape.clone();
            if let Some(slot) = want.get_mut(*axis) {
                *slot = total;
            }
            same_dtype(a, out).or_else(|| out_shape(out, &want))
        }
        // Checked by the caller (`HostChecker::compute`).
        ComputeOp::Copy
        | ComputeOp::Matmul
        | ComputeOp::Linear
        | ComputeOp::LinearAccumulate
        | ComputeOp::Add
        | ComputeOp::Sub
        | ComputeOp::Mul
        | ComputeOp::Gelu
        | ComputeOp::Silu
        | ComputeOp::Sum { .. }
        | ComputeOp::Cast
        | ComputeOp::Permute { .. }
        | ComputeOp::GroupedMatmul => None,
    }
}
