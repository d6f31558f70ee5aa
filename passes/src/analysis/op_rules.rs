//! Per-op sharding rules on top of the axis maps: which output axes an op can compute split,
//! what each input must hold for a given output sharding, and what output sharding an input
//! implies when the op computes on the input's placement.
//!
//! - **Locally splittable axes** ([`local_split_ok`]). A device split (or Stream chunk) of an
//!   output axis can be computed from chunks of the inputs when the axis maps to input axes
//!   (their chunks hold exactly what the output chunk needs), or when it is a broadcast axis of
//!   `expand` (every chunk repeats the same input). The normalized axis of `softmax` and
//!   `rms_norm`, a sliced, selected or concatenated axis and the later axes of a reshape group
//!   are never split locally. A `custom` op is chunk-wise along every axis by contract.
//! - **Requirements** ([`requirements_for`]). For an output on mesh `m` with device splits
//!   `S`, each input must live on `m` and carry exactly the splits of `S` mapped back through
//!   the axis map (an input axis with no mapped split is replicated).
//! - **Forward specs** ([`forward_spec`]). The splits of input `j` mapped to output axes that
//!   are locally splittable and that they fit: the output sharding of computing the op where
//!   input `j` already is.

use std::collections::BTreeMap;

use meshflow_ir::{DeviceMesh, EntityRef, MeshId, Op, OpKind, ParallelType, Program, TensorId};

use crate::analysis::{op_axis_map, AxisMap, AxisSplit, Sharding, Spec, StreamSpec};
use crate::error::PassError;

/// The sharding an op needs for one input: a mesh and device splits over the input's
/// logical axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    /// The mesh the op runs on.
    pub mesh: MeshId,
    /// Device splits over the input's logical axes.
    pub device: BTreeMap<ParallelType, AxisSplit>,
}

/// True when `a` and `b` are the same mesh (same handle or the same devices in the same
/// shape).
pub fn same_mesh(program: &Program, a: MeshId, b: MeshId) -> bool {
    a == b
        || matches!((program.meshes.get(a), program.meshes.get(b)), (Some(x), Some(y)) if x.mesh == y.mesh)
}

/// True when `t` already holds what `req` asks for (a strided layout never does: compute ops
/// read plain chains).
pub fn satisfies(program: &Program, t: TensorId, req: &Requirement) -> Result<bool, PassError> {
    let sh = Sharding::of(program, t)?;
    Ok(same_mesh(program, sh.mesh, req.mesh)
        && sh.spec.device == req.device
        && !sh.spec.is_strided())
}

/// True when output axis `k` (a logical axis of the op's first output) of `op` can be split
/// over devices or stream chunks while the op computes locally (see the module docs).
pub fn local_split_ok(program: &Program, op: &Op, map: &AxisMap, k: usize) -> bool {
    match op.kind {
        OpKind::Softmax { axis } | OpKind::RmsNorm { axis, .. } if axis == k => false,
        OpKind::Custom(_) => true,
        OpKind::Expand => {
            // A broadcast axis (no input axis, or an input axis of extent 1) repeats data.
            map.first()
                .and_then(|m| m.get(k))
                .is_some_and(|src| !src.is_empty())
                || expand_broadcasts(program, op, k)
        }
        _ => map
            .first()
            .and_then(|m| m.get(k))
            .is_some_and(|src| !src.is_empty()),
    }
}

/// True when output axis `k` of an `expand` is a broadcast axis (its input axis is missing
/// or of extent 1 under a larger output extent).
fn expand_broadcasts(program: &Program, op: &Op, k: usize) -> bool {
    let shape = |t: Option<&TensorId>| {
        t.and_then(|&t| program.tensors.get(t))
            .map(|d| d.ty.value_shape())
    };
    let (Some(is), Some(os)) = (shape(op.inputs.first()), shape(op.outputs.first())) else {
        return false;
    };
    let off = os.len().saturating_sub(is.len());
    k < os.len() && (k < off || is.get(k - off) != os.get(k))
}

/// True for the ops that compute element by element along every split axis, so their outputs
/// keep uneven splits of their inputs (as DTensor's pointwise and linear ops keep uneven
/// placements); shape ops, row-wise ops and reductions other than `sum` need splits that
/// divide.
pub fn keeps_uneven(kind: &OpKind) -> bool {
    matches!(
        kind,
        OpKind::Set
            | OpKind::Add
            | OpKind::Sub
            | OpKind::Mul
            | OpKind::Gelu
            | OpKind::Silu
            | OpKind::Cast
            | OpKind::Linear
            | OpKind::Matmul
            | OpKind::Sum { .. }
    )
}

