//! Shardings: a normalized view of a tensor's schedule, built on [`Layout`].
//!
//! [`Sharding`] is what the passes reason about: the mesh, the [`Layout`] (the single source of
//! truth for which chunk each device holds), and a [`Spec`]: per device parallel type the
//! logical axis it splits, plus the Stream split. [`Spec::to_transforms`] writes a spec back
//! as a schedule in canonical form: per logical axis in ascending order,
//! `outer_split(a, p), parallelize(a, pt)` for the device split, then
//! `outer_split(a', s), [swizzle1d(a', pt),] parallelize(a', Stream)` for the Stream split
//! (which then cuts the local shard), with loop positions shifted by the splits before.

use std::collections::BTreeMap;

use meshflow_ir::program::{Layout, StreamSplit};
use meshflow_ir::{DeviceMesh, MeshId, ParallelType, Program, TensorId, TensorType, Transform};

use crate::error::PassError;

/// A device split in a [`Spec`]: logical axis and number of parts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct AxisSplit {
    /// The logical axis.
    pub axis: usize,
    /// The number of parts (the mesh extent along the parallel type).
    pub parts: u64,
}

/// A Stream split in a [`Spec`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct StreamSpec {
    /// The logical axis.
    pub axis: usize,
    /// The number of chunks (host loop trip count).
    pub chunks: u64,
    /// The swizzle's device parallel type, if any.
    pub swizzle: Option<ParallelType>,
}

/// A normalized schedule: device splits by parallel type and an optional Stream split.
#[derive(Clone, Debug, PartialEq, Eq, Default, Hash)]
pub struct Spec {
    /// Device splits, keyed by parallel type.
    pub device: BTreeMap<ParallelType, AxisSplit>,
    /// The Stream split.
    pub stream: Option<StreamSpec>,
}

impl Spec {
    /// The parallel type splitting logical axis `axis`, if any.
    pub fn pt_on(&self, axis: usize) -> Option<ParallelType> {
        self.device
            .iter()
            .find(|(_, s)| s.axis == axis)
            .map(|(&pt, _)| pt)
    }

    /// The spec without its Stream split.
    pub fn without_stream(&self) -> Spec {
        Spec {
            device: self.device.clone(),
            stream: None,
        }
    }

    /// The schedule in canonical form (see the module docs).
    pub fn to_transforms(&self) -> Vec<Transform> {
        let mut axes: Vec<usize> = self.device.values().map(|s| s.axis).collect();
        if let Some(s) = self.stream {
            axes.push(s.axis);
        }
        axes.sort_unstable();
        axes.dedup();
        let mut out = Vec::new();
        let mut shift = 0;
        for axis in axes {
            let pos = axis + shift;
            let mut next = pos;
            if let Some((&pt, split)) = self.device.iter().find(|(_, s)| s.axis == axis) {
                out.push(Transform::OuterSplit {
                    axis: pos,
                    parts: split.parts,
                });
                out.push(Transform::Parallelize { axis: pos, pt });
                next = pos + 1;
                shift += 1;
            }
            if let Some(s) = self.stream.filter(|s| s.axis == axis) {
                out.push(Transform::OuterSplit {
                    axis: next,
                    parts: s.chunks,
                });
                if let Some(pt) = s.swizzle {
                    out.push(Transform::Swizzle1d { axis: next, pt });
                }
                out.push(Transform::Parallelize {
                    axis: next,
                    pt: ParallelType::Stream,
                });
                shift += 1;
            }
        }
        out
    }

    /// Checks that the spec can be applied to a tensor of type `ty` on `mesh`: every split
    /// divides its axis, device parts equal the mesh extent, and no axis is split twice.
    pub fn fits(&self, ty: &TensorType, mesh: &DeviceMesh) -> bool {
        let mut local: Vec<u64> = ty.axes.iter().map(|a| a.extent).collect();
        let mut seen = Vec::new();
        for (&pt, s) in &self.device {
            let Some(extent) = local.get_mut(s.axis) else {
                return false;
            };
            if mesh.size_of(pt) != Some(s.parts as usize)
                || s.parts == 0
                || !extent.is_multiple_of(s.parts)
                || seen.contains(&s.axis)
            {
                return false;
            }
            seen.push(s.axis);
            *extent /= s.parts;
        }
        if let Some(s) = self.stream {
            let ok_swizzle = s
                .swizzle
                .is_none_or(|pt| mesh.size_of(pt) == Some(s.chunks as usize));
            let Some(axis) = ty.axes.get(s.axis) else {
                return false;
            };
            if axis.reduction
                || !ok_swizzle
                || s.chunks == 0
                || !local[s.axis].is_multiple_of(s.chunks)
            {
                return false;
            }
        }
        true
    }
}

