//! Shardings: a normalized view of a tensor's schedule, built on [`Layout`].
//!
//! [`Sharding`] is what the passes reason about: the mesh, the [`Layout`] (the single source of
//! truth for which chunk each device holds), and a [`Spec`]: per device parallel type the
//! logical axis it splits and its **depth** on that axis, plus the Stream split.
//!
//! One logical axis may be split several times, each piece on its own parallel type: the
//! splits form a *chain* of outer splits, outermost first, each cutting the piece the previous
//! one left (the device's chunk of the axis is found level by level). The depth of a split is
//! its position in the chain. On a 2-D mesh `[DIDy, DIDx, rest]` (DIDy at depth 0, DIDx at
//! depth 1) is DTensor's `[Shard(0), Shard(0)]`; `[DIDx, DIDy, rest]` is the other shard
//! order (FSDP2 + TP's `_StridedShard`); `[Stream, DIDx, rest]` is nvFuser's collective-based
//! pipelining (every stream chunk is split over DIDx). A Stream split takes one level of the
//! chain too.
//!
//! A chain may also hold *serial* levels before a device split: a device split inside a serial
//! piece (an `inner_split` of the axis, nvFuser's non-outermost split `[2, DIDx, rest]`,
//! DTensor's `_StridedShard(k, sf)` as `outer_split(k, sf)` before the mesh dim's split). Each
//! device then holds a *strided* subset of the axis: per serial piece, its chunk of that piece.
//! Such layouts ([`Spec::is_strided`]) are resharded by `set`s only (gathered into or sliced
//! from plain chains); a compute op reads and writes plain chains. Serial levels after the
//! last device split only shape the local buffer and are not levels of the spec.
//!
//! [`Spec::to_transforms`] writes a spec back as a schedule in canonical form: per logical
//! axis in ascending order, per level of its chain from the outermost, `outer_split(a, p),
//! parallelize(a, pt)` for a device split or `outer_split(a, s), [swizzle1d(a, pt),]
//! parallelize(a, Stream)` for the Stream split, `a` moving one loop position inwards per
//! level.

use std::collections::BTreeMap;

use meshflow_ir::program::{Layout, StreamSplit};
use meshflow_ir::{DeviceMesh, MeshId, ParallelType, Program, TensorId, TensorType, Transform};

use crate::error::PassError;

/// A device split in a [`Spec`]: logical axis, number of parts and depth.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct AxisSplit {
    /// The logical axis.
    pub axis: usize,
    /// The number of parts (the mesh extent along the parallel type).
    pub parts: u64,
    /// The position of the split in the axis' chain of splits (0 = outermost).
    pub depth: usize,
}

impl AxisSplit {
    /// The outermost (or only) split of `axis` into `parts`.
    pub fn outer(axis: usize, parts: u64) -> AxisSplit {
        AxisSplit {
            axis,
            parts,
            depth: 0,
        }
    }
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
    /// The position of the Stream split in the axis' chain (0 = outermost).
    pub depth: usize,
}

/// One level of an axis' chain of splits.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Level {
    /// A device split.
    Device(ParallelType, u64),
    /// The Stream split.
    Stream(StreamSpec),
    /// A serial split that a device split follows (a strided layout): its number of pieces.
    Serial(u64),
}

/// A normalized schedule: device splits by parallel type and an optional Stream split.
#[derive(Clone, Debug, PartialEq, Eq, Default, Hash)]
pub struct Spec {
    /// Device splits, keyed by parallel type.
    pub device: BTreeMap<ParallelType, AxisSplit>,
    /// Serial splits before a device split of the same axis (strided layouts), by axis and
    /// depth; `parts` is the number of serial pieces.
    pub serial: Vec<AxisSplit>,
    /// The Stream split.
    pub stream: Option<StreamSpec>,
}

impl Spec {
    /// The parallel type of the innermost device split of logical axis `axis`, if any.
    pub fn pt_on(&self, axis: usize) -> Option<ParallelType> {
        self.device
            .iter()
            .filter(|(_, s)| s.axis == axis)
            .max_by_key(|(_, s)| s.depth)
            .map(|(&pt, _)| pt)
    }