/// Per input of `op` (not a `set`, not a MoE op): the sharding it needs when the output lives
/// on `mesh` with device splits `spec` (see the module docs).
pub fn requirements_for(
    program: &Program,
    op: &Op,
    mesh: MeshId,
    spec: &Spec,
) -> Vec<Option<Requirement>> {
    let map = op_axis_map(program, op);
    (0..op.inputs.len())
        .map(|j| {
            let mut device = BTreeMap::new();
            for (&pt, s) in &spec.device {
                let sources = map.first().and_then(|m| m.get(s.axis));
                for &(jj, a) in sources.into_iter().flatten() {
                    if jj == j {
                        device.insert(pt, AxisSplit { axis: a, ..*s });
                    }
                }
            }
            Some(Requirement { mesh, device })
        })
        .collect()
}

/// The sharding of the output of `op` computed where input `j` lives: its device splits
/// mapped to locally splittable output axes that they fit (partial splits and splits with no
/// output axis dropped), and its Stream split likewise. Returns the mesh and the spec.
pub fn forward_spec(
    program: &Program,
    op: &Op,
    j: usize,
) -> Result<Option<(MeshId, Spec)>, PassError> {
    let (Some(&x), Some(&out)) = (op.inputs.get(j), op.outputs.first()) else {
        return Ok(None);
    };
    let xs = Sharding::of(program, x)?;
    let Some(od) = program.tensors.get(out) else {
        return Ok(None);
    };
    let Some(mesh) = program.meshes.get(xs.mesh).map(|m| &m.mesh) else {
        return Ok(None);
    };
    let map = op_axis_map(program, op);
    let out_axis = |a: usize| {
        map.first().and_then(|m| {
            m.iter()
                .enumerate()
                .find(|(k, src)| src.contains(&(j, a)) && local_split_ok(program, op, &map, *k))
                .map(|(k, _)| k)
        })
    };
    let mut spec = Spec::default();
    let fits =
        |cand: &Spec| cand.fits(&od.ty, mesh) && (cand.divides(&od.ty) || keeps_uneven(&op.kind));
    // A chain of splits of one axis moves as one.
    let mut chains: BTreeMap<usize, Vec<(ParallelType, AxisSplit)>> = BTreeMap::new();
    let plain = xs.spec.without_strided();
    for (&pt, s) in &plain.device {
        chains.entry(s.axis).or_default().push((pt, *s));
    }
    for (a, chain) in chains {
        let Some(k) = out_axis(a) else { continue };
        if spec.pt_on(k).is_some() {
            continue;
        }
        let mut cand = spec.clone();
        for (pt, s) in chain {
            cand.device.insert(pt, AxisSplit { axis: k, ..s });
        }
        if fits(&cand) {
            spec = cand;
        }
    }
    if let Some(st) = xs.stream() {
        if let Some(k) = out_axis(st.axis) {
            let mut cand = spec.clone();
            cand.stream = Some(StreamSpec { axis: k, ..st });
            // The chunks must cut the same thing: the local shard on both or on neither.
            if xs.spec.device_chain(st.axis) == cand.device_chain(k) && fits(&cand) {
                spec = cand;
            }
        }
    }
    Ok(Some((xs.mesh, spec)))
}

/// The input splits of `op`'s input `j` that do not survive into [`forward_spec`]: each as
/// `(parallel type, input logical axis, parts)`.
pub fn dropped_splits(
    program: &Program,
    op: &Op,
    j: usize,
) -> Result<Vec<(ParallelType, usize, u64)>, PassError> {
    let Some(&x) = op.inputs.get(j) else {
        return Ok(Vec::new());
    };
    let xs = Sharding::of(program, x)?;
    let kept = forward_spec(program, op, j)?
        .map(|(_, s)| s)
        .unwrap_or_default();
    Ok(xs
        .spec
        .device
        .iter()
        .filter(|(pt, _)| !kept.device.contains_key(pt))
        .map(|(&pt, s)| (pt, s.axis, s.parts))
        .collect())
}

/// The number of elements of the value of `t` (0 when unknown).
pub fn value_numel(program: &Program, t: TensorId) -> u64 {
    program
        .tensors
        .get(t)
        .map_or(0, |d| d.ty.value_shape().iter().product())
}

/// The mesh `m` of `program`.
pub fn mesh_of(program: &Program, m: MeshId) -> Result<&DeviceMesh, PassError> {
    program
        .meshes
        .get(m)
        .map(|d| &d.mesh)
        .ok_or_else(|| PassError::internal("op_rules", format!("unknown mesh {}", m.index())))
}
