//! The level-1 reference: an interpreter of a [`Program`] on full (unsharded) tensors.
//!
//! Every op is evaluated on logical tensors with the CPU kernels of
//! [`cpu_ops`]. Reduction axes are dropped from values (a consumer sees only
//! the non-reduction axes). `moe_dispatch` orders each expert's rows by ascending `(token, k)`
//! and numbers tokens globally; a capacity overflow is an error naming the expert.
//!
//! A `custom` op runs the closure registered under its kernel name in the [`SimKernels`] given
//! to [`evaluate_with`] — the same closure the CPU backend launches on chunks, here called once
//! on the full tensors (a custom op is chunk-wise by contract, so both agree), with the op's
//! `args` followed by the full output shape. [`evaluate`] has no kernels: a program with a
//! `custom` op is an error there ([`ReferenceError::NoKernel`]).
//!
//! The shape ops, `max`/`min`/`avg`, `softmax`, `rms_norm`, `matmul` and partial program
//! inputs are evaluated by the naive `reference_ops` module instead. A partial program input
//! (an input with reduction axes) is supplied with its reduction axes; its value is the sum
//! over them.

use std::collections::BTreeMap;

use meshflow_ir::{EntityRef, OpKind, Program, TensorId};

use super::cpu_ops::{self, Binary, OpError, Unary};
use super::data::TensorData;
use super::sim::SimKernels;
use super::view::{View, ViewMut};

/// Why the reference could not evaluate a program.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// A program input was not supplied.
    #[error("input `{0}` was not supplied")]
    MissingInput(String),
    /// A supplied input has the wrong type.
    #[error("input `{name}` must be {expected}, got {actual}")]
    InputType {
        /// The input.
        name: String,
        /// The declared value type.
        expected: String,
        /// The supplied type.
        actual: String,
    },
    /// An op reads a tensor that no earlier op defined.
    #[error("`{op}` reads `{tensor}` before it is defined")]
    Undefined {
        /// The op, printed.
        op: String,
        /// The tensor.
        tensor: String,
    },
    /// An op has the wrong number of operands.
    #[error("`{op}` has the wrong number of operands")]
    Arity {
        /// The op, printed.
        op: String,
    },
    /// A `custom` op's kernel is not among the reference kernels.
    #[error(
        "`{op}`: no reference kernel `{kernel}` (register it in the kernels given to \
         `evaluate_with`)"
    )]
    NoKernel {
        /// The op, printed.
        op: String,
        /// The kernel name.
        kernel: String,
    },
    /// A `custom` op's reference kernel failed.
    #[error("`{op}`: {message}")]
    Kernel {
        /// The op, printed.
        op: String,
        /// The kernel's message.
        message: String,
    },
    /// A kernel failed.
    #[error("`{op}`: {source}")]
    Op {
        /// The op, printed.
        op: String,
        /// The kernel error.
        source: OpError,
    },
}

fn value_type(program: &Program, t: TensorId) -> (meshflow_ir::DType, Vec<u64>) {
    let ty = &program.tensors[t].ty;
    (ty.dtype, ty.value_shape())
}

