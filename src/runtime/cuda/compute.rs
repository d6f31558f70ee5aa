//! Compute ops on the current stream: GEMMs through cuBLAS (f32 without TF32), elementwise,
//! reductions, casts and layout changes through the NVRTC kernels (the layout and row ops of
//! the shape-op family in `layout_ops.rs`).

use meshflow_ir::{ComputeOp, DType};
use meshflow_kernels::{BinaryOp, Gemm, KernelArg, UnaryOp, UserKernel};

use super::core::DeviceCore;
use super::layout::{fold, kdtype};
use super::memory::CudaBuffer;
use super::user_kernels::KernelDef;
use crate::runtime::backend::{BackendError, TensorView};
use crate::runtime::cpu_ops::{shape_err, OpError};

type TV = TensorView<CudaBuffer>;

fn expect_shape(op: &'static str, what: &str, got: &[u64], want: &[u64]) -> Result<(), OpError> {
    if got == want {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("{what} has shape {got:?}, expected {want:?}"),
        ))
    }
}

fn to_usize(v: u64) -> Result<usize, BackendError> {
    usize::try_from(v).map_err(|_| BackendError::Invalid(format!("extent {v} does not fit usize")))
}

/// Which GEMM [`DeviceCore::gemm`] runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Form {
    /// `out = a @ b`.
    Matmul,
    /// `out = a @ b^T`.
    Linear,
    /// `out += a @ b^T`.
    LinearAccumulate,
}

/// The output dtype a GEMM may write for `input` elements.
fn gemm_out_ok(input: DType, out: DType) -> bool {
    out == input || (out == DType::F32 && matches!(input, DType::BF16 | DType::F16))
}

