//! Partial-result kinds and DTensor-style placement lists, for lowering and for messages.
//!
//! A tensor split over devices on a reduction axis holds partial results. Their kind is the
//! reduction of the op that made them: `max`/`min`/`avg` give max/min/avg partials, every other
//! reducing op (`sum`, `matmul`, `linear`, `grouped_matmul`) and a partial program input give
//! partial sums; a `set` that keeps the reduction axes keeps its input's kind.
//!
//! [`placements_text`] writes a tensor's placement as DTensor does, one entry per mesh axis,
//! outermost first: `S(k)` (split on value axis `k`), `P(sum)` (partial), `R` (replicated);
//! `[S(0), P(sum)]` on a 2-D mesh is rows split along DIDy and partial sums along DIDx.

use meshflow_ir::host::ReduceOp;
use meshflow_ir::{OpKind, ParallelType, Program, TensorId};

use crate::analysis::Sharding;
use crate::decision::{placements, Placement};

/// The kind of the partial results `t` holds (see the module docs).
pub fn partial_kind(program: &Program, t: TensorId) -> ReduceOp {
    let mut t = t;
    // A chain of sets is at most as long as the program.
    for _ in 0..=program.ops.len() {
        let Some(def) = program.definition(t) else {
            return ReduceOp::Sum;
        };
        let op = &program.ops[def];
        match op.kind {
            OpKind::Max { .. } => return ReduceOp::Max,
            OpKind::Min { .. } => return ReduceOp::Min,
            OpKind::Avg { .. } => return ReduceOp::Avg,
            OpKind::Set => match op.inputs.first() {
                Some(&x) => t = x,
                None => return ReduceOp::Sum,
            },
            _ => return ReduceOp::Sum,
        }
    }
    ReduceOp::Sum
}

/// `[S(0), P(sum)]`: the placement of `t` along each axis of its mesh, outermost first.
pub fn placements_text(program: &Program, t: TensorId) -> String {
    let Ok(sh) = Sharding::of(program, t) else {
        return "[?]".into();
    };
    let Some(mesh) = program.meshes.get(sh.mesh).map(|m| &m.mesh) else {
        return "[?]".into();
    };
    let pl = placements(&sh);
    let kind = partial_kind(program, t).name();
    let entries: Vec<String> = (0..mesh.ndims())
        .map(|axis| {
            let pt = ParallelType::DEVICE
                .into_iter()
                .find(|&pt| mesh.axis_of(pt) == Some(axis));
            match pt.and_then(|pt| pl.get(&pt)) {
                Some(Placement::Split { axis, .. }) => format!("S({axis})"),
                Some(Placement::Partial) => format!("P({kind})"),
                None => "R".into(),
            }
        })
        .collect();
    format!("[{}]", entries.join(", "))
}

/// "`x` f32[2, 8, 24] with placements [R, S(2)] on `m`", for messages.
pub fn describe(program: &Program, t: TensorId) -> String {
    let Some(d) = program.tensors.get(t) else {
        return format!("{t:?}");
    };
    let mesh = program
        .meshes
        .get(d.mesh)
        .map_or_else(|| "?".to_string(), |m| m.name.clone());
    format!(
        "`{}` {} with placements {} on `{mesh}`",
        d.name,
        d.ty,
        placements_text(program, t)
    )
}
