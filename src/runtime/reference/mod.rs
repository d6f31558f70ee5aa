//! The level-1 reference: an interpreter of a [`Program`] on full (unsharded) tensors,
//! independent of the kernels it judges.
//!
//! Every op is evaluated by the naive code of the `ops` and `moe` submodules (plain loops,
//! `f64` accumulation, one rounding to the output's element type per op), which shares nothing
//! with the backends' kernels in [`cpu_ops`](crate::runtime::cpu_ops): a kernel bug shows up as
//! a mismatch instead of cancelling out. Reduction axes are dropped from values (a consumer
//! sees only the non-reduction axes). `moe_dispatch` orders each expert's rows by ascending
//! `(token, k)` and applies its wire (the `fp8` submodule: FP8 quantization and dequantization
//! of each token, exactly as the `meshflow_ir::moe` docs define it); a capacity overflow is an
//! error naming the expert.
//!
//! A `custom` op runs the closure registered under its kernel name in the [`CpuKernels`] given
//! to [`evaluate_with`] — the embedder's own kernel, called once on the full tensors (a custom
//! op is chunk-wise by contract), with the op's `args` followed by the full output shape.
//! [`evaluate`] has no kernels: a program with a `custom` op is an error there
//! ([`ReferenceError::NoKernel`]).
//!
//! [`output_precision`] tells how precise each output can be: the least precise float type
//! its value passed through (a `bf16` product cast to `f32` carries `bf16` error), which is
//! what the comparison's tolerance follows ([`tolerance`](crate::runtime::compare::tolerance)).

mod dense;
mod fp8;
mod moe;
mod ops;

use std::collections::BTreeMap;

use meshflow_ir::{DType, EntityRef, OpKind, Program, TensorId};

use super::cpu::CpuKernels;
use super::data::TensorData;
use super::view::{View, ViewMut};
use dense::Dense;

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
    /// An op could not be evaluated (shapes that do not fit, invalid routing, an overflowing
    /// expert).
    #[error("`{op}`: {message}")]
    Op {
        /// The op, printed.
        op: String,
        /// What is wrong.
        message: String,
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
    evaluate_with(program, inputs, &CpuKernels::new())
}

