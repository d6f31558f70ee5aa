//! Calls of the kernels for strided copies / permutes (`copy.cu`) and axis sums (`reduce.cu`).

use super::sources::{sum_name, Source, SUM_TYPES};
use super::{Arg, Kernels, BLOCK};
use crate::buffer::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// Most dimensions a strided copy handles.
pub const MAX_RANK: usize = 4;

/// Kernel parameter block of `strided_copy_b*` (must match `StridedArgs` in `copy.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StridedArgs {
    size: [i64; 4],
    src_stride: [i64; 4],
    dst_stride: [i64; 4],
    n: i64,
}

/// A view of a tensor in a buffer: shape, element strides and element offset (row-major
/// logical order). At most [`MAX_RANK`] dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StridedLayout {
    /// Size of each dimension.
    pub shape: Vec<usize>,
    /// Distance in elements between neighbours along each dimension.
    pub strides: Vec<usize>,
    /// Element offset of the first element.
    pub offset: usize,
}

impl StridedLayout {
    /// A packed row-major layout of `shape`.
    pub fn contiguous(shape: &[usize]) -> StridedLayout {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        StridedLayout {
            shape: shape.to_vec(),
            strides,
            offset: 0,
        }
    }

    /// The same memory viewed with dimensions reordered: output dimension `d` is input dimension
    /// `perm[d]` (like `torch.permute`).
    pub fn permuted(&self, perm: &[usize]) -> Result<StridedLayout> {
        let mut seen = vec![false; self.shape.len()];
        let valid = perm.len() == self.shape.len()
            && perm
                .iter()
                .all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(KernelError::InvalidArgument(format!(
                "{perm:?} is not a permutation of {} dimensions",
                self.shape.len()
            )));
        }
        Ok(StridedLayout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// One past the highest element index touched (0 when empty), or `None` on overflow.
    fn end(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(0);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (s, st)| {
                acc.checked_add((s - 1).checked_mul(*st)?)
            })?
            .checked_add(1)
    }

    fn check(&self, buf: &DeviceBuffer, dtype: DType, what: &str) -> Result<()> {
        if self.shape.len() != self.strides.len() || self.shape.len() > MAX_RANK {
            return Err(KernelError::InvalidArgument(format!(
                "{what} layout: {} dims with {} strides (at most {MAX_RANK} dims)",
                self.shape.len(),
                self.strides.len()
            )));
        }
        let end = self
            .end()
            .ok_or_else(|| KernelError::InvalidArgument(format!("{what} layout overflows")))?;
        if end > buf.elems(dtype)? {
            return Err(KernelError::InvalidArgument(format!(
                "{what} layout {self:?} reaches element {end} of a buffer of {} {dtype} elements",
                buf.elems(dtype)?
            )));
        }
        Ok(())
    }
}

fn to_i64(v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| KernelError::InvalidArgument(format!("{v} does not fit i64")))
}

impl Kernels {
    /// Copies the elements of `src` seen through `src_layout` into `dst` seen through
    /// `dst_layout` (same shape). With a contiguous `dst_layout` this materializes any strided
    /// view; target layouts must not map two elements to one address.
    #[allow(clippy::too_many_arguments)]
    pub fn strided_copy(
        &self,
        stream: &Stream,
        dtype: DType,
        src: &DeviceBuffer,
        src_layout: &StridedLayout,
        dst: &DeviceBuffer,
        dst_layout: &StridedLayout,
    ) -> Result<()> {
        if src_layout.shape != dst_layout.shape {
            return Err(KernelError::InvalidArgument(format!(
                "strided copy from shape {:?} to shape {:?}",
                src_layout.shape, dst_layout.shape
            )));
        }
        src_layout.check(src, dtype, "source")?;
        dst_layout.check(dst, dtype, "target")?;
        if dst_layout
            .shape
            .iter()
            .zip(&dst_layout.strides)
            .any(|(s, st)| *s > 1 && *st == 0)
        {
            return Err(KernelError::InvalidArgument(
                "target layout has a zero stride".into(),
            ));
        }
        self.check_devices(&[src, dst])?;
        let n = src_layout.numel();
        if n == 0 {
            return Ok(());
        }
        // Pad to 4 dims at the front (size 1, stride 0).
        let pad = MAX_RANK - src_layout.shape.len();
        let mut a = StridedArgs {
            size: [1; 4],
            src_stride: [0; 4],
            dst_stride: [0; 4],
            n: to_i64(n)?,
        };
        for d in 0..src_layout.shape.len() {
            a.size[pad + d] = to_i64(src_layout.shape[d])?;
            a.src_stride[pad + d] = to_i64(src_layout.strides[d])?;
            a.dst_stride[pad + d] = to_i64(dst_layout.strides[d])?;
        }
        let esize = dtype.size_bytes();
        let src_addr = src.addr() + (src_layout.offset * esize) as u64;
        let dst_addr = dst.addr() + (dst_layout.offset * esize) as u64;
        let mut args = [Arg::Ptr(src_addr), Arg::Ptr(dst_addr), Arg::Strided(a)];
        let name = format!("strided_copy_b{esize}");
        self.call(
            stream,
            Source::Copy,
            &name,
            self.grid(n, 1),
            BLOCK,
            &mut args,
        )
    }

