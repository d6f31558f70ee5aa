//! Small helpers to edit level-1 programs.

use std::collections::BTreeMap;

use meshflow_ir::span::SourceLoc;
use meshflow_ir::{MeshId, Op, OpKind, ParallelType, Program, TensorDecl, TensorId, TensorType};

use crate::analysis::{AxisSplit, Spec};
use crate::decision::Placement;
use crate::error::PassError;

/// The declaration of `t` (an error naming the handle when it is out of range).
pub fn decl(program: &Program, t: TensorId) -> Result<&TensorDecl, PassError> {
    program
        .tensors
        .get(t)
        .ok_or_else(|| PassError::internal("edit", format!("unknown tensor {t:?}")))
}

/// Adds a (non-input) tensor called after `base` with an explicit schedule.
pub fn add_tensor(
    program: &mut Program,
    base: &str,
    ty: TensorType,
    mesh: MeshId,
    spec: &Spec,
) -> TensorId {
    let name = program.fresh_tensor_name(base);
    program.tensors.push(TensorDecl {
        name,
        ty,
        mesh,
        schedule: Some(spec.to_transforms()),
        is_input: false,
        loc: SourceLoc::NONE,
    })
}

/// Inserts `output = set(input)` at op index `at`.
pub fn insert_set(program: &mut Program, at: usize, input: TensorId, output: TensorId) {
    program.ops.insert(
        at.min(program.ops.len()),
        Op {
            kind: OpKind::Set,
            inputs: vec![input],
            outputs: vec![output],
            loc: SourceLoc::NONE,
        },
    );
}

/// The value type of `ty` (reduction axes dropped): what a `set` of it produces.
pub fn value_type(ty: &TensorType) -> TensorType {
    TensorType::new(ty.dtype, &ty.value_shape())
}

/// A spec over value axes built from placements (which must not be partial) plus a Stream split.
pub fn spec_from_placements(placements: &BTreeMap<ParallelType, Placement>) -> Option<Spec> {
    let mut spec = Spec::default();
    for (&pt, p) in placements {
        match *p {
            Placement::Split { axis, parts, depth } => {
                spec.device.insert(pt, AxisSplit { axis, parts, depth });
            }
            Placement::Partial => return None,
        }
    }
    Some(spec)
}
