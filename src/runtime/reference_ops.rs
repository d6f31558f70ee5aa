//! The level-1 reference of the shape ops, the reductions `max`/`min`/`avg`, `softmax`,
//! `rms_norm`, `matmul` with batch broadcasting and partial program inputs.
//!
//! Deliberately naive and independent of the kernels it judges: every output element is
//! computed on its own from multi-indices (`unravel`/`ravel`), arithmetic in `f64` rounded
//! once to the output's element type, element moves copied bit for bit.

use meshflow_ir::{DType, OpKind, TensorType};

use super::data::{Storage, TensorData};

/// The multi-index of flat index `flat` in a row-major tensor of `shape`.
fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for k in (0..shape.len()).rev() {
        idx[k] = flat % shape[k].max(1);
        flat /= shape[k].max(1);
    }
    idx
}

/// The flat index of `idx` in a row-major tensor of `shape`.
fn ravel(idx: &[u64], shape: &[u64]) -> usize {
    idx.iter()
        .zip(shape)
        .fold(0u64, |acc, (&i, &n)| acc * n + i) as usize
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn value(t: &TensorData, flat: usize) -> f64 {
    f64::from(t.storage().get_f32(flat).unwrap_or(f32::NAN))
}

fn from_f64(dtype: DType, shape: &[u64], values: &[f64]) -> Result<TensorData, String> {
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    TensorData::from_f32(dtype, shape, &v).map_err(|e| e.to_string())
}

/// Output element `j` is input element `source(j)`, copied exactly.
fn gather(
    x: &TensorData,
    shape: &[u64],
    source: impl Fn(&[u64]) -> usize,
) -> Result<TensorData, String> {
    let indices: Vec<usize> = (0..numel(shape))
        .map(|j| source(&unravel(j, shape)))
        .collect();
    let storage = x
        .storage()
        .pick(&indices)
        .ok_or("an element index is out of range")?;
    TensorData::new(shape.to_vec(), storage).map_err(|e| e.to_string())
}

/// Evaluates op `kind` on full inputs into an output of type `out` (value axes only), when it is
/// one of this module's ops: `None` for the others.
pub(crate) fn evaluate(
    kind: &OpKind,
    ins: &[&TensorData],
    out: &TensorType,
) -> Option<Result<TensorData, String>> {
    let shape = out.value_shape();
    let x = ins.first()?;
    let xs = x.shape().to_vec();
    Some(match kind {
        OpKind::Reshape | OpKind::View | OpKind::Squeeze { .. } | OpKind::Unsqueeze { .. } => {
            TensorData::new(shape, x.storage().clone()).map_err(|e| e.to_string())
        }
        OpKind::Permute { perm } => gather(x, &shape, |o| {
            let mut i = vec![0; xs.len()];
            for (k, &p) in perm.iter().enumerate() {
                i[p] = o[k];
            }
            ravel(&i, &xs)
        }),
        OpKind::Expand => {
            let off = shape.len() - xs.len().min(shape.len());
            gather(x, &shape, |o| {
                let i: Vec<u64> = (0..xs.len())
                    .map(|k| if xs[k] == 1 { 0 } else { o[k + off] })
                    .collect();
                ravel(&i, &xs)
            })
        }
        OpKind::Slice { axis, start, .. } => gather(x, &shape, |o| {
            let mut i = o.to_vec();
            i[*axis] += start;
            ravel(&i, &xs)
        }),
        OpKind::Select { axis, index } => gather(x, &shape, |o| {
            let mut i = o.to_vec();
            i.insert(*axis, *index);
            ravel(&i, &xs)
        }),
        OpKind::Cat { axis, .. } => cat(ins, *axis, &shape),
        OpKind::Max { axis } | OpKind::Min { axis } | OpKind::Avg { axis } => {
            let n = xs[*axis];
            let values: Vec<f64> = (0..numel(&shape))
                .map(|j| {
                    let o = unravel(j, &shape);
                    let row = (0..n).map(|k| {
                        let mut i = o.clone();
                        i.insert(*axis, k);
                        value(x, ravel(&i, &xs))
                    });
                    match kind {
                        OpKind::Max { .. } => row.fold(f64::NEG_INFINITY, f64::max),
                        OpKind::Min { .. } => row.fold(f64::INFINITY, f64::min),
                        _ => row.sum::<f64>() / n as f64,
                    }
                })
                .collect();
            from_f64(out.dtype, &shape, &values)
        }
        OpKind::Softmax { axis } => {
            let values: Vec<f64> = (0..numel(&shape))
                .map(|j| {
                    let o = unravel(j, &shape);
                    let at = |k: u64| {
                        let mut i = o.clone();
                        i[*axis] = k;
                        value(x, ravel(&i, &xs))
                    };
                    let n = xs[*axis];
                    let max = (0..n).map(at).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..n).map(|k| (at(k) - max).exp()).sum();
                    (at(o[*axis]) - max).exp() / sum
                })
                .collect();
            from_f64(out.dtype, &shape, &values)
        }
        OpKind::RmsNorm { axis, eps } => {
            let w = ins.get(1)?;
            let values: Vec<f64> = (0..numel(&shape))
                .map(|j| {
                    let o = unravel(j, &shape);
                    let at = |k: u64| {
                        let mut i = o.clone();
                        i[*axis] = k;
                        value(x, ravel(&i, &xs))
                    };
                    let n = xs[*axis];
                    let ms = (0..n).map(|k| at(k) * at(k)).sum::<f64>() / n as f64;
                    at(o[*axis]) / (ms + f64::from(eps.value())).sqrt()
                        * value(w, o[*axis] as usize)
                })
                .collect();
            from_f64(out.dtype, &shape, &values)
        }
        OpKind::Matmul => matmul(x, ins.get(1)?, out.dtype, &shape),
        _ => return None,
    })
}