impl DeviceCore {
    pub(super) fn compute_op(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TV],
        outputs: &[&TV],
    ) -> Result<(), BackendError> {
        let [out] = outputs else {
            return Err(BackendError::Invalid(format!(
                "{} has one output",
                op.name()
            )));
        };
        let (want, _) = op.arity();
        if inputs.len() != want {
            return Err(shape_err(
                op.name(),
                format!("takes {want} inputs, got {}", inputs.len()),
            )
            .into());
        }
        match op {
            ComputeOp::Linear => self.gemm("linear", inputs[0], inputs[1], out, Form::Linear),
            ComputeOp::LinearAccumulate => self.gemm(
                "linear_accumulate",
                inputs[0],
                inputs[1],
                out,
                Form::LinearAccumulate,
            ),
            ComputeOp::Matmul => self.gemm("matmul", inputs[0], inputs[1], out, Form::Matmul),
            ComputeOp::GroupedMatmul => self.grouped_matmul(inputs[0], inputs[1], inputs[2], out),
            ComputeOp::Add => self.binary(BinaryOp::Add, "add", inputs[0], inputs[1], out),
            ComputeOp::Sub => self.binary(BinaryOp::Sub, "sub", inputs[0], inputs[1], out),
            ComputeOp::Mul => self.binary(BinaryOp::Mul, "mul", inputs[0], inputs[1], out),
            ComputeOp::Gelu => self.unary(UnaryOp::GeluTanh, "gelu", inputs[0], out),
            ComputeOp::Silu => self.unary(UnaryOp::Silu, "silu", inputs[0], out),
            ComputeOp::Sum { axis } => self.sum(inputs[0], *axis, out),
            ComputeOp::Cast => {
                expect_shape("cast", "the output", &out.shape, &inputs[0].shape)?;
                self.convert("cast", inputs[0], out)
            }
            ComputeOp::Copy => self.copy(inputs[0], out),
            ComputeOp::Permute { perm } => self.permute(inputs[0], perm, out),
            ComputeOp::Max { .. }
            | ComputeOp::Min { .. }
            | ComputeOp::Avg { .. }
            | ComputeOp::Softmax { .. }
            | ComputeOp::RmsNorm { .. }
            | ComputeOp::Expand
            | ComputeOp::Slice { .. }
            | ComputeOp::Cat { .. } => self.layout_or_row_op(op, inputs, out),
        }
    }

    /// `out = a @ b` (`b` `[K, N]` or batched `[B.., K, N]`), `out = a @ b^T` (`linear`, `b`
    /// `[N, K]`) or `out += a @ b^T` (`linear_accumulate`: cuBLAS with `beta = 1` and
    /// `C = D = out`, the product and the add in `f32`, one rounding), with `a` `[B.., M, K]`.
    fn gemm(
        &mut self,
        op: &'static str,
        a: &TV,
        b: &TV,
        out: &TV,
        form: Form,
    ) -> Result<(), BackendError> {
        let linear = matches!(form, Form::Linear | Form::LinearAccumulate);
        let accumulate = matches!(form, Form::LinearAccumulate);
        let (sa, sb) = (&a.shape, &b.shape);
        if sa.len() < 2 || sb.len() < 2 {
            return Err(shape_err(
                op,
                format!("operands need at least 2 axes, have {sa:?} and {sb:?}"),
            )
            .into());
        }
        let nb = sa.len() - 2;
        let (m, k) = (sa[nb], sa[nb + 1]);
        let batch: u64 = sa[..nb].iter().product();
        let (kb, n, b_batched) = if linear {
            if sb.len() != 2 {
                return Err(shape_err(op, format!("weight must be [N, K], has {sb:?}")).into());
            }
            (sb[1], sb[0], false)
        } else if sb.len() == 2 {
            (sb[0], sb[1], false)
        } else if sb[..sb.len() - 2] == sa[..nb] {
            (sb[sb.len() - 2], sb[sb.len() - 1], true)
        } else {
            return Err(shape_err(op, format!("batch axes differ: {sa:?} and {sb:?}")).into());
        };
        if k != kb {
            return Err(
                shape_err(op, format!("contraction extents differ: {sa:?} and {sb:?}")).into(),
            );
        }
        let mut want = sa[..nb].to_vec();
        want.extend([m, n]);
        expect_shape(op, "the output", &out.shape, &want)?;
        if a.dtype != b.dtype || !gemm_out_ok(a.dtype, out.dtype) || !a.dtype.is_float() {
            return Err(shape_err(
                op,
                format!(
                    "unsupported types {} x {} -> {}",
                    a.dtype, b.dtype, out.dtype
                ),
            )
            .into());
        }
        let (m, n, k, batch) = (to_usize(m)?, to_usize(n)?, to_usize(k)?, to_usize(batch)?);
        let av = self.input_region(a)?;
        let bv = self.input_region(b)?;
        let slot = if accumulate {
            self.accumulator_slot(out, &[a, b])?
        } else {
            self.output_slot(out, &[a, b])?
        };
        let mut g = if linear {
            // The shared weight lets the batch fold into the rows.
            Gemm::linear(m * batch, n, k, kdtype(a.dtype))
        } else if b_batched {
            Gemm::new(m, n, k, kdtype(a.dtype)).batched(batch)
        } else {
            Gemm::new(m * batch, n, k, kdtype(a.dtype))
        };
        g.out_dtype = kdtype(out.dtype);
        g.allow_tf32 = false;
        if accumulate {
            g.beta = 1.0;
        }
        g.run(self.stream(), &av, &bv, &slot.buf)
            .map_err(self.err(op))?;
        self.finish_output(slot)
    }

    /// `out[b, e] = expert_x[b, e] @ w[e]` over all C rows of every expert: rows past an
    /// expert's count are zero in `expert_x` (dispatch writes them so), so their outputs are
    /// zero too, and the counts never need to be read on the host.
    fn grouped_matmul(
        &mut self,
        x: &TV,
        counts: &TV,
        w: &TV,
        out: &TV,
    ) -> Result<(), BackendError> {
        const OP: &str = "grouped_matmul";
        let sx = &x.shape;
        if sx.len() < 3 {
            return Err(
                shape_err(OP, format!("expert_x must be [B.., E, C, H], has {sx:?}")).into(),
            );
        }
        let nb = sx.len() - 3;
        let (e, c, h) = (sx[nb], sx[nb + 1], sx[nb + 2]);
        let mut want = sx[..nb].to_vec();
        want.push(e);
        expect_shape(OP, "expert_counts", &counts.shape, &want)?;
        let sw = &w.shape;
        if sw.len() != 3 || sw[0] != e || sw[1] != h {
            return Err(shape_err(
                OP,
                format!("weights must be [E={e}, H={h}, F], have {sw:?}"),
            )
            .into());
        }
        let f = sw[2];
        want.extend([c, f]);
        expect_shape(OP, "the output", &out.shape, &want)?;
        if x.dtype != w.dtype || !gemm_out_ok(x.dtype, out.dtype) || !x.dtype.is_float() {
            return Err(shape_err(
                OP,
                format!(
                    "unsupported types {} x {} -> {}",
                    x.dtype, w.dtype, out.dtype
                ),
            )
            .into());
        }
        let outer = to_usize(sx[..nb].iter().product())?;
        let (e, c, h, f) = (to_usize(e)?, to_usize(c)?, to_usize(h)?, to_usize(f)?);
        let xv = self.input_region(x)?;
        let wv = self.input_region(w)?;
        let slot = self.output_slot(out, &[x, w])?;
        let (xs, os) = (kdtype(x.dtype).size_bytes(), kdtype(out.dtype).size_bytes());
        for b in 0..outer {
            let xb = xv
                .view(b * e * c * h * xs, e * c * h * xs)
                .map_err(self.err(OP))?;
            let ob = slot
                .buf
                .view(b * e * c * f * os, e * c * f * os)
                .map_err(self.err(OP))?;
            let mut g = Gemm::new(c, f, h, kdtype(x.dtype)).batched(e);
            g.out_dtype = kdtype(out.dtype);
            g.allow_tf32 = false;
            g.run(self.stream(), &xb, &wv, &ob).map_err(self.err(OP))?;
        }
        self.finish_output(slot)
    }

    fn binary(
        &mut self,
        op: BinaryOp,
        name: &'static str,
        a: &TV,
        b: &TV,
        out: &TV,
    ) -> Result<(), BackendError> {
        expect_shape(name, "the second input", &b.shape, &a.shape)?;
        expect_shape(name, "the output", &out.shape, &a.shape)?;
        if a.dtype != b.dtype || a.dtype != out.dtype {
            return Err(shape_err(
                name,
                format!("mixed types {}, {} -> {}", a.dtype, b.dtype, out.dtype),
            )
            .into());
        }
        let av = self.input_region(a)?;
        let bv = self.input_region(b)?;
        let slot = self.output_slot(out, &[a, b])?;
        self.kernels
            .binary(self.stream(), op, kdtype(a.dtype), &av, &bv, &slot.buf)
            .map_err(self.err(name))?;
        self.finish_output(slot)
    }

    fn unary(
        &mut self,
        op: UnaryOp,
        name: &'static str,
        x: &TV,
        out: &TV,
    ) -> Result<(), BackendError> {
        expect_shape(name, "the output", &out.shape, &x.shape)?;
        let xv = self.input_region(x)?;
        let slot = self.output_slot(out, &[x])?;
        if x.dtype != out.dtype {
            return Err(shape_err(name, format!("{} input, {} output", x.dtype, out.dtype)).into());
        }
        self.kernels
            .unary(self.stream(), op, kdtype(x.dtype), &xv, &slot.buf)
            .map_err(self.err(name))?;
        self.finish_output(slot)
    }

    fn sum(&mut self, x: &TV, axis: usize, out: &TV) -> Result<(), BackendError> {
        let s = &x.shape;
        if axis >= s.len() {
            return Err(shape_err("sum", format!("axis {axis} out of range for {s:?}")).into());
        }
        let mut want = s.clone();
        want.remove(axis);
        expect_shape("sum", "the output", &out.shape, &want)?;
        let shape = s
            .iter()
            .map(|&v| to_usize(v))
            .collect::<Result<Vec<_>, _>>()?;
        let xv = self.input_region(x)?;
        let slot = self.output_slot(out, &[x])?;
        self.kernels
            .sum_axis(
                self.stream(),
                kdtype(x.dtype),
                &xv,
                &shape,
                axis,
                &slot.buf,
                kdtype(out.dtype),
            )
            .map_err(self.err("sum"))?;
        self.finish_output(slot)
    }

    /// `out = x` converted element by element (same number of elements, row-major order).
    fn convert(&mut self, name: &'static str, x: &TV, out: &TV) -> Result<(), BackendError> {
        if x.numel() != out.numel() {
            return Err(
                shape_err(name, format!("{} elements into {}", x.numel(), out.numel())).into(),
            );
        }
        let xv = self.input_region(x)?;
        let slot = self.output_slot(out, &[x])?;
        self.kernels
            .cast(
                self.stream(),
                &xv,
                kdtype(x.dtype),
                &slot.buf,
                kdtype(out.dtype),
            )
            .map_err(self.err(name))?;
        self.finish_output(slot)
    }

    fn copy(&mut self, x: &TV, out: &TV) -> Result<(), BackendError> {
        if x.dtype != out.dtype || x.shape != out.shape || x.buffer == out.buffer {
            // Reshaping, converting or overlapping copies go through packed bytes.
            return self.convert("copy", x, out);
        }
        let src = self.backing(x)?;
        let dst = self.backing(out)?;
        let l = fold(
            &x.shape,
            &[&x.strides, &out.strides],
            &[x.offset, out.offset],
        )
        .map_err(BackendError::Invalid)?;
        self.kernels
            .strided_copy(self.stream(), kdtype(x.dtype), &src, &l[0], &dst, &l[1])
            .map_err(self.err("copy"))
    }

    fn permute(&mut self, x: &TV, perm: &[usize], out: &TV) -> Result<(), BackendError> {
        let rank = x.shape.len();
        let mut seen = vec![false; rank];
        let ok = perm.len() == rank
            && perm
                .iter()
                .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
        if !ok {
            return Err(shape_err(
                "permute",
                format!("{perm:?} is not a permutation of {rank} axes"),
            )
            .into());
        }
        let shape: Vec<u64> = perm.iter().map(|&p| x.shape[p]).collect();
        let strides: Vec<u64> = perm.iter().map(|&p| x.strides[p]).collect();
        expect_shape("permute", "the output", &out.shape, &shape)?;
        if x.dtype != out.dtype {
            return Err(shape_err(
                "permute",
                format!("{} input, {} output", x.dtype, out.dtype),
            )
            .into());
        }
        let view = TensorView {
            tensor: x.tensor,
            buffer: x.buffer,
            dtype: x.dtype,
            offset: x.offset,
            shape,
            strides,
        };
        if x.buffer == out.buffer {
            let packed = self.packed_copy(&view)?;
            return self.unstage(&packed, out);
        }
        self.copy(&view, out)
    }

    /// Calls a registered kernel: packed inputs, outputs (through temporaries when strided),
    /// then the scalar arguments.
    pub(super) fn call_user(
        &mut self,
        k: &UserKernel,
        def: &KernelDef,
        inputs: &[&TV],
        outputs: &[&TV],
        args: &[i64],
    ) -> Result<(), BackendError> {
        let ins = inputs
            .iter()
            .map(|v| self.input_region(v))
            .collect::<Result<Vec<_>, _>>()?;
        let mut slots = Vec::with_capacity(outputs.len());
        for o in outputs {
            slots.push(self.output_slot(o, inputs)?);
        }
        let in_shapes: Vec<&[u64]> = inputs.iter().map(|v| v.shape.as_slice()).collect();
        let out_shapes: Vec<&[u64]> = outputs.iter().map(|v| v.shape.as_slice()).collect();
        let dims = (def.dims)(&in_shapes, &out_shapes, args);
        let mut params: Vec<KernelArg<'_>> =
            Vec::with_capacity(ins.len() + slots.len() + args.len());
        params.extend(ins.iter().map(KernelArg::Buffer));
        params.extend(slots.iter().map(|s| KernelArg::Buffer(&s.buf)));
        params.extend(args.iter().map(|&a| KernelArg::I64(a)));
        k.call(
            self.stream(),
            dims.grid,
            dims.block,
            dims.shared_mem_bytes,
            &params,
        )
        .map_err(|e| BackendError::Kernel {
            name: def.name.clone(),
            message: format!("rank {}: {e}", self.rank),
        })?;
        drop(params);
        for s in slots {
            self.finish_output(s)?;
        }
        Ok(())
    }
}
