//! Output type inference for level-1 ops.

use super::{Axis, OpKind, TensorType};
use crate::dtype::DType;

/// Why an op's inputs do not fit together.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct InferError {
    /// The op's name.
    pub op: &'static str,
    /// What is wrong.
    pub message: String,
}

pub(super) fn err(op: &OpKind, message: impl Into<String>) -> InferError {
    InferError {
        op: op.name(),
        message: message.into(),
    }
}

pub(super) fn shape_str(s: &[u64]) -> String {
    format!("{s:?}")
}

/// Infers the output types of `kind` applied to inputs of types `inputs`.
///
/// `declared` are the declared output types, if known: they supply what the inputs cannot
/// (the target dtype of `cast`, the expert count `E` and capacity `C` of `moe_dispatch`).
pub fn infer_output_types(
    kind: &OpKind,
    inputs: &[&TensorType],
    declared: &[&TensorType],
) -> Result<Vec<TensorType>, InferError> {
    let (n_in, n_out) = kind.arity();
    if inputs.len() != n_in {
        return Err(err(
            kind,
            format!("takes {n_in} inputs, {} given", inputs.len()),
        ));
    }
    if !declared.is_empty() && declared.len() != n_out {
        return Err(err(
            kind,
            format!("produces {n_out} outputs, {} declared", declared.len()),
        ));
    }
    let v: Vec<Vec<u64>> = inputs.iter().map(|t| t.value_shape()).collect();
    let d: Vec<DType> = inputs.iter().map(|t| t.dtype).collect();
    let iters = |shape: &[u64]| shape.iter().map(|&e| Axis::iter(e)).collect::<Vec<_>>();
    let need_float = |i: usize, what: &str| -> Result<(), InferError> {
        if d[i].is_float() {
            Ok(())
        } else {
            Err(err(
                kind,
                format!("{what} must be a float type, not {}", d[i]),
            ))
        }
    };
    let need_int = |i: usize, what: &str| -> Result<(), InferError> {
        if matches!(d[i], DType::I32 | DType::I64) {
            Ok(())
        } else {
            Err(err(
                kind,
                format!("{what} must be i32 or i64, not {}", d[i]),
            ))
        }
    };
    let same_dtype = |a: usize, b: usize| -> Result<(), InferError> {
        if d[a] == d[b] {
            Ok(())
        } else {
            Err(err(
                kind,
                format!("input dtypes differ: {} and {}", d[a], d[b]),
            ))
        }
    };
    let need_rank = |i: usize, min: usize, what: &str| -> Result<(), InferError> {
        if v[i].len() >= min {
            Ok(())
        } else {
            Err(err(
                kind,
                format!(
                    "{what} must have at least {min} axes, has shape {}",
                    shape_str(&v[i])
                ),
            ))
        }
    };
    let out = match kind {
        OpKind::Set => vec![super::infer_ops::set_type(
            kind,
            inputs[0],
            declared.first(),
        )?],
        OpKind::Gelu | OpKind::Silu => {
            need_float(0, "the input")?;
            vec![TensorType {
                dtype: d[0],
                axes: iters(&v[0]),
            }]
        }
        OpKind::Add | OpKind::Sub | OpKind::Mul => {
            same_dtype(0, 1)?;
            if v[0] != v[1] {
                return Err(err(
                    kind,
                    format!(
                        "input shapes differ: {} and {}",
                        shape_str(&v[0]),
                        shape_str(&v[1])
                    ),
                ));
            }
            match declared.first() {
                Some(decl) if decl.axes.iter().any(|a| a.reduction) => {
                    vec![super::infer_ops::partial_pointwise_type(
                        kind, inputs, decl,
                    )?]
                }
                _ => vec![TensorType {
                    dtype: d[0],
                    axes: iters(&v[0]),
                }],
            }
        }
        OpKind::Cast => {
            let dtype = declared.first().map(|t| t.dtype).unwrap_or(d[0]);
            vec![TensorType {
                dtype,
                axes: iters(&v[0]),
            }]
        }
        OpKind::Sum { axis } => {
            if *axis >= v[0].len() {
                return Err(err(
                    kind,
                    format!("axis {axis} out of range for shape {}", shape_str(&v[0])),
                ));
            }
            let mut axes = iters(&v[0]);
            axes[*axis].reduction = true;
            vec![TensorType { dtype: d[0], axes }]
        }
        OpKind::Matmul => super::infer_ops::matmul_type(kind, inputs[0], inputs[1])?,
        OpKind::Linear => {
            need_float(0, "the first input")?;
            same_dtype(0, 1)?;
            need_rank(0, 2, "the first input")?;
            need_rank(1, 2, "the second input")?;
            let a = &v[0];
            let (batch, m, k) = (&a[..a.len() - 2], a[a.len() - 2], a[a.len() - 1]);
            let b = &v[1];
            if b.len() != 2 {
                return Err(err(
                    kind,
                    format!("the weight must be [N, K], has shape {}", shape_str(b)),
                ));
            }
            let (kb, n) = (b[1], b[0]);
            if k != kb {
                return Err(err(
                    kind,
                    format!(
                        "contraction extents differ: {} has K={k}, {} has K={kb}",
                        shape_str(a),
                        shape_str(b)
                    ),
                ));
            }
            let mut axes = iters(batch);
            axes.extend([Axis::iter(m), Axis::iter(n), Axis::reduce(k)]);
            vec![TensorType { dtype: d[0], axes }]
        }
        OpKind::Max { .. }
        | OpKind::Min { .. }
        | OpKind::Avg { .. }
        | OpKind::Reshape
        | OpKind::View
        | OpKind::Permute { .. }
        | OpKind::Expand
        | OpKind::Squeeze { .. }
        | OpKind::Unsqueeze { .. }
        | OpKind::Slice { .. }
        | OpKind::Select { .. }
        | OpKind::Cat { .. }
        | OpKind::Softmax { .. }
        | OpKind::RmsNorm { .. } => super::infer_ops::infer(kind, inputs, declared)?,
        OpKind::MoeDispatch { wire } => {
            need_float(0, "the tokens")?;
            need_int(1, "topk_idx")?;
            need_rank(0, 2, "the tokens")?;
            need_rank(1, 2, "topk_idx")?;
            let (x, idx) = (&v[0], &v[1]);
            let batch = &x[..x.len() - 2];
            let (t, h) = (x[x.len() - 2], x[x.len() - 1]);
            if let Some(why) = wire.width_error(h) {
                return Err(err(kind, why));
            }
            if idx.len() != x.len() || &idx[..idx.len() - 2] != batch || idx[idx.len() - 2] != t {
                return Err(err(
                    kind,
                    format!(
                        "topk_idx must be [{}T={t}, K], has shape {}",
                        batch.iter().map(|b| format!("{b}, ")).collect::<String>(),
                        shape_str(idx)
                    ),
                ));
            }
            let Some(decl) = declared.first() else {
                return Err(err(
                    kind,
                    "the expert count and capacity come from the declared expert_x type",
                ));
            };
            let ds = decl.value_shape();
            if ds.len() != batch.len() + 3 {
                return Err(err(
                    kind,
                    format!(
                        "expert_x must be [B.., E, C, H] with {} batch axes, declared {}",
                        batch.len(),
                        decl
                    ),
                ));
            }
            let (e, c) = (ds[batch.len()], ds[batch.len() + 1]);
            if e == 0 || c == 0 {
                return Err(err(kind, "expert count and capacity must be at least 1"));
            }
            let k = idx[idx.len() - 1];
            if k > e {
                return Err(err(
                    kind,
                    format!(
                        "top-{k} routing needs at least {k} experts, but expert_x declares E = \
                         {e} (topk_idx is {}, expert_x {decl})",
                        shape_str(idx)
                    ),
                ));
            }
            let mut ex = iters(batch);
            ex.extend([Axis::iter(e), Axis::iter(c), Axis::iter(h)]);
            let mut counts = iters(batch);
            counts.push(Axis::iter(e));
            let mut routing = iters(batch);
            routing.extend([Axis::iter(e), Axis::iter(c), Axis::iter(2)]);
            vec![
                TensorType {
                    dtype: d[0],
                    axes: ex,
                },
                TensorType {
                    dtype: DType::I32,
                    axes: counts,
                },
                TensorType {
                    dtype: DType::I32,
                    axes: routing,
                },
            ]
        }
        OpKind::GroupedMatmul => {
            need_float(0, "expert_x")?;
            need_int(1, "expert_counts")?;
            same_dtype(0, 2)?;
            need_rank(0, 3, "expert_x")?;
            let (ex, counts, w) = (&v[0], &v[1], &v[2]);
            let nb = ex.len() - 3;
            let (batch, e, c, h) = (&ex[..nb], ex[nb], ex[nb + 1], ex[nb + 2]);
            let mut want_counts = batch.to_vec();
            want_counts.push(e);
            if *counts != want_counts {
                return Err(err(
                    kind,
                    format!(
                        "expert_counts must have shape {}, has {}",
                        shape_str(&want_counts),
                        shape_str(counts)
                    ),
                ));
            }
            if w.len() != 3 || w[0] != e || w[1] != h {
                return Err(err(
                    kind,
                    format!(
                        "expert weights must be [E={e}, H={h}, F], have shape {}",
                        shape_str(w)
                    ),
                ));
            }
            let mut axes = iters(batch);
            axes.extend([
                Axis::iter(e),
                Axis::iter(c),
                Axis::iter(w[2]),
                Axis::reduce(h),
            ]);
            vec![TensorType { dtype: d[0], axes }]
        }
        OpKind::MoeCombine => {
            need_float(0, "expert_y")?;
            need_int(1, "expert_counts")?;
            need_int(2, "routing")?;
            need_float(3, "topk_weights")?;
            need_rank(0, 3, "expert_y")?;
            let (ey, counts, routing, w) = (&v[0], &v[1], &v[2], &v[3]);
            let nb = ey.len() - 3;
            let (batch, e, c, f) = (&ey[..nb], ey[nb], ey[nb + 1], ey[nb + 2]);
            let mut want_counts = batch.to_vec();
            want_counts.push(e);
            let mut want_routing = batch.to_vec();
            want_routing.extend([e, c, 2]);
            if *counts != want_counts {
                return Err(err(
                    kind,
                    format!(
                        "expert_counts must have shape {}, has {}",
                        shape_str(&want_counts),
                        shape_str(counts)
                    ),
                ));
            }
            if *routing != want_routing {
                return Err(err(
                    kind,
                    format!(
                        "routing must have shape {}, has {}",
                        shape_str(&want_routing),
                        shape_str(routing)
                    ),
                ));
            }
            if w.len() != nb + 2 || &w[..nb] != batch {
                return Err(err(
                    kind,
                    format!(
                        "topk_weights must be [B.., T, K] with batch {}, has shape {}",
                        shape_str(batch),
                        shape_str(w)
                    ),
                ));
            }
            let mut axes = iters(batch);
            axes.extend([Axis::iter(w[nb]), Axis::iter(f)]);
            vec![TensorType { dtype: d[0], axes }]
        }
        OpKind::Custom(_) => custom_types(kind, &v, declared)?,
    };
    Ok(out)
}