fn op_text(program: &Program, op: &meshflow_ir::Op) -> String {
    let names = |ids: &[TensorId]| -> String {
        ids.iter()
            .map(|&t| program.tensors[t].name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let kernel = match &op.kind {
        OpKind::Custom(c) => format!(", kernel=\"{}\"", c.kernel.escape_default()),
        _ => String::new(),
    };
    format!(
        "{} = {}({}{kernel})",
        names(&op.outputs),
        op.kind.name(),
        names(&op.inputs)
    )
}

/// Evaluates `program` on full input tensors (by name) and returns its outputs by name.
pub fn evaluate(
    program: &Program,
    inputs: &BTreeMap<String, TensorData>,
) -> Result<BTreeMap<String, TensorData>, ReferenceError> {
    evaluate_with(program, inputs, &SimKernels::new())
}

/// [`evaluate`], with `kernels` computing the `custom` ops (see the module docs).
pub fn evaluate_with(
    program: &Program,
    inputs: &BTreeMap<String, TensorData>,
    kernels: &SimKernels,
) -> Result<BTreeMap<String, TensorData>, ReferenceError> {
    let mut values: Vec<Option<TensorData>> = vec![None; program.tensors.len()];
    for t in program.inputs() {
        let decl = &program.tensors[t];
        let data = inputs
            .get(&decl.name)
            .ok_or_else(|| ReferenceError::MissingInput(decl.name.clone()))?;
        // A partial input comes with its reduction axes (see `reference_ops`).
        let (dtype, shape) = (
            decl.ty.dtype,
            decl.ty.axes.iter().map(|a| a.extent).collect::<Vec<_>>(),
        );
        if data.dtype() != dtype || data.shape() != shape.as_slice() {
            let expected = format!("{dtype}{shape:?}");
            return Err(ReferenceError::InputType {
                name: decl.name.clone(),
                expected,
                actual: data.type_string(),
            });
        }
        values[t.index()] = Some(if decl.ty.axes.iter().any(|a| a.reduction) {
            super::reference_ops::reduce_partial_input(data, &decl.ty).map_err(|message| {
                ReferenceError::Kernel {
                    op: format!("input {}", decl.name),
                    message,
                }
            })?
        } else {
            data.clone()
        });
    }
    for op in &program.ops {
        let text = op_text(program, op);
        let (n_in, n_out) = op.kind.arity();
        if op.inputs.len() != n_in || op.outputs.len() != n_out {
            return Err(ReferenceError::Arity { op: text });
        }
        let mut outs: Vec<TensorData> = Vec::with_capacity(n_out);
        for &o in &op.outputs {
            let (dtype, shape) = value_type(program, o);
            let t = TensorData::zeros(dtype, &shape).map_err(|e| ReferenceError::Op {
                op: text.clone(),
                source: cpu_ops::shape_err("allocate", e.to_string()),
            })?;
            outs.push(t);
        }
        let data: Option<Vec<&TensorData>> = op
            .inputs
            .iter()
            .map(|&i| values[i.index()].as_ref())
            .collect();
        if let (Some(data), [o]) = (&data, op.outputs.as_slice()) {
            if let Some(r) = super::reference_ops::evaluate(&op.kind, data, &program.tensors[*o].ty)
            {
                let v = r.map_err(|message| ReferenceError::Kernel {
                    op: text.clone(),
                    message,
                })?;
                values[o.index()] = Some(v);
                continue;
            }
        }
        {
            let ins: Vec<View<'_>> = op
                .inputs
                .iter()
                .map(|&i| {
                    values[i.index()].as_ref().map(View::of).ok_or_else(|| {
                        ReferenceError::Undefined {
                            op: text.clone(),
                            tensor: program.tensors[i].name.clone(),
                        }
                    })
                })
                .collect::<Result<_, _>>()?;
            if let OpKind::Custom(c) = &op.kind {
                run_custom(c, kernels, &ins, &mut outs, &text)?;
            } else {
                run_op(&op.kind, &ins, &mut outs).map_err(|source| ReferenceError::Op {
                    op: text.clone(),
                    source,
                })?;
            }
        }
        for (&o, data) in op.outputs.iter().zip(outs) {
            values[o.index()] = Some(data);
        }
    }
    let mut result = BTreeMap::new();
    for &o in &program.outputs {
        let name = program.tensors[o].name.clone();
        let data = values[o.index()]
            .take()
            .or_else(|| inputs.get(&name).cloned())
            .ok_or_else(|| ReferenceError::Undefined {
                op: "output".into(),
                tensor: name.clone(),
            })?;
        result.insert(name, data);
    }
    Ok(result)
}

fn run_custom(
    op: &meshflow_ir::CustomOp,
    kernels: &SimKernels,
    ins: &[View<'_>],
    outs: &mut [TensorData],
    text: &str,
) -> Result<(), ReferenceError> {
    let kernel = kernels
        .get(&op.kernel)
        .ok_or_else(|| ReferenceError::NoKernel {
            op: text.to_string(),
            kernel: op.kernel.clone(),
        })?;
    let mut args = op.args.clone();
    if let Some(first) = outs.first() {
        args.extend(first.shape().iter().map(|&e| e as i64));
    }
    let mut views: Vec<ViewMut<'_>> = outs.iter_mut().map(ViewMut::of).collect();
    kernel(ins, &mut views, &args).map_err(|message| ReferenceError::Kernel {
        op: text.to_string(),
        message,
    })
}

fn run_op(kind: &OpKind, ins: &[View<'_>], outs: &mut [TensorData]) -> Result<(), OpError> {
    let [first, rest @ ..] = outs else {
        return Err(cpu_ops::shape_err(kind.name(), "no output"));
    };
    let mut out = ViewMut::of(first);
    match kind {
        OpKind::Set => cpu_ops::copy(&ins[0], &mut out),
        OpKind::Matmul => cpu_ops::matmul(&ins[0], &ins[1], &mut out),
        OpKind::Linear => cpu_ops::linear(&ins[0], &ins[1], &mut out),
        OpKind::Add => cpu_ops::binary(Binary::Add, &ins[0], &ins[1], &mut out),
        OpKind::Sub => cpu_ops::binary(Binary::Sub, &ins[0], &ins[1], &mut out),
        OpKind::Mul => cpu_ops::binary(Binary::Mul, &ins[0], &ins[1], &mut out),
        OpKind::Gelu => cpu_ops::unary(Unary::Gelu, &ins[0], &mut out),
        OpKind::Silu => cpu_ops::unary(Unary::Silu, &ins[0], &mut out),
        OpKind::Sum { axis } => cpu_ops::sum(&ins[0], *axis, &mut out),
        OpKind::Cast => cpu_ops::cast(&ins[0], &mut out),
        OpKind::GroupedMatmul => cpu_ops::grouped_matmul(&ins[0], &ins[1], &ins[2], &mut out),
        OpKind::MoeCombine => cpu_ops::moe_combine(&ins[0], &ins[1], &ins[2], &ins[3], &mut out),
        OpKind::Custom(c) => Err(cpu_ops::shape_err(
            "custom",
            format!("kernel `{}` runs through `run_custom`", c.kernel),
        )),
        OpKind::MoeDispatch => {
            let [counts, routing] = rest else {
                return Err(cpu_ops::shape_err("moe_dispatch", "needs three outputs"));
            };
            cpu_ops::moe_dispatch(
                &ins[0],
                &ins[1],
                &mut out,
                &mut ViewMut::of(counts),
                &mut ViewMut::of(routing),
            )
        }
        other => Err(cpu_ops::shape_err(
            other.name(),
            "evaluated by the reference's own module (reference_ops)",
        )),
    }
}