fn cat(ins: &[&TensorData], axis: usize, shape: &[u64]) -> Result<TensorData, String> {
    let mut picked = Storage::zeros(ins[0].dtype(), 0);
    for j in 0..numel(shape) {
        let mut i = unravel(j, shape);
        let mut which = 0;
        while which < ins.len() && i[axis] >= ins[which].shape()[axis] {
            i[axis] -= ins[which].shape()[axis];
            which += 1;
        }
        let x = ins.get(which).ok_or("cat: index past the last input")?;
        let flat = ravel(&i, x.shape());
        if !picked.extend_from(x.storage(), flat..flat + 1) {
            return Err("cat: inputs of different element types".into());
        }
    }
    TensorData::new(shape.to_vec(), picked).map_err(|e| e.to_string())
}

/// `a[A.., M, K] @ b[B.., K, N]` with broadcast batch axes (a 2-D `b` is shared).
fn matmul(
    a: &TensorData,
    b: &TensorData,
    dtype: DType,
    shape: &[u64],
) -> Result<TensorData, String> {
    let (sa, sb) = (a.shape(), b.shape());
    let nb = shape.len() - 2;
    let k_extent = sa[sa.len() - 1];
    // The operand index of output batch index `o` (aligned from the last batch axis).
    let batch_of = |o: &[u64], s: &[u64]| -> Vec<u64> {
        let nbs = s.len() - 2;
        (0..nbs)
            .map(|v| if s[v] == 1 { 0 } else { o[v + nb - nbs] })
            .collect()
    };
    let values: Vec<f64> = (0..numel(shape))
        .map(|j| {
            let o = unravel(j, shape);
            let (m, n) = (o[nb], o[nb + 1]);
            let (ba, bb) = (batch_of(&o[..nb], sa), batch_of(&o[..nb], sb));
            (0..k_extent)
                .map(|k| {
                    let mut ia = ba.clone();
                    ia.extend([m, k]);
                    let mut ib = bb.clone();
                    ib.extend([k, n]);
                    value(a, ravel(&ia, sa)) * value(b, ravel(&ib, sb))
                })
                .sum::<f64>()
        })
        .collect();
    from_f64(dtype, shape, &values)
}

/// The value of a partial program input: its full data of type `ty` (reduction axes included)
/// summed over every reduction axis.
pub(crate) fn reduce_partial_input(
    data: &TensorData,
    ty: &TensorType,
) -> Result<TensorData, String> {
    let full: Vec<u64> = ty.axes.iter().map(|a| a.extent).collect();
    let shape = ty.value_shape();
    let mut sums = vec![0f64; numel(&shape) as usize];
    for j in 0..numel(&full) {
        let i = unravel(j, &full);
        let v: Vec<u64> = i
            .iter()
            .zip(&ty.axes)
            .filter(|(_, a)| !a.reduction)
            .map(|(&x, _)| x)
            .collect();
        sums[ravel(&v, &shape)] += value(data, j as usize);
    }
    if ty.dtype.is_float() {
        from_f64(ty.dtype, &shape, &sums)
    } else {
        let ints: Vec<i64> = sums.iter().map(|&s| s as i64).collect();
        TensorData::from_i64(ty.dtype, &shape, &ints).map_err(|e| e.to_string())
    }
}