    /// The chain of splits of logical axis `axis`, outermost first.
    pub fn chain(&self, axis: usize) -> Vec<Level> {
        let mut levels: Vec<(usize, Level)> = self
            .device
            .iter()
            .filter(|(_, s)| s.axis == axis)
            .map(|(&pt, s)| (s.depth, Level::Device(pt, s.parts)))
            .collect();
        if let Some(st) = self.stream.filter(|s| s.axis == axis) {
            levels.push((st.depth, Level::Stream(st)));
        }
        levels.extend(
            self.serial
                .iter()
                .filter(|s| s.axis == axis)
                .map(|s| (s.depth, Level::Serial(s.parts))),
        );
        levels.sort_by_key(|(d, l)| (*d, matches!(l, Level::Stream(_))));
        levels.into_iter().map(|(_, l)| l).collect()
    }

    /// The device parallel types splitting logical axis `axis`, outermost first.
    pub fn device_chain(&self, axis: usize) -> Vec<ParallelType> {
        self.chain(axis)
            .into_iter()
            .filter_map(|l| match l {
                Level::Device(pt, _) => Some(pt),
                Level::Stream(_) | Level::Serial(_) => None,
            })
            .collect()
    }

    /// True when `pt` is the innermost device split of its axis.
    pub fn is_innermost(&self, pt: ParallelType) -> bool {
        self.device
            .get(&pt)
            .is_some_and(|s| self.pt_on(s.axis) == Some(pt))
    }

    /// The spec without its Stream split.
    pub fn without_stream(&self) -> Spec {
        Spec {
            device: self.device.clone(),
            serial: self.serial.clone(),
            stream: None,
        }
    }

    /// True when some device split lies inside a serial piece of its axis (a strided layout).
    pub fn is_strided(&self) -> bool {
        self.serial.iter().any(|s| s.parts > 1)
    }

    /// True when logical axis `axis` is strided.
    pub fn is_strided_on(&self, axis: usize) -> bool {
        self.serial.iter().any(|s| s.axis == axis && s.parts > 1)
    }

    /// The spec with every strided axis cut back to its plain chain: the device splits before
    /// the axis' first serial level stay, the serial levels and the device splits inside them
    /// go (those devices then hold the whole piece).
    pub fn without_strided(&self) -> Spec {
        let mut out = self.clone();
        for s in &self.serial {
            out.device
                .retain(|_, d| !(d.axis == s.axis && d.depth > s.depth));
        }
        out.serial.clear();
        out
    }

    /// The schedule in canonical form (see the module docs).
    pub fn to_transforms(&self) -> Vec<Transform> {
        let mut axes: Vec<usize> = self.device.values().map(|s| s.axis).collect();
        axes.extend(self.serial.iter().map(|s| s.axis));
        if let Some(s) = self.stream {
            axes.push(s.axis);
        }
        axes.sort_unstable();
        axes.dedup();
        let mut out = Vec::new();
        let mut shift = 0;
        for axis in axes {
            let chain = self.chain(axis);
            let levels = chain.len();
            for (pos, level) in (axis + shift..).zip(chain) {
                match level {
                    Level::Device(pt, parts) => {
                        out.push(Transform::OuterSplit { axis: pos, parts });
                        out.push(Transform::Parallelize { axis: pos, pt });
                    }
                    Level::Serial(parts) => out.push(Transform::OuterSplit { axis: pos, parts }),
                    Level::Stream(s) => {
                        out.push(Transform::OuterSplit {
                            axis: pos,
                            parts: s.chunks,
                        });
                        if let Some(pt) = s.swizzle {
                            out.push(Transform::Swizzle1d { axis: pos, pt });
                        }
                        out.push(Transform::Parallelize {
                            axis: pos,
                            pt: ParallelType::Stream,
                        });
                    }
                }
            }
            shift += levels;
        }
        out
    }

