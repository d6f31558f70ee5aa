//! Arity, shape and dtype rules of host compute ops (see [`ComputeOp`]).

use super::host::HostChecker;
use super::host_ops::numel;
use super::names::count;
use super::Location;
use crate::dtype::DType;
use crate::host::{ComputeOp, HostTensor, HostTensorId};

fn shape_str(s: &[u64]) -> String {
    format!("{s:?}")
}

impl HostChecker<'_> {
    pub(super) fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[HostTensorId],
        outputs: &[HostTensorId],
        here: &Location,
    ) {
        let name = op.name();
        let (n_in, n_out) = op.arity();
        if inputs.len() != n_in || outputs.len() != n_out {
            self.push(
                here,
                format!(
                    "`{name}` takes {} and {}, given {} and {}",
                    count(n_in, "input"),
                    count(n_out, "output"),
                    count(inputs.len(), "input"),
                    count(outputs.len(), "output")
                ),
            );
            return;
        }
        if inputs.is_empty() {
            self.push(here, format!("`{name}` takes at least one input"));
            return;
        }
        let get = |t: &HostTensorId| self.p.tensors.get(*t).cloned();
        let Some(ins) = inputs.iter().map(get).collect::<Option<Vec<HostTensor>>>() else {
            return;
        };
        let Some(out) = outputs.first().and_then(get) else {
            return;
        };
        if let Some(message) = self.compute_problem(op, &ins, &out) {
            self.push(here, format!("`{name}`: {message}"));
        }
    }

    /// What is wrong with `op(ins -> out)`, if anything (arity already checked).
    fn compute_problem(
        &self,
        op: &ComputeOp,
        ins: &[HostTensor],
        out: &HostTensor,
    ) -> Option<String> {
        let a = ins.first()?;
        let same_dtypes = |ts: &[&HostTensor]| -> Option<String> {
            let first = ts.first()?;
            ts.iter().find(|t| t.dtype != first.dtype).map(|t| {
                format!(
                    "dtypes differ: `{}` is {} but `{}` is {}",
                    first.name, first.dtype, t.name, t.dtype
                )
            })
        };
        let need_float = |t: &HostTensor| -> Option<String> {
            (!t.dtype.is_float())
                .then(|| format!("`{}` must have a float dtype, not {}", t.name, t.dtype))
        };
        let out_shape = |want: &[u64]| -> Option<String> {
            (out.shape != want).then(|| {
                format!(
                    "output `{}` must have shape {}, has {}",
                    out.name,
                    shape_str(want),
                    shape_str(&out.shape)
                )
            })
        };
        match op {
            ComputeOp::Copy => same_dtypes(&[a, out]).or_else(|| {
                let (na, no) = (numel(a), numel(out));
                (na != no).then(|| {
                    let count =
                        |n: Option<u64>| n.map_or_else(|| "too many".into(), |n| n.to_string());
                    format!(
                        "`{}` has {} elements but `{}` has {}",
                        a.name,
                        count(na),
                        out.name,
                        count(no)
                    )
                })
            }),
            ComputeOp::Cast => out_shape(&a.shape),
            ComputeOp::Gelu | ComputeOp::Silu => need_float(a)
                .or_else(|| same_dtypes(&[a, out]))
                .or_else(|| out_shape(&a.shape)),
            ComputeOp::Add | ComputeOp::Sub | ComputeOp::Mul => {
                let b = ins.get(1)?;
                same_dtypes(&[a, b, out]).or_else(|| {
                    if a.shape != b.shape {
                        Some(format!(
                            "input shapes differ: `{}` is {} and `{}` is {}",
                            a.name,
                            shape_str(&a.shape),
                            b.name,
                            shape_str(&b.shape)
                        ))
                    } else {
                        out_shape(&a.shape)
                    }
                })
            }
            ComputeOp::Sum { axis } => same_dtypes(&[a, out]).or_else(|| {
                if *axis >= a.shape.len() {
                    return Some(format!(
                        "axis {axis} is out of range for `{}` of shape {}",
                        a.name,
                        shape_str(&a.shape)
                    ));
                }
                let mut want = a.shape.clone();
                want.remove(*axis);
                out_shape(&want)
            }),
            ComputeOp::Permute { perm } => same_dtypes(&[a, out]).or_else(|| {
                let rank = a.shape.len();
                let mut seen = vec![false; rank];
                let is_perm = perm.len() == rank
                    && perm
                        .iter()
                        .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
                if !is_perm {
                    return Some(format!(
                        "perm {perm:?} is not a permutation of the {rank} axes of `{}`",
                        a.name
                    ));
                }
                let want: Vec<u64> = perm
                    .iter()
                    .filter_map(|&p| a.shape.get(p).copied())
                    .collect();
                out_shape(&want)
            }),
            ComputeOp::Matmul | ComputeOp::Linear | ComputeOp::LinearAccumulate => {
                let b = ins.get(1)?;
                let linear = matches!(op, ComputeOp::Linear | ComputeOp::LinearAccumulate);
                need_float(a)
                    .or_else(|| same_dtypes(&[a, b, out]))
                    .or_else(|| match matmul_shape(a, b, linear) {
                        Ok(want) => out_shape(&want),
                        Err(message) => Some(message),
                    })
            }
            ComputeOp::Max { .. }
            | ComputeOp::Min { .. }
            | ComputeOp::Avg { .. }
            | ComputeOp::Softmax { .. }
            | ComputeOp::RmsNorm { .. }
            | ComputeOp::Expand
            | ComputeOp::Slice { .. }
            | ComputeOp::Cat { .. } => super::host_compute_ops::problem(op, ins, out),
            ComputeOp::GroupedMatmul => {
                let (counts, w) = (ins.get(1)?, ins.get(2)?);
                need_float(a)
                    .or_else(|| same_dtypes(&[a, w, out]))
                    .or_else(|| {
                        (!matches!(counts.dtype, DType::I32 | DType::I64)).then(|| {
                            format!("`{}` must be i32 or i64, not {}", counts.name, counts.dtype)
                        })
                    })
                    .or_else(|| match grouped_matmul_shape(a, counts, w) {
                        Ok(want) => out_shape(&want),
                        Err(message) => Some(message),
                    })
            }
        }
    }
}

