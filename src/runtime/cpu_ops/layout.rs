//! Layout kernels that move elements without arithmetic: `expand`, `slice` and `cat`.
//! Elements are copied exactly (no conversion).

use std::borrow::Cow;

use super::{shape_err, view_err, OpError};
use crate::runtime::data::{Storage, TensorData};
use crate::runtime::view::{View, ViewMut};

fn same_dtype(op: &'static str, x: &View<'_>, out: &ViewMut<'_>) -> Result<(), OpError> {
    if x.dtype() == out.dtype() {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("{} input, {} output", x.dtype(), out.dtype()),
        ))
    }
}

/// `out` = `x` broadcast to `out`'s shape (aligned from the last axis; axes of extent 1 and
/// missing leading axes repeat).
pub fn expand(x: &View<'_>, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    const OP: &str = "expand";
    same_dtype(OP, x, out)?;
    let (is, os) = (x.shape().to_vec(), out.shape().to_vec());
    let off = os.len().checked_sub(is.len());
    let ok = off.is_some_and(|off| {
        is.iter()
            .enumerate()
            .all(|(k, &e)| e == 1 || e == os[k + off])
    });
    let Some(off) = off.filter(|_| ok) else {
        return Err(shape_err(OP, format!("{is:?} does not expand to {os:?}")));
    };
    let strides: Vec<u64> = (0..os.len())
        .map(|k| {
            if k < off || is[k - off] != os[k] {
                0
            } else {
                x.strides()[k - off]
            }
        })
        .collect();
    let v = View::new(
        x.storage_ref(),
        x.offset(),
        Cow::Owned(os),
        Cow::Owned(strides),
    )
    .map_err(view_err(OP))?;
    out.copy_from(&v).map_err(view_err(OP))
}

/// `out = x[.., start..start + n, ..]` along `axis`, `n` the output's extent there.
pub fn slice(x: &View<'_>, axis: usize, start: u64, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    const OP: &str = "slice";
    same_dtype(OP, x, out)?;
    let (is, os) = (x.shape(), out.shape());
    let n = os.get(axis).copied().unwrap_or(0);
    let fits = is.len() == os.len()
        && axis < is.len()
        && is
            .iter()
            .zip(os)
            .enumerate()
            .all(|(k, (a, b))| k == axis || a == b)
        && start.checked_add(n).is_some_and(|e| e <= is[axis]);
    if !fits {
        return Err(shape_err(
            OP,
            format!("{os:?} is not a slice from {start} along axis {axis} of {is:?}"),
        ));
    }
    let offset = x.offset() + start * x.strides()[axis];
    let v = View::new(
        x.storage_ref(),
        offset,
        Cow::Owned(os.to_vec()),
        Cow::Owned(x.strides().to_vec()),
    )
    .map_err(view_err(OP))?;
    out.copy_from(&v).map_err(view_err(OP))
}

/// `out` = the inputs concatenated along `axis`.
pub fn cat(xs: &[View<'_>], axis: usize, out: &mut ViewMut<'_>) -> Result<(), OpError> {
    const OP: &str = "cat";
    let first = xs
        .first()
        .ok_or_else(|| shape_err(OP, "takes at least one input"))?;
    let base = first.shape().to_vec();
    if axis >= base.len() {
        return Err(shape_err(
            OP,
            format!("axis {axis} out of range for {base:?}"),
        ));
    }
    let mut want = base.clone();
    want[axis] = 0;
    for x in xs {
        same_dtype(OP, x, out)?;
        let s = x.shape();
        let ok = s.len() == base.len()
            && s.iter()
                .zip(&base)
                .enumerate()
                .all(|(k, (a, b))| k == axis || a == b);
        if !ok {
            return Err(shape_err(
                OP,
                format!("{s:?} and {base:?} differ along an axis other than {axis}"),
            ));
        }
        want[axis] += s[axis];
    }
    super::expect_shape(OP, "the output", out.shape(), &want)?;
    let outer: u64 = base[..axis].iter().product();
    let inner: u64 = base[axis + 1..].iter().product();
    let parts: Vec<Storage> = xs.iter().map(View::to_storage).collect();
    let mut all = Storage::zeros(out.dtype(), 0);
    for o in 0..outer as usize {
        for (x, p) in xs.iter().zip(&parts) {
            let len = (x.shape()[axis] * inner) as usize;
            if !all.extend_from(p, o * len..(o + 1) * len) {
                return Err(shape_err(OP, "inputs of different element types"));
            }
        }
    }
    let t = TensorData::new(want, all).map_err(|e| shape_err(OP, e.to_string()))?;
    out.copy_from(&View::of(&t)).map_err(view_err(OP))
}