    /// `dst = src.permute(perm)` for a packed `src` of `shape`; `dst` is packed in the permuted
    /// shape.
    pub fn permute(
        &self,
        stream: &Stream,
        dtype: DType,
        src: &DeviceBuffer,
        shape: &[usize],
        perm: &[usize],
        dst: &DeviceBuffer,
    ) -> Result<()> {
        let src_view = StridedLayout::contiguous(shape).permuted(perm)?;
        let dst_layout = StridedLayout::contiguous(&src_view.shape);
        self.strided_copy(stream, dtype, src, &src_view, dst, &dst_layout)
    }

    /// Sums a packed `src` of `shape` over `axis` into a packed `dst` (the shape without `axis`),
    /// accumulating in f32. `out_dtype` is `dtype` or `F32`.
    #[allow(clippy::too_many_arguments)]
    pub fn sum_axis(
        &self,
        stream: &Stream,
        dtype: DType,
        src: &DeviceBuffer,
        shape: &[usize],
        axis: usize,
        dst: &DeviceBuffer,
        out_dtype: DType,
    ) -> Result<()> {
        if !SUM_TYPES.contains(&(dtype, out_dtype)) {
            return Err(KernelError::Unsupported(format!(
                "sum of {dtype} into {out_dtype}"
            )));
        }
        if axis >= shape.len() {
            return Err(KernelError::InvalidArgument(format!(
                "sum over axis {axis} of a {}-d tensor",
                shape.len()
            )));
        }
        let outer: usize = shape[..axis].iter().product();
        let len = shape[axis];
        let inner: usize = shape[axis + 1..].iter().product();
        let n_in = outer * len * inner;
        if src.elems(dtype)? != n_in || dst.elems(out_dtype)? != outer * inner {
            return Err(KernelError::InvalidArgument(format!(
                "sum over axis {axis} of shape {shape:?}: buffers of {} and {} bytes",
                src.len(),
                dst.len()
            )));
        }
        self.check_devices(&[src, dst])?;
        let n_out = outer * inner;
        if n_out == 0 {
            return Ok(());
        }
        if inner == 1 {
            let mut args = [
                Arg::Ptr(src.addr()),
                Arg::Ptr(dst.addr()),
                Arg::I64(to_i64(outer)?),
                Arg::I64(to_i64(len)?),
            ];
            let grid = u32::try_from(outer.min(self.device.sm_count() as usize * 16))
                .unwrap_or(1)
                .max(1);
            let name = sum_name("rows", dtype, out_dtype);
            self.call(stream, Source::Reduce, &name, grid, BLOCK, &mut args)
        } else {
            let mut args = [
                Arg::Ptr(src.addr()),
                Arg::Ptr(dst.addr()),
                Arg::I64(to_i64(outer)?),
                Arg::I64(to_i64(len)?),
                Arg::I64(to_i64(inner)?),
            ];
            let name = sum_name("axis", dtype, out_dtype);
            self.call(
                stream,
                Source::Reduce,
                &name,
                self.grid(n_out, 1),
                BLOCK,
                &mut args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_and_permuted_layouts() {
        let l = StridedLayout::contiguous(&[2, 3, 4]);
        assert_eq!(l.strides, vec![12, 4, 1]);
        let p = l.permuted(&[2, 0, 1]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.shape, vec![4, 2, 3]);
        assert_eq!(p.strides, vec![1, 12, 4]);
        assert_eq!(p.end(), Some(24));
        assert!(l.permuted(&[0, 0, 1]).is_err());
        assert!(l.permuted(&[0, 1]).is_err());
        assert_eq!(StridedLayout::contiguous(&[3, 0]).end(), Some(0));
    }

    #[test]
    fn strided_args_layout_matches_cuda() {
        assert_eq!(std::mem::size_of::<StridedArgs>(), 13 * 8);
        assert_eq!(std::mem::align_of::<StridedArgs>(), 8);
    }
}