/// The output shape of `a @ b` (`matmul`: b is `[K, N]` or `[B.., K, N]`) or `x @ w^T`
/// (`linear`: w is `[N, K]`).
fn matmul_shape(a: &HostTensor, b: &HostTensor, linear: bool) -> Result<Vec<u64>, String> {
    let rank_error = |t: &HostTensor| {
        format!(
            "`{}` must have at least 2 axes, has shape {}",
            t.name,
            shape_str(&t.shape)
        )
    };
    let [batch @ .., m, k] = a.shape.as_slice() else {
        return Err(rank_error(a));
    };
    let (b_batch, kb, n) = if linear {
        match b.shape.as_slice() {
            [n, k] => (&[][..], k, n),
            _ => {
                return Err(format!(
                    "the weight `{}` must be [N, K], has shape {}",
                    b.name,
                    shape_str(&b.shape)
                ))
            }
        }
    } else {
        match b.shape.as_slice() {
            [bb @ .., k, n] => (bb, k, n),
            _ => return Err(rank_error(b)),
        }
    };
    if !b_batch.is_empty() && b_batch != batch {
        return Err(format!(
            "batch axes differ: `{}` has {} and `{}` has {}",
            a.name,
            shape_str(batch),
            b.name,
            shape_str(b_batch)
        ));
    }
    if k != kb {
        return Err(format!(
            "contraction extents differ: `{}` {} has K={k}, `{}` {} has K={kb}",
            a.name,
            shape_str(&a.shape),
            b.name,
            shape_str(&b.shape)
        ));
    }
    let mut want = batch.to_vec();
    want.extend([*m, *n]);
    Ok(want)
}

/// The output shape of `grouped_matmul(x[B.., L, C, H], counts[B.., L], w[L, H, F])`.
fn grouped_matmul_shape(
    x: &HostTensor,
    counts: &HostTensor,
    w: &HostTensor,
) -> Result<Vec<u64>, String> {
    let [batch @ .., l, c, h] = x.shape.as_slice() else {
        return Err(format!(
            "`{}` must be [B.., L, C, H], has shape {}",
            x.name,
            shape_str(&x.shape)
        ));
    };
    let mut want_counts = batch.to_vec();
    want_counts.push(*l);
    if counts.shape != want_counts {
        return Err(format!(
            "`{}` must have shape {}, has {}",
            counts.name,
            shape_str(&want_counts),
            shape_str(&counts.shape)
        ));
    }
    let [wl, wh, f] = w.shape.as_slice() else {
        return Err(format!(
            "the weight `{}` must be [L={l}, H={h}, F], has shape {}",
            w.name,
            shape_str(&w.shape)
        ));
    };
    if wl != l || wh != h {
        return Err(format!(
            "the weight `{}` must be [L={l}, H={h}, F], has shape {}",
            w.name,
            shape_str(&w.shape)
        ));
    }
    let mut want = batch.to_vec();
    want.extend([*l, *c, *f]);
    Ok(want)
}
