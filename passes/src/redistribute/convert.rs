//! Between [`Placements`] and tensors: the placements of a [`Sharding`] and the type and
//! schedule of a tensor placed as given.

use std::collections::BTreeMap;

use meshflow_ir::{DeviceMesh, ParallelType, TensorType};

use super::{normalized, Cut, Placements};
use crate::analysis::{AxisSplit, Sharding, Spec};
use crate::decision::{placements, Placement};
use crate::edit::value_type;

/// The placements of `sh` over its value axes (for [`super::plan`]): per value axis its
/// device splits and the serial splits before them, by depth.
pub fn placements_of(sh: &Sharding) -> Placements {
    let mut out = Placements::replicated(sh.value_axes.len());
    let mut by_axis: Vec<Vec<(usize, Cut)>> = vec![Vec::new(); sh.value_axes.len()];
    for (pt, p) in placements(sh) {
        match p {
            Placement::Split { axis, depth, .. } => {
                if let Some(c) = by_axis.get_mut(axis) {
                    c.push((depth, Cut::Device(pt)));
                }
            }
            Placement::Partial => {
                out.partial.insert(pt);
            }
        }
    }
    for s in &sh.spec.serial {
        if let Some(c) = sh.value_index(s.axis).and_then(|v| by_axis.get_mut(v)) {
            c.push((s.depth, Cut::Serial(s.parts)));
        }
    }
    for (chain, mut levels) in out.chains.iter_mut().zip(by_axis) {
        levels.sort();
        *chain = normalized(levels.into_iter().map(|(_, c)| c).collect());
    }
    out
}

/// The type and schedule of a tensor placed as `pl` on `mesh`, holding the value of the
/// producer `ps` (of type `pty`): without partial sums its value type; with partial sums the
/// producer's own type (a `set` keeps reduction axes as they are), each partial parallel type
/// on the reduction axis it splits in the producer.
pub fn materialize(
    pl: &Placements,
    pty: &TensorType,
    ps: &Sharding,
    mesh: &DeviceMesh,
) -> (TensorType, Spec) {
    let vty = value_type(pty);
    let mut spec = Spec::default();
    // Value axis `v` of the value type is logical axis `ps.value_axes[v]` of the full type.
    let partial = !pl.partial.is_empty();
    let logical = |v: usize| {
        if partial {
            ps.value_axes.get(v).copied().unwrap_or(v)
        } else {
            v
        }
    };
    for (v, chain) in pl.chains.iter().enumerate() {
        for (depth, &cut) in chain.iter().enumerate() {
            let axis = logical(v);
            match cut {
                Cut::Device(pt) => {
                    let parts = mesh.size_of(pt).unwrap_or(1) as u64;
                    spec.device.insert(pt, AxisSplit { axis, parts, depth });
                }
                Cut::Serial(parts) => spec.serial.push(AxisSplit { axis, parts, depth }),
            }
        }
    }
    if !partial {
        return (vty, spec);
    }
    // The partial types keep their reduction axes and their order on them.
    let mut kept: Vec<(ParallelType, AxisSplit)> = pl
        .partial
        .iter()
        .filter_map(|pt| ps.spec.device.get(pt).map(|s| (*pt, *s)))
        .collect();
    kept.sort_by_key(|(_, s)| (s.axis, s.depth));
    let mut depth_on: BTreeMap<usize, usize> = BTreeMap::new();
    for (pt, s) in kept {
        let d = depth_on.entry(s.axis).or_insert(0);
        spec.device.insert(pt, AxisSplit { depth: *d, ..s });
        *d += 1;
    }
    (pty.clone(), spec)
}