    /// True when every split divides the piece it cuts (no uneven shards).
    pub fn divides(&self, ty: &TensorType) -> bool {
        let mut axes: Vec<usize> = self.device.values().map(|s| s.axis).collect();
        axes.extend(self.serial.iter().map(|s| s.axis));
        if let Some(s) = self.stream {
            axes.push(s.axis);
        }
        axes.into_iter().all(|axis| {
            let Some(a) = ty.axes.get(axis) else {
                return false;
            };
            let mut extent = a.extent;
            self.chain(axis).into_iter().all(|level| {
                let parts = match level {
                    Level::Device(_, p) | Level::Serial(p) => p,
                    Level::Stream(s) => s.chunks,
                };
                let ok = parts > 0 && extent.is_multiple_of(parts);
                extent /= parts.max(1);
                ok
            })
        })
    }

    /// Checks that the spec can be applied to a tensor of type `ty` on `mesh`: device parts
    /// equal the mesh extent and every axis' chain has distinct depths. Splits need not
    /// divide (uneven pieces follow the chunk rule); see [`Spec::divides`].
    pub fn fits(&self, ty: &TensorType, mesh: &DeviceMesh) -> bool {
        let mut axes: Vec<usize> = self.device.values().map(|s| s.axis).collect();
        axes.extend(self.serial.iter().map(|s| s.axis));
        if self.serial.iter().any(|s| s.parts == 0) {
            return false;
        }
        if let Some(s) = self.stream {
            axes.push(s.axis);
        }
        axes.sort_unstable();
        axes.dedup();
        for (&pt, s) in &self.device {
            if mesh.size_of(pt) != Some(s.parts as usize) || s.parts == 0 {
                return false;
            }
        }
        if let Some(s) = self.stream {
            let ok_swizzle = s
                .swizzle
                .is_none_or(|pt| mesh.size_of(pt) == Some(s.chunks as usize));
            if ty.axes.get(s.axis).is_none_or(|a| a.reduction) || !ok_swizzle || s.chunks == 0 {
                return false;
            }
        }
        for axis in axes {
            let Some(a) = ty.axes.get(axis) else {
                return false;
            };
            let chain = self.chain(axis);
            let mut depths: Vec<usize> = self
                .device
                .values()
                .filter(|s| s.axis == axis)
                .map(|s| s.depth)
                .chain(self.stream.filter(|s| s.axis == axis).map(|s| s.depth))
                .chain(
                    self.serial
                        .iter()
                        .filter(|s| s.axis == axis)
                        .map(|s| s.depth),
                )
                .collect();
            depths.sort_unstable();
            if depths != (0..depths.len()).collect::<Vec<_>>() {
                return false;
            }
            if chain.is_empty() && a.extent == 0 {
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
            // The leaves form a chain: device and Stream pieces, serial pieces that a device
            // piece follows (a strided layout), and serial pieces after the last of them (the
            // rest, which stays local).
            let last_parallel = a.leaves.iter().rposition(|l| l.pt != ParallelType::Serial);
            for (k, leaf) in a.leaves.iter().enumerate() {
                if leaf.pt == ParallelType::Serial {
                    if last_parallel.is_some_and(|l| k < l) {
                        spec.serial.push(AxisSplit {
                            axis,
                            parts: leaf.extent,
                            depth: k,
                        });
                    }
                    continue;
                }
                if leaf.pt.is_device() {
                    spec.device.insert(
                        leaf.pt,
                        AxisSplit {
                            axis,
                            parts: leaf.extent,
                            depth: k,
                        },
                    );
                }
            }
        }
        spec.stream = layout.stream_split().map(|s: StreamSplit| StreamSpec {
            axis: s.axis,
            chunks: s.chunks,
            swizzle: s.swizzle,
            depth: layout.axes[s.axis]
                .leaves
                .iter()
                .position(|l| l.pt == ParallelType::Stream)
                .unwrap_or(0),
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
                self.value_index(s.axis)
                    .map(|v| (pt, AxisSplit { axis: v, ..*s }))
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