/// A tensor's placement: mesh, layout and normalized spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sharding {
    /// The mesh.
    pub mesh: MeshId,
    /// The layout of its schedule.
    pub layout: Layout,
    /// The normalized spec.
    pub spec: Spec,
    /// Logical indices of the non-reduction (value) axes, in order.
    pub value_axes: Vec<usize>,
}

impl Sharding {
    /// The sharding of `t` (an unannotated tensor is replicated).
    pub fn of(program: &Program, t: TensorId) -> Result<Sharding, PassError> {
        let decl = program
            .tensors
            .get(t)
            .ok_or_else(|| PassError::internal("sharding", format!("unknown tensor {t:?}")))?;
        Sharding::from_parts(&decl.name, &decl.ty, decl.mesh, decl.transforms())
    }

    /// The sharding of a tensor called `name` of type `ty` on `mesh` with `schedule`.
    pub fn from_parts(
        name: &str,
        ty: &TensorType,
        mesh: MeshId,
        schedule: &[Transform],
    ) -> Result<Sharding, PassError> {
        let domain = meshflow_ir::program::LoopDomain::replay(&ty.logical(), schedule).map_err(
            |source| PassError::Schedule {
                tensor: name.to_string(),
                source,
            },
        )?;
        let layout = Layout::of(&domain, ty.axes.len()).map_err(|source| PassError::Layout {
            tensor: name.to_string(),
            source,
        })?;
        let mut spec = Spec::default();
        for (axis, a) in layout.axes.iter().enumerate() {
            for (k, leaf) in a.leaves.iter().enumerate() {
                if leaf.pt.is_device() {
                    if k != 0 {
                        return Err(PassError::tensor(
                            name,
                            format!(
                                "the {} split of logical axis {axis} is not its outermost piece; \
                                 only outer device splits are supported",
                                leaf.pt
                            ),
                        ));
                    }
                    spec.device.insert(
                        leaf.pt,
                        AxisSplit {
                            axis,
                            parts: leaf.extent,
                        },
                    );
                }
            }
        }
        spec.stream = layout.stream_split().map(|s: StreamSplit| StreamSpec {
            axis: s.axis,
            chunks: s.chunks,
            swizzle: s.swizzle,
        });
        let value_axes = ty
            .axes
            .iter()
            .enumerate()
            .filter(|(_, a)| !a.reduction)
            .map(|(i, _)| i)
            .collect();
        Ok(Sharding {
            mesh,
            layout,
            spec,
            value_axes,
        })
    }

    /// The device split along `pt`, if any.
    pub fn split(&self, pt: ParallelType) -> Option<AxisSplit> {
        self.spec.device.get(&pt).copied()
    }

    /// True when the split along `pt` is on a reduction axis (the tensor holds partial sums).
    pub fn is_partial_on(&self, pt: ParallelType) -> bool {
        self.split(pt)
            .is_some_and(|s| self.layout.axes.get(s.axis).is_some_and(|a| a.reduction))
    }

    /// The parallel types along which the tensor holds partial sums.
    pub fn partial_types(&self) -> Vec<ParallelType> {
        ParallelType::DEVICE
            .into_iter()
            .filter(|&pt| self.is_partial_on(pt))
            .collect()
    }

    /// The device splits on value axes, as `pt -> (value axis index, parts)`.
    pub fn value_splits(&self) -> BTreeMap<ParallelType, AxisSplit> {
        self.spec
            .device
            .iter()
            .filter_map(|(&pt, s)| {
                self.value_index(s.axis).map(|v| {
                    (
                        pt,
                        AxisSplit {
                            axis: v,
                            parts: s.parts,
                        },
                    )
                })
            })
            .collect()
    }

    /// The Stream split, if any.
    pub fn stream(&self) -> Option<StreamSpec> {
        self.spec.stream
    }

    /// The value-axis index (= host axis) of logical axis `axis`, `None` for a reduction axis.
    pub fn value_index(&self, axis: usize) -> Option<usize> {
        self.value_axes.iter().position(|&a| a == axis)
    }

    /// The local (per-device) shape of the value axes: the host tensor's shape.
    pub fn local_value_shape(&self) -> Vec<u64> {
        let local = self.layout.local_shape();
        self.value_axes
            .iter()
            .filter_map(|&a| local.get(a).copied())
            .collect()
    }
}
