//! Device compute of the layout ops `expand`, `slice` and `cat` (strided copies between views)
//! and of the ops along one axis: `max`/`min`/`avg`, `softmax` and `rms_norm` (`rows.cu`).

use meshflow_ir::ComputeOp;
use meshflow_kernels::{AxisView, RowReduce};

use super::core::DeviceCore;
use super::layout::{fold, kdtype};
use super::memory::CudaBuffer;
use crate::runtime::backend::{BackendError, TensorView};
use crate::runtime::cpu_ops::shape_err;

type TV = TensorView<CudaBuffer>;

fn usize_shape(shape: &[u64]) -> Result<Vec<usize>, BackendError> {
    shape
        .iter()
        .map(|&v| {
            usize::try_from(v)
                .map_err(|_| BackendError::Invalid(format!("extent {v} does not fit usize")))
        })
        .collect()
}

fn axis_view(op: &'static str, shape: &[u64], axis: usize) -> Result<AxisView, BackendError> {
    AxisView::of(&usize_shape(shape)?, axis)
        .ok_or_else(|| shape_err(op, format!("axis {axis} out of range for {shape:?}")).into())
}

fn same_dtype(op: &'static str, a: &TV, b: &TV) -> Result<(), BackendError> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(shape_err(op, format!("{} input, {} output", a.dtype, b.dtype)).into())
    }
}

