//! Launchers for the kernels along one axis (`rows.cu`): max/min/avg reductions, softmax and
//! rms_norm on packed tensors viewed as `[outer, n, inner]`.

use super::sources::{rows_name, Source, FLOATS};
use super::{Arg, Kernels, BLOCK};
use crate::buffer::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// A reduction along one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowReduce {
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Mean.
    Avg,
}

impl RowReduce {
    /// Every reduction.
    pub const ALL: [RowReduce; 3] = [RowReduce::Max, RowReduce::Min, RowReduce::Avg];

    /// The name in kernel names (`rows_max_f32`).
    pub fn name(self) -> &'static str {
        match self {
            RowReduce::Max => "max",
            RowReduce::Min => "min",
            RowReduce::Avg => "avg",
        }
    }
}

/// `[outer, n, inner]` around an axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AxisView {
    /// Product of the extents before the axis.
    pub outer: usize,
    /// The axis' extent.
    pub n: usize,
    /// Product of the extents after the axis.
    pub inner: usize,
}

impl AxisView {
    /// The view of `shape` around `axis`, or `None` when `axis` is out of range.
    pub fn of(shape: &[usize], axis: usize) -> Option<AxisView> {
        Some(AxisView {
            outer: shape.get(..axis)?.iter().product(),
            n: *shape.get(axis)?,
            inner: shape.get(axis + 1..)?.iter().product(),
        })
    }

    fn args(self) -> Result<[Arg; 3]> {
        let i = |v: usize| {
            i64::try_from(v)
                .map(Arg::I64)
                .map_err(|_| KernelError::InvalidArgument(format!("extent {v}")))
        };
        Ok([i(self.outer)?, i(self.n)?, i(self.inner)?])
    }
}

fn check(dtype: DType, what: &str, buf: &DeviceBuffer, want: usize) -> Result<()> {
    if !FLOATS.contains(&dtype) {
        return Err(KernelError::Unsupported(format!(
            "{what} on {dtype} (f32, bf16 and f16 only)"
        )));
    }
    let have = buf.elems(dtype)?;
    if have != want {
        return Err(KernelError::InvalidArgument(format!(
            "{what}: a buffer of {have} {dtype} elements where {want} are needed"
        )));
    }
    Ok(())
}

impl Kernels {
    fn call_rows(
        &self,
        stream: &Stream,
        name: &str,
        work: usize,
        mut args: Vec<Arg>,
    ) -> Result<()> {
        if work == 0 {
            return Ok(());
        }
        self.call(
            stream,
            Source::Rows,
            name,
            self.grid(work, 1),
            BLOCK,
            &mut args,
        )
    }

    /// `dst[o, i] = op over k of src[o, k, i]` (packed `src` and `dst`).
    pub fn reduce_rows(
        &self,
        stream: &Stream,
        op: RowReduce,
        dtype: DType,
        src: &DeviceBuffer,
        view: AxisView,
        dst: &DeviceBuffer,
    ) -> Result<()> {
        check(dtype, op.name(), src, view.outer * view.n * view.inner)?;
        check(dtype, op.name(), dst, view.outer * view.inner)?;
        self.check_devices(&[src, dst])?;
        let mut args = vec![Arg::Ptr(src.addr()), Arg::Ptr(dst.addr())];
        args.extend(view.args()?);
        let name = rows_name(op.name(), dtype);
        self.call_rows(stream, &name, view.outer * view.inner, args)
    }

    /// `dst = softmax(src)` along the middle axis of `view` (packed, same shape).
    pub fn softmax(
        &self,
        stream: &Stream,
        dtype: DType,
        src: &DeviceBuffer,
        view: AxisView,
        dst: &DeviceBuffer,
    ) -> Result<()> {
        let n = view.outer * view.n * view.inner;
        check(dtype, "softmax", src, n)?;
        check(dtype, "softmax", dst, n)?;
        self.check_devices(&[src, dst])?;
        let mut args = vec![Arg::Ptr(src.addr()), Arg::Ptr(dst.addr())];
        args.extend(view.args()?);
        let name = rows_name("softmax", dtype);
        self.call_rows(stream, &name, view.outer * view.inner, args)
    }

    /// `dst = src / sqrt(mean(src^2) + eps) * weight` along the middle axis of `view` (packed,
    /// same shape; `weight` has `view.n` elements).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        stream: &Stream,
        dtype: DType,
        src: &DeviceBuffer,
        weight: &DeviceBuffer,
        view: AxisView,
        eps: f32,
        dst: &DeviceBuffer,
    ) -> Result<()> {
        let n = view.outer * view.n * view.inner;
        check(dtype, "rms_norm", src, n)?;
        check(dtype, "rms_norm weight", weight, view.n)?;
        check(dtype, "rms_norm", dst, n)?;
        self.check_devices(&[src, weight, dst])?;
        let mut args = vec![
            Arg::Ptr(src.addr()),
            Arg::Ptr(weight.addr()),
            Arg::Ptr(dst.addr()),
        ];
        args.extend(view.args()?);
        args.push(Arg::U32(eps.to_bits()));
        let name = rows_name("rms_norm", dtype);
        self.call_rows(stream, &name, view.outer * view.inner, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_views() {
        assert_eq!(
            AxisView::of(&[2, 3, 4], 1),
            Some(AxisView {
                outer: 2,
                n: 3,
                inner: 4
            })
        );
        assert_eq!(
            AxisView::of(&[5], 0),
            Some(AxisView {
                outer: 1,
                n: 5,
                inner: 1
            })
        );
        assert_eq!(AxisView::of(&[5], 1), None);
    }
}
