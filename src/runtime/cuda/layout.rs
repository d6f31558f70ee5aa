//! Views as the kernels see them: element types, contiguity, and strided layouts folded to at
//! most [`MAX_RANK`] dimensions.

use meshflow_ir::DType;
use meshflow_kernels::{DType as KDType, StridedLayout, MAX_RANK};

use crate::runtime::backend::TensorView;

/// The kernels' element type of an IR element type.
pub(super) fn kdtype(d: DType) -> KDType {
    match d {
        DType::F32 => KDType::F32,
        DType::BF16 => KDType::BF16,
        DType::F16 => KDType::F16,
        DType::I32 => KDType::I32,
        DType::I64 => KDType::I64,
    }
}

/// The kernels crate's encoding of MoE dispatch rows `wire`.
pub(super) fn kwire(wire: meshflow_ir::MoeWire) -> meshflow_kernels::moe::MoeWire {
    use meshflow_ir::MoeWire as W;
    match wire {
        W::Native => meshflow_kernels::moe::MoeWire::Native,
        W::Fp8E4m3(s) => {
            meshflow_kernels::moe::MoeWire::Fp8E4m3(crate::runtime::cpu_ops::kernel_scales(s))
        }
    }
}

/// Bytes per element.
pub(super) fn elem_bytes(d: DType) -> usize {
    kdtype(d).size_bytes()
}

/// Whether `shape`/`strides` is the packed row-major layout (dimensions of extent 1 may have
/// any stride).
pub(super) fn is_contiguous(shape: &[u64], strides: &[u64]) -> bool {
    let mut expect = 1u64;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(n);
    }
    shape.len() == strides.len()
}

/// Whether the view is packed row-major (so it is one contiguous byte range).
pub(super) fn view_is_contiguous<B>(v: &TensorView<B>) -> bool {
    is_contiguous(&v.shape, &v.strides)
}

fn usize_of(v: u64, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} does not fit usize"))
}

/// Folds the dimensions of several layouts of one shape together where every layout allows it
/// (drops extent-1 dimensions, merges neighbours that are contiguous with each other in every
/// layout), so that strided copies see at most [`MAX_RANK`] dimensions.
pub(super) fn fold(
    shape: &[u64],
    strides: &[&[u64]],
    offsets: &[u64],
) -> Result<Vec<StridedLayout>, String> {
    let mut dims: Vec<(u64, Vec<u64>)> = Vec::new();
    for (d, &n) in shape.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let st: Vec<u64> = strides.iter().map(|s| s[d]).collect();
        if let Some((pn, ps)) = dims.last_mut() {
            if ps.iter().zip(&st).all(|(&p, &s)| p == s.saturating_mul(n)) {
                *pn = pn.saturating_mul(n);
                *ps = st;
                continue;
            }
        }
        dims.push((n, st));
    }
    if dims.is_empty() {
        dims.push((1, vec![1; strides.len()]));
    }
    if dims.len() > MAX_RANK {
        return Err(format!(
            "a strided view of shape {shape:?} folds to {} dimensions; the copy kernel handles {MAX_RANK}",
            dims.len()
        ));
    }
    let sizes = dims
        .iter()
        .map(|(n, _)| usize_of(*n, "extent"))
        .collect::<Result<Vec<_>, _>>()?;
    (0..strides.len())
        .map(|k| {
            Ok(StridedLayout {
                shape: sizes.clone(),
                strides: dims
                    .iter()
                    .map(|(_, s)| usize_of(s[k], "stride"))
                    .collect::<Result<_, _>>()?,
                offset: usize_of(offsets[k], "offset")?,
            })
        })
        .collect()
}

/// Packed row-major strides of `shape`.
pub(super) fn packed(shape: &[u64]) -> Vec<u64> {
    crate::runtime::view::contiguous_strides(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity_ignores_unit_dims() {
        assert!(is_contiguous(&[2, 3], &[3, 1]));
        assert!(is_contiguous(&[1, 3], &[99, 1]));
        assert!(!is_contiguous(&[2, 3], &[6, 1]));
        assert!(!is_contiguous(&[3, 2], &[1, 3]));
    }

    #[test]
    fn folding_merges_what_every_layout_allows() {
        // A [4, 2, 3] column block of a [4, 2, 6] tensor copied into a packed buffer.
        let src = [12u64, 6, 1];
        let dst = packed(&[4, 2, 3]);
        let l = fold(&[4, 2, 3], &[&src, &dst], &[3, 0]).unwrap();
        assert_eq!(l[0].shape, vec![8, 3]);
        assert_eq!(l[0].strides, vec![6, 1]);
        assert_eq!(l[1].strides, vec![3, 1]);
        assert_eq!(l[0].offset, 3);
        let l = fold(&[1, 1], &[&[5, 7]], &[2]).unwrap();
        assert_eq!((l[0].shape.clone(), l[0].offset), (vec![1], 2));
        let many = [2u64; 6];
        let odd: Vec<u64> = (0..6).map(|i| 100u64.pow(i as u32 % 3) * 7 + i).collect();
        assert!(fold(&many, &[&odd], &[0]).is_err());
    }
}