impl DeviceCore {
    /// The ops of this module (see the module docs).
    pub(super) fn layout_or_row_op(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TV],
        out: &TV,
    ) -> Result<(), BackendError> {
        let x = inputs
            .first()
            .ok_or_else(|| BackendError::Invalid(format!("{} needs an input", op.name())))?;
        match op {
            ComputeOp::Max { axis } => self.reduce_rows(RowReduce::Max, x, *axis, out),
            ComputeOp::Min { axis } => self.reduce_rows(RowReduce::Min, x, *axis, out),
            ComputeOp::Avg { axis } => self.reduce_rows(RowReduce::Avg, x, *axis, out),
            ComputeOp::Softmax { axis } => self.softmax(x, *axis, out),
            ComputeOp::RmsNorm { axis, eps } => {
                let w = inputs
                    .get(1)
                    .ok_or_else(|| BackendError::Invalid("rms_norm needs a weight".into()))?;
                self.rms_norm(x, w, *axis, eps.value(), out)
            }
            ComputeOp::Expand => self.expand(x, out),
            ComputeOp::Slice { axis, start } => self.slice(x, *axis, *start, out),
            ComputeOp::Cat { axis, .. } => self.cat(inputs, *axis, out),
            other => Err(BackendError::Invalid(format!(
                "{} is not a layout or row op",
                other.name()
            ))),
        }
    }

    fn reduce_rows(
        &mut self,
        op: RowReduce,
        x: &TV,
        axis: usize,
        out: &TV,
    ) -> Result<(), BackendError> {
        let name = match op {
            RowReduce::Max => "max",
            RowReduce::Min => "min",
            RowReduce::Avg => "avg",
        };
        same_dtype(name, x, out)?;
        let view = axis_view(name, &x.shape, axis)?;
        let mut want = x.shape.clone();
        want.remove(axis);
        if out.shape != want {
            return Err(
                shape_err(name, format!("output {:?}, expected {want:?}", out.shape)).into(),
            );
        }
        let xv = self.input_region(x)?;
        let slot = self.output_slot(out, &[x])?;
        self.kernels
            .reduce_rows(self.stream(), op, kdtype(x.dtype), &xv, view, &slot.buf)
            .map_err(self.err(name))?;
        self.finish_output(slot)
    }

    fn softmax(&mut self, x: &TV, axis: usize, out: &TV) -> Result<(), BackendError> {
        same_dtype("softmax", x, out)?;
        let view = axis_view("softmax", &x.shape, axis)?;
        if out.shape != x.shape {
            return Err(shape_err("softmax", format!("{:?} -> {:?}", x.shape, out.shape)).into());
        }
        let xv = self.input_region(x)?;
        let slot = self.output_slot(out, &[x])?;
        self.kernels
            .softmax(self.stream(), kdtype(x.dtype), &xv, view, &slot.buf)
            .map_err(self.err("softmax"))?;
        self.finish_output(slot)
    }

    fn rms_norm(
        &mut self,
        x: &TV,
        w: &TV,
        axis: usize,
        eps: f32,
        out: &TV,
    ) -> Result<(), BackendError> {
        same_dtype("rms_norm", x, out)?;
        same_dtype("rms_norm", w, out)?;
        let view = axis_view("rms_norm", &x.shape, axis)?;
        if out.shape != x.shape || w.shape != [view.n as u64] {
            return Err(shape_err(
                "rms_norm",
                format!("{:?}, weight {:?} -> {:?}", x.shape, w.shape, out.shape),
            )
            .into());
        }
        let xv = self.input_region(x)?;
        let wv = self.input_region(w)?;
        let slot = self.output_slot(out, &[x, w])?;
        self.kernels
            .rms_norm(
                self.stream(),
                kdtype(x.dtype),
                &xv,
                &wv,
                view,
                eps,
                &slot.buf,
            )
            .map_err(self.err("rms_norm"))?;
        self.finish_output(slot)
    }

    /// Copies the elements of view `src` into view `dst` (same shape and dtype), through a
    /// packed temporary when they share a buffer.
    fn copy_between(&mut self, op: &'static str, src: &TV, dst: &TV) -> Result<(), BackendError> {
        if src.shape != dst.shape {
            return Err(shape_err(op, format!("{:?} into {:?}", src.shape, dst.shape)).into());
        }
        if src.buffer == dst.buffer {
            let temp = self.packed_copy(src)?;
            return self.unstage(&temp, dst);
        }
        let from = self.backing(src)?;
        let to = self.backing(dst)?;
        let l = fold(
            &src.shape,
            &[&src.strides, &dst.strides],
            &[src.offset, dst.offset],
        )
        .map_err(BackendError::Invalid)?;
        self.kernels
            .strided_copy(self.stream(), kdtype(src.dtype), &from, &l[0], &to, &l[1])
            .map_err(self.err(op))
    }

    /// `out` = `x` broadcast: a view of `x` with zero strides on the repeated axes.
    fn expand(&mut self, x: &TV, out: &TV) -> Result<(), BackendError> {
        same_dtype("expand", x, out)?;
        let off = out.shape.len().checked_sub(x.shape.len());
        let fits = off.is_some_and(|off| {
            x.shape
                .iter()
                .enumerate()
                .all(|(k, &e)| e == 1 || e == out.shape[k + off])
        });
        let Some(off) = off.filter(|_| fits) else {
            return Err(shape_err(
                "expand",
                format!("{:?} does not expand to {:?}", x.shape, out.shape),
            )
            .into());
        };
        let strides = (0..out.shape.len())
            .map(|k| {
                if k < off || x.shape[k - off] != out.shape[k] {
                    0
                } else {
                    x.strides[k - off]
                }
            })
            .collect();
        let view = TensorView {
            shape: out.shape.clone(),
            strides,
            ..x.clone()
        };
        self.copy_between("expand", &view, out)
    }

    /// `out = x[.., start..start + n, ..]` along `axis`.
    fn slice(&mut self, x: &TV, axis: usize, start: u64, out: &TV) -> Result<(), BackendError> {
        same_dtype("slice", x, out)?;
        let n = out.shape.get(axis).copied().unwrap_or(0);
        let fits = x.shape.len() == out.shape.len()
            && axis < x.shape.len()
            && start.checked_add(n).is_some_and(|e| e <= x.shape[axis]);
        if !fits {
            return Err(shape_err(
                "slice",
                format!(
                    "{:?} is not a slice from {start} along axis {axis} of {:?}",
                    out.shape, x.shape
                ),
            )
            .into());
        }
        let view = TensorView {
            offset: x.offset + start * x.strides[axis],
            shape: out.shape.clone(),
            ..x.clone()
        };
        self.copy_between("slice", &view, out)
    }

    /// `out` = the inputs concatenated along `axis`: one strided copy per input into its
    /// range of `out`.
    fn cat(&mut self, xs: &[&TV], axis: usize, out: &TV) -> Result<(), BackendError> {
        let mut at = 0u64;
        for x in xs {
            same_dtype("cat", x, out)?;
            let n = x.shape.get(axis).copied().ok_or_else(|| {
                BackendError::from(shape_err("cat", format!("axis {axis} of {:?}", x.shape)))
            })?;
            let stride = out.strides.get(axis).copied().unwrap_or(0);
            let part = TensorView {
                offset: out.offset + at * stride,
                shape: x.shape.clone(),
                ..out.clone()
            };
            if at + n > out.shape.get(axis).copied().unwrap_or(0) {
                return Err(shape_err("cat", "the inputs overrun the output").into());
            }
            self.copy_between("cat", x, &part)?;
            at += n;
        }
        Ok(())
    }
}