/// The output types of a custom op: the declared ones, checked against the contract of
/// [`CustomOp`](super::CustomOp) (one value shape for every output, no reduction axes, each
/// input's shape a suffix of it).
fn custom_types(
    kind: &OpKind,
    inputs: &[Vec<u64>],
    declared: &[&TensorType],
) -> Result<Vec<TensorType>, InferError> {
    if let OpKind::Custom(c) = kind {
        if c.kernel.is_empty() {
            return Err(err(kind, "the kernel name is empty"));
        }
    }
    let Some(first) = declared.first() else {
        return Err(err(
            kind,
            "produces at least one output, whose type must be declared",
        ));
    };
    let shape = first.value_shape();
    for (k, t) in declared.iter().enumerate() {
        if t.axes.iter().any(|a| a.reduction) {
            return Err(err(
                kind,
                format!("output #{k} has a reduction axis ({t}); custom outputs have none"),
            ));
        }
        if t.value_shape() != shape {
            return Err(err(
                kind,
                format!(
                    "output #{k} has shape {} but output #0 has {}; every output has one shape",
                    shape_str(&t.value_shape()),
                    shape_str(&shape)
                ),
            ));
        }
    }
    for (j, v) in inputs.iter().enumerate() {
        if !shape.ends_with(v) {
            return Err(err(
                kind,
                format!(
                    "input #{j} has shape {}, which is not a suffix of the output shape {} \
                     (inputs align with the outputs from the last axis)",
                    shape_str(v),
                    shape_str(&shape)
                ),
            ));
        }
    }
    Ok(declared.iter().map(|&t| t.clone()).collect())
}
