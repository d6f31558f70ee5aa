//! Whether the reduce-scatter ring of a `set` can accumulate in place: each step's chunk GEMM
//! adds onto the running sum received from rank − 1 (`linear_accumulate`) instead of
//! computing a separate part and adding the two.

use meshflow_ir::{OpKind, Program};

/// True when the ring of the reducing `set` at op `set` can accumulate in place: its input
/// (the partial sums) is computed by a `linear` right before it, read by this `set` alone and
/// not an output, and the linear's operands, the partial sums and the result are of one
/// floating-point dtype (the accumulating GEMM reads and writes the result's buffer in the
/// operands' type). Otherwise the ring computes each part and adds it to the running sum.
pub fn accumulates_in_place(program: &Program, set: usize) -> bool {
    let Some(op) = program.ops.get(set) else {
        return false;
    };
    let (Some(&p), Some(&z)) = (op.inputs.first(), op.outputs.first()) else {
        return false;
    };
    let Some(producer) = set.checked_sub(1).and_then(|u| program.ops.get(u)) else {
        return false;
    };
    if op.kind != OpKind::Set
        || producer.kind != OpKind::Linear
        || producer.outputs != [p]
        || program.uses(p) != [set]
        || program.outputs.contains(&p)
    {
        return false;
    }
    let dtype = |t| program.tensors.get(t).map(|d| d.ty.dtype);
    let Some(want) = dtype(z) else {
        return false;
    };
    want.is_float()
        && producer
            .inputs
            .iter()
            .chain([&p])
            .all(|&t| dtype(t) == Some(want))
}