/// [`evaluate`], with `kernels` computing the `custom` ops (see the module docs).
pub fn evaluate_with(
    program: &Program,
    inputs: &BTreeMap<String, TensorData>,
    kernels: &CpuKernels,
) -> Result<BTreeMap<String, TensorData>, ReferenceError> {
    let mut values: Vec<Option<Dense>> = vec![None; program.tensors.len()];
    for t in program.inputs() {
        let decl = &program.tensors[t];
        let data = inputs
            .get(&decl.name)
            .ok_or_else(|| ReferenceError::MissingInput(decl.name.clone()))?;
        // A partial input comes with its reduction axes; its value is the sum over them
        // (`reference_ops`).
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
            let value =
                super::reference_ops::reduce_partial_input(data, &decl.ty).map_err(|message| {
                    ReferenceError::Kernel {
                        op: format!("input {}", decl.name),
                        message,
                    }
                })?;
            Dense::from_data(&value)
        } else {
            Dense::from_data(data)
        });
    }
    for op in &program.ops {
        let text = op_text(program, op);
        let (n_in, n_out) = op.kind.arity();
        if op.inputs.len() != n_in || op.outputs.len() != n_out {
            return Err(ReferenceError::Arity { op: text });
        }
        let ins: Vec<&Dense> = op
            .inputs
            .iter()
            .map(|&i| {
                values[i.index()]
                    .as_ref()
                    .ok_or_else(|| ReferenceError::Undefined {
                        op: text.clone(),
                        tensor: program.tensors[i].name.clone(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let outs: Vec<(DType, Vec<u64>)> =
            op.outputs.iter().map(|&o| value_type(program, o)).collect();
        // The shape ops, `max`/`min`/`avg`, `softmax`, `rms_norm` and broadcasting `matmul`
        // have their own naive module.
        if let ([o], false) = (op.outputs.as_slice(), ops::handles(&op.kind)) {
            let data: Vec<TensorData> = ins
                .iter()
                .map(|d| d.to_data())
                .collect::<Result<_, _>>()
                .map_err(|message| ReferenceError::Op {
                op: text.clone(),
                message,
            })?;
            let refs: Vec<&TensorData> = data.iter().collect();
            let ty = &program.tensors[*o].ty;
            if let Some(r) = super::reference_ops::evaluate(&op.kind, &refs, ty) {
                let v = r.map_err(|message| ReferenceError::Kernel {
                    op: text.clone(),
                    message,
                })?;
                values[o.index()] = Some(Dense::from_data(&v));
                continue;
            }
        }
        let results = match &op.kind {
            OpKind::Custom(c) => run_custom(c, kernels, &ins, &outs, &text)?,
            kind => ops::run(kind, &ins, &outs).map_err(|message| ReferenceError::Op {
                op: text.clone(),
                message,
            })?,
        };
        for (&o, data) in op.outputs.iter().zip(results) {
            values[o.index()] = Some(data);
        }
    }
    let mut result = BTreeMap::new();
    for &o in &program.outputs {
        let name = program.tensors[o].name.clone();
        let data = match values[o.index()].take() {
            Some(d) => d.to_data().map_err(|message| ReferenceError::Op {
                op: "output".into(),
                message,
            })?,
            None => inputs
                .get(&name)
                .cloned()
                .ok_or_else(|| ReferenceError::Undefined {
                    op: "output".into(),
                    tensor: name.clone(),
                })?,
        };
        result.insert(name, data);
    }
    Ok(result)
}

/// Least precise first: the float types ordered by how much rounding error one value of
/// them carries (`bf16`: 8 significant bits, `f16`: 11, `f32`: 24).
fn less_precise(a: DType, b: DType) -> DType {
    let rank = |d: DType| match d {
        DType::BF16 => 0,
        DType::F16 => 1,
        _ => 2,
    };
    if rank(a) <= rank(b) {
        a
    } else {
        b
    }
}

/// Per program output (by name), the least precise float type its value passed through: its
/// own type, or that of any float tensor it was computed from, transitively. Integer
/// outputs are listed with their own type.
pub fn output_precision(program: &Program) -> BTreeMap<String, DType> {
    let mut precision: Vec<Option<DType>> = program
        .tensors
        .values()
        .map(|t| t.ty.dtype.is_float().then_some(t.ty.dtype))
        .collect();
    for op in &program.ops {
        let from = op
            .inputs
            .iter()
            .filter_map(|i| precision.get(i.index()).copied().flatten())
            .reduce(less_precise);
        for o in &op.outputs {
            if let (Some(slot), Some(from)) = (precision.get_mut(o.index()), from) {
                if let Some(own) = *slot {
                    *slot = Some(less_precise(own, from));
                }
            }
        }
    }
    program
        .outputs
        .iter()
        .map(|&o| {
            let t = &program.tensors[o];
            let p = precision
                .get(o.index())
                .copied()
                .flatten()
                .unwrap_or(t.ty.dtype);
            (t.name.clone(), p)
        })
        .collect()
}

fn run_custom(
    op: &meshflow_ir::CustomOp,
    kernels: &CpuKernels,
    ins: &[&Dense],
    outs: &[(DType, Vec<u64>)],
    text: &str,
) -> Result<Vec<Dense>, ReferenceError> {
    let kernel = kernels
        .get(&op.kernel)
        .ok_or_else(|| ReferenceError::NoKernel {
            op: text.to_string(),
            kernel: op.kernel.clone(),
        })?;
    let failed = |message: String| ReferenceError::Kernel {
        op: text.to_string(),
        message,
    };
    let in_data: Vec<TensorData> = ins
        .iter()
        .map(|d| d.to_data())
        .collect::<Result<_, _>>()
        .map_err(failed)?;
    let mut out_data: Vec<TensorData> = outs
        .iter()
        .map(|(dtype, shape)| TensorData::zeros(*dtype, shape).map_err(|e| failed(e.to_string())))
        .collect::<Result<_, _>>()?;
    let mut args = op.args.clone();
    if let Some((_, shape)) = outs.first() {
        args.extend(shape.iter().map(|&e| e as i64));
    }
    {
        let views: Vec<View<'_>> = in_data.iter().map(View::of).collect();
        let mut muts: Vec<ViewMut<'_>> = out_data.iter_mut().map(ViewMut::of).collect();
        kernel(&views, &mut muts, &args).map_err(failed)?;
    }
    Ok(out_data.iter().map(Dense::from_data).collect())
}
