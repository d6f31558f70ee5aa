//! Loop domains: the transforms that schedule a tensor, their replay, and the layout analysis
//! that tells which part of a tensor each device holds and what each stream iteration visits.
//!
//! A tensor's **logical domain** is its list of axes. Its **loop domain** starts as the logical
//! domain and is rewritten by a list of [`Transform`]s, applied in order to *loop axis
//! positions*:
//!
//! | transform | effect on loop axis `a` of extent `E` |
//! |---|---|
//! | `outer_split(a, p)` | `[p, ceil(E/p)]`: the outer axis has extent `p` (the one usually parallelized) |
//! | `inner_split(a, f)` | `[E/f, f]` (`f` must divide `E`) |
//! | `merge(a)` | axes `a` and `a+1` become one axis of extent `E_a * E_{a+1}` |
//! | `reorder(o0, o1, ...)` | new loop axis `k` is old loop axis `o_k` (a permutation) |
//! | `swizzle1d(a, pt)` | same extent; stream iteration `i` visits chunk `(i + my_index(pt)) % E` |
//! | `parallelize(a, pt)` | marks the axis `DIDx/DIDy/DIDz/Stream/Serial` |
//!
//! An `outer_split` need not divide its extent: it cuts by **the chunk rule** (PyTorch's
//! `torch.chunk`, DTensor's `Shard`): chunks of `c = ceil(E/p)` elements, chunk `k` covering
//! `[min(k c, E), min((k + 1) c, E))`, so trailing chunks are shorter or empty (10 over 4 is
//! `3, 3, 3, 1`; 5 over 4 is `2, 2, 1, 0`). Its inner axis has the extent `c` of the largest
//! chunk. Such a *ragged* split must be part of a **chain**: every split of the logical axis
//! cuts the inner piece of the previous one (`outer_split(a, p)`, then `outer_split(a + 1, q)`,
//! ...), never an outer piece, and the chunk rule applies level by level to the actual extent
//! of the piece being cut (18 rows over `[4, 2]` give `3, 2, 3, 2, 3, 2, 2, 1`). An
//! `inner_split` must divide.
//!
//! **Layout.** Each logical axis is cut by the splits derived from it into *leaves* (loop
//! axes). The global index along the axis is the row-major (mixed-radix) combination of its
//! leaves in outer-to-inner order. A device holds the elements whose device-parallel leaves equal
//! its team index along that leaf's parallel type; its local buffer stores, per logical axis,
//! the remaining leaves row-major, axes in logical order. A Stream leaf must be the outermost
//! leaf that is not device-parallel, so that every stream chunk is a contiguous slice of the
//! local buffer. (Which device-leaf positions a communication supports is the lowering's
//! business: an all-gather, for instance, needs the device leaf outermost.)

use std::fmt;

use crate::mesh::ParallelType;

/// One scheduling step on a tensor's loop domain.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Transform {
    /// Split loop axis `axis` into `[parts, extent / parts]`.
    OuterSplit {
        /// Loop axis position.
        axis: usize,
        /// Extent of the new outer axis.
        parts: u64,
    },
    /// Split loop axis `axis` into `[extent / factor, factor]`.
    InnerSplit {
        /// Loop axis position.
        axis: usize,
        /// Extent of the new inner axis.
        factor: u64,
    },
    /// Merge loop axes `axis` and `axis + 1`.
    Merge {
        /// Position of the outer of the two axes.
        axis: usize,
    },
    /// Permute the loop axes: new axis `k` is old axis `order[k]`.
    Reorder {
        /// A permutation of `0..rank`.
        order: Vec<usize>,
    },
    /// Cyclically shift the chunks a Stream axis visits by the team index along `pt`.
    Swizzle1d {
        /// Loop axis position.
        axis: usize,
        /// The device parallel type whose team index shifts the iteration.
        pt: ParallelType,
    },
    /// Set the parallel type of loop axis `axis`.
    Parallelize {
        /// Loop axis position.
        axis: usize,
        /// The parallel type.
        pt: ParallelType,
    },
}

impl fmt::Display for Transform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transform::OuterSplit { axis, parts } => write!(f, "outer_split({axis}, {parts})"),
            Transform::InnerSplit { axis, factor } => write!(f, "inner_split({axis}, {factor})"),
            Transform::Merge { axis } => write!(f, "merge({axis})"),
            Transform::Reorder { order } => {
                f.write_str("reorder(")?;
                for (i, o) in order.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{o}")?;
                }
                f.write_str(")")
            }
            Transform::Swizzle1d { axis, pt } => write!(f, "swizzle1d({axis}, {pt})"),
            Transform::Parallelize { axis, pt } => write!(f, "parallelize({axis}, {pt})"),
        }
    }
}

/// Why a list of transforms cannot be applied to a tensor.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A transform names a loop axis that does not exist.
    #[error("transform #{index} `{transform}`: loop axis {axis} out of range (the loop domain has {rank} axes)")]
    AxisOutOfRange {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
        /// The axis named.
        axis: usize,
        /// The loop domain's rank at that point.
        rank: usize,
    },
    /// An inner split does not divide its axis.
    #[error("transform #{index} `{transform}`: extent {extent} is not divisible by {by} (only an outer_split may cut unevenly, by the chunk rule)")]
    NonDivisibleSplit {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
        /// The extent being split.
        extent: u64,
        /// The split factor.
        by: u64,
    },
    /// A split by zero.
    #[error("transform #{index} `{transform}`: split factor must be at least 1")]
    ZeroSplit {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
    },
    /// A merge whose extent does not fit in 64 bits.
    #[error("transform #{index} `{transform}`: the merged extent does not fit in 64 bits")]
    ExtentOverflow {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
    },
    /// `reorder` whose argument is not a permutation of the loop axes.
    #[error("transform #{index} `{transform}`: not a permutation of 0..{rank}")]
    BadReorder {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
        /// The loop domain's rank at that point.
        rank: usize,
    },
    /// `swizzle1d` with a parallel type that is not a device type.
    #[error("transform #{index} `{transform}`: swizzle1d needs a device parallel type (DIDx, DIDy or DIDz), not {pt}")]
    SwizzleNotDevice {
        /// Position of the transform in the schedule.
        index: usize,
        /// The transform, printed.
        transform: String,
        /// The parallel type given.
        pt: ParallelType,
    },
}

/// Index of an [`IterDomain`] inside a [`LoopDomain`].
pub type IdIndex = usize;

/// How an iteration domain was derived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdDef {
    /// Logical axis `n` of the tensor.
    Logical(usize),
    /// One half of a split.
    Split {
        /// The domain that was split.
        input: IdIndex,
        /// True for the outer half.
        outer: bool,
    },
    /// The merge of two domains.
    Merge {
        /// The outer input.
        outer: IdIndex,
        /// The inner input.
        inner: IdIndex,
    },
    /// A swizzled copy of a domain.
    Swizzle {
        /// The domain that was swizzled.
        input: IdIndex,
        /// The device parallel type of the swizzle.
        pt: ParallelType,
    },
}

/// One iteration domain (an axis of some stage of the loop domain).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IterDomain {
    /// Number of iterations.
    pub extent: u64,
    /// True when derived from a reduction axis.
    pub reduction: bool,
    /// Parallel type (only meaningful for loop axes).
    pub pt: ParallelType,
    /// How it was derived.
    pub def: IdDef,
    /// True for the inner piece of an `outer_split` that does not divide its input: its
    /// extent is the largest chunk's, and some chunks are shorter.
    pub ragged: bool,
}

/// The replayed loop domain of a tensor: every iteration domain ever created, and which of
/// them form the current loop axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoopDomain {
    /// All iteration domains (logical ones first, in axis order).
    pub ids: Vec<IterDomain>,
    /// The loop axes, outermost first.
    pub loop_axes: Vec<IdIndex>,
}

impl LoopDomain {
    /// Replays `schedule` over logical axes given as `(extent, is_reduction)`.
    pub fn replay(
        logical: &[(u64, bool)],
        schedule: &[Transform],
    ) -> Result<LoopDomain, ScheduleError> {
        let mut ids: Vec<IterDomain> = logical
            .iter()
            .enumerate()
            .map(|(i, &(extent, reduction))| IterDomain {
                extent,
                reduction,
                pt: ParallelType::Serial,
                def: IdDef::Logical(i),
                ragged: false,
            })
            .collect();
        let mut loop_axes: Vec<IdIndex> = (0..ids.len()).collect();
        for (index, t) in schedule.iter().enumerate() {
            let oob = |axis: usize, rank: usize| ScheduleError::AxisOutOfRange {
                index,
                transform: t.to_string(),
                axis,
                rank,
            };
            match *t {
                Transform::OuterSplit { axis, parts: by }
                | Transform::InnerSplit { axis, factor: by } => {
                    let outer_given = matches!(t, Transform::OuterSplit { .. });
                    let &id = loop_axes.get(axis).ok_or(oob(axis, loop_axes.len()))?;
                    if by == 0 {
                        return Err(ScheduleError::ZeroSplit {
                            index,
                            transform: t.to_string(),
                        });
                    }
                    let extent = ids[id].extent;
                    let ragged = !extent.is_multiple_of(by);
                    if ragged && !outer_given {
                        return Err(ScheduleError::NonDivisibleSplit {
                            index,
                            transform: t.to_string(),
                            extent,
                            by,
                        });
                    }
                    let (outer_extent, inner_extent) = if outer_given {
                        (by, extent.div_ceil(by))
                    } else {
                        (extent / by, by)
                    };
                    let reduction = ids[id].reduction;
                    let outer = ids.len();
                    ids.push(IterDomain {
                        extent: outer_extent,
                        reduction,
                        pt: ParallelType::Serial,
                        def: IdDef::Split {
                            input: id,
                            outer: true,
                        },
                        ragged: false,
                    });
                    ids.push(IterDomain {
                        extent: inner_extent,
                        reduction,
                        pt: ParallelType::Serial,
                        def: IdDef::Split {
                            input: id,
                            outer: false,
                        },
                        ragged,
                    });
                    loop_axes.splice(axis..=axis, [outer, outer + 1]);
                }
                Transform::Merge { axis } => {
                    if axis + 1 >= loop_axes.len() {
                        return Err(oob(axis + 1, loop_axes.len()));
                    }
                    let (o, i) = (loop_axes[axis], loop_axes[axis + 1]);
                    let merged = ids.len();
                    let extent = ids[o].extent.checked_mul(ids[i].extent).ok_or_else(|| {
                        ScheduleError::ExtentOverflow {
                            index,
                            transform: t.to_string(),
                        }
                    })?;
                    ids.push(IterDomain {
                        extent,
                        reduction: ids[o].reduction && ids[i].reduction,
                        pt: ParallelType::Serial,
                        def: IdDef::Merge { outer: o, inner: i },
                        ragged: ids[o].ragged || ids[i].ragged,
                    });
                    loop_axes.splice(axis..=axis + 1, [merged]);
                }
                Transform::Reorder { ref order } => {
                    let rank = loop_axes.len();
                    let mut seen = vec![false; rank];
                    let ok = order.len() == rank
                        && order
                            .iter()
                            .all(|&o| o < rank && !std::mem::replace(&mut seen[o], true));
                    if !ok {
                        return Err(ScheduleError::BadReorder {
                            index,
                            transform: t.to_string(),
                            rank,
                        });
                    }
                    loop_axes = order.iter().map(|&o| loop_axes[o]).collect();
                }
                Transform::Swizzle1d { axis, pt } => {
                    let &id = loop_axes.get(axis).ok_or(oob(axis, loop_axes.len()))?;
                    if !pt.is_device() {
                        return Err(ScheduleError::SwizzleNotDevice {
                            index,
                            transform: t.to_string(),
                            pt,
                        });
                    }
                    let sw = ids.len();
                    ids.push(IterDomain {
                        extent: ids[id].extent,
                        reduction: ids[id].reduction,
                        pt: ids[id].pt,
                        def: IdDef::Swizzle { input: id, pt },
                        ragged: ids[id].ragged,
                    });
                    loop_axes[axis] = sw;
                }
                Transform::Parallelize { axis, pt } => {
                    let &id = loop_axes.get(axis).ok_or(oob(axis, loop_axes.len()))?;
                    ids[id].pt = pt;
                }
            }
        }
        Ok(LoopDomain { ids, loop_axes })
    }

    /// The loop axes as iteration domains, outermost first.
    pub fn axes(&self) -> impl Iterator<Item = &IterDomain> + '_ {
        self.loop_axes.iter().map(|&i| &self.ids[i])
    }

    /// The loop axes parallelized with `pt`.
    pub fn axes_with(&self, pt: ParallelType) -> Vec<IdIndex> {
        self.loop_axes
            .iter()
            .copied()
            .filter(|&i| self.ids[i].pt == pt)
            .collect()
    }

    /// The swizzle on loop axis `id` (following a chain of swizzles, the outermost one wins).
    pub fn swizzle_of(&self, id: IdIndex) -> Option<ParallelType> {
        match self.ids[id].def {
            IdDef::Swizzle { pt, .. } => Some(pt),
            _ => None,
        }
    }

    /// Strips swizzles: the domain a swizzled domain was made from.
    pub fn unswizzled(&self, mut id: IdIndex) -> IdIndex {
        while let IdDef::Swizzle { input, .. } = self.ids[id].def {
            id = input;
        }
        id
    }
}

/// Why a tensor's schedule has no supported layout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A device or stream parallel axis is derived from a merge.
    #[error("loop axis {position} is parallelized {pt} but is derived from a merge; only split axes can be parallelized over devices or streams")]
    ParallelMerge {
        /// Loop axis position.
        position: usize,
        /// The parallel type.
        pt: ParallelType,
    },
    /// A stream axis whose chunks are not contiguous in the local buffer.
    #[error("loop axis {position} is Stream-parallel but is not the outermost non-device piece of logical axis {axis}, so its chunks are not contiguous")]
    StreamNotOutermost {
        /// Loop axis position.
        position: usize,
        /// The logical axis.
        axis: usize,
    },
    /// A parallel type used on two loop axes.
    #[error("parallel type {pt} is used on loop axes {first} and {second}")]
    ParallelTypeUsedTwice {
        /// The parallel type.
        pt: ParallelType,
        /// First loop axis position.
        first: usize,
        /// Second loop axis position.
        second: usize,
    },
    /// A ragged split that is not part of a chain of outer splits.
    #[error("logical axis {axis} is split unevenly, but not as a chain of outer splits (each split must cut the inner piece of the previous one); the chunk rule is defined only for chains")]
    RaggedNotChain {
        /// The logical axis.
        axis: usize,
    },
    /// A ragged axis merged with another.
    #[error("logical axis {axis} is split unevenly and merged with another axis; uneven pieces cannot be merged")]
    RaggedMerge {
        /// The logical axis.
        axis: usize,
    },
    /// The pieces of an unevenly split axis cover more elements than fit in 64 bits.
    #[error("logical axis {axis} is split into pieces whose extents multiply past 2^64")]
    ExtentOverflow {
        /// The logical axis.
        axis: usize,
    },
    /// A swizzle on an axis that is not Stream-parallel.
    #[error("loop axis {position} is swizzled along {swizzle} but is parallelized {pt}; swizzle1d is only meaningful on a Stream axis")]
    SwizzleNotStream {
        /// Loop axis position.
        position: usize,
        /// The swizzle's parallel type.
        swizzle: ParallelType,
        /// The axis' parallel type.
        pt: ParallelType,
    },
}

/// A leaf of one logical axis' split tree: a loop axis made only of splits (and swizzles) of
/// that logical axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// Position among the loop axes.
    pub position: usize,
    /// Extent.
    pub extent: u64,
    /// Global stride: how far one step of this leaf moves along the logical axis.
    pub stride: u64,
    /// Parallel type.
    pub pt: ParallelType,
    /// The swizzle's parallel type, if the loop axis is swizzled.
    pub swizzle: Option<ParallelType>,
}

/// The split tree of one logical axis, reduced to its leaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AxisLayout {
    /// Extent of the logical axis.
    pub extent: u64,
    /// True for a reduction axis.
    pub reduction: bool,
    /// Leaves in outer-to-inner order (mixed radix of the global index). Empty when the axis
    /// only feeds merges (then it is treated as one serial piece).
    pub leaves: Vec<Leaf>,
    /// True when a split of the axis does not divide: the leaves then form a chain of outer
    /// splits whose extents are those of the largest pieces (the *padded* extents), and each
    /// level cuts the actual extent of its piece by the chunk rule (see the module docs).
    /// Strides are then those of the padded extents: they describe which level a leaf is, not
    /// where its elements lie.
    pub ragged: bool,
}

impl AxisLayout {
    /// The device-parallel leaf of this axis, if any (at most one per axis is supported).
    pub fn device_leaf(&self) -> Option<&Leaf> {
        self.leaves.iter().find(|l| l.pt.is_device())
    }

    /// The Stream leaf of this axis, if any.
    pub fn stream_leaf(&self) -> Option<&Leaf> {
        self.leaves.iter().find(|l| l.pt == ParallelType::Stream)
    }

    /// The actual extent of the piece a device holds (or a stream iteration visits) along
    /// this axis, given the digit of every leaf before the innermost: `digit(k)` for leaf `k`
    /// (its team index, stream chunk or local index). `level_extent(digits, k)` is the extent of
    /// the piece that leaf `k` cuts; `level_extent(digits, leaves.len())` the last piece's.
    /// Returns `(offset, extent)` of that piece along the logical axis.
    pub fn piece(&self, digit: impl Fn(usize) -> u64, levels: usize) -> (u64, u64) {
        let (mut start, mut len) = (0u64, self.extent);
        if self.leaves.is_empty() {
            return (start, len);
        }
        for (k, leaf) in self.leaves.iter().enumerate().take(levels) {
            if k + 1 == self.leaves.len() && !self.ragged {
                break;
            }
            let d = digit(k);
            if self.ragged {
                // The chunk rule on the actual extent of this level.
                let c = len.div_ceil(leaf.extent.max(1));
                let lo = (d * c).min(len);
                let hi = ((d + 1) * c).min(len);
                start += lo;
                len = hi - lo;
            } else {
                start += d * leaf.stride;
                len = leaf.stride;
            }
        }
        (start, len)
    }

    /// Local extent: the product of the extents of leaves that are not device-parallel.
    pub fn local_extent(&self) -> u64 {
        if self.leaves.is_empty() {
            return self.extent;
        }
        self.leaves
            .iter()
            .filter(|l| !l.pt.is_device())
            .map(|l| l.extent)
            .product()
    }
}

/// Where a tensor's elements live: per logical axis, the leaves of its split tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// One entry per logical axis.
    pub axes: Vec<AxisLayout>,
}

/// A device-parallel split of a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceSplit {
    /// The parallel type.
    pub pt: ParallelType,
    /// The logical axis it splits.
    pub axis: usize,
    /// The number of parts (must equal the mesh extent along `pt`).
    pub parts: u64,
    /// True when the logical axis is a reduction axis (the tensor then holds partial sums).
    pub reduction: bool,
}

/// A Stream split of a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StreamSplit {
    /// The logical axis.
    pub axis: usize,
    /// The number of chunks (host loop trip count).
    pub chunks: u64,
    /// The swizzle's device parallel type, if any.
    pub swizzle: Option<ParallelType>,
    /// True when the stream splits the local shard of an axis that is also device-parallel.
    pub within_device_shard: bool,
}

impl Layout {
    /// Computes the layout of a replayed loop domain.
    pub fn of(domain: &LoopDomain, logical_rank: usize) -> Result<Layout, LayoutError> {
        // Parallel types may appear on at most one loop axis (Serial excepted).
        for (p1, &a) in domain.loop_axes.iter().enumerate() {
            let pt = domain.ids[a].pt;
            if pt == ParallelType::Serial {
                continue;
            }
            if let Some(p2) = domain.loop_axes[p1 + 1..]
                .iter()
                .position(|&b| domain.ids[b].pt == pt)
            {
                return Err(LayoutError::ParallelTypeUsedTwice {
                    pt,
                    first: p1,
                    second: p1 + 1 + p2,
                });
            }
        }
        let mut axes: Vec<AxisLayout> = (0..logical_rank)
            .map(|i| AxisLayout {
                extent: domain.ids[i].extent,
                reduction: domain.ids[i].reduction,
                leaves: Vec::new(),
                ragged: false,
            })
            .collect();
        // Walk each loop axis back to its logical axis through splits and swizzles.
        for (position, &id) in domain.loop_axes.iter().enumerate() {
            let pt = domain.ids[id].pt;
            let swizzle = domain.swizzle_of(id);
            if let Some(sw) = swizzle {
                if pt != ParallelType::Stream {
                    return Err(LayoutError::SwizzleNotStream {
                        position,
                        swizzle: sw,
                        pt,
                    });
                }
            }
            match trace_to_logical(domain, domain.unswizzled(id)) {
                Some(axis) => axes[axis].leaves.push(Leaf {
                    position,
                    extent: domain.ids[id].extent,
                    stride: 0,
                    pt,
                    swizzle,
                }),
                None if pt != ParallelType::Serial => {
                    return Err(LayoutError::ParallelMerge { position, pt });
                }
                None => {}
            }
        }
        for (axis, layout) in axes.iter_mut().enumerate() {
            // Order leaves by their position in the split tree (outer first).
            let order = tree_order(domain, axis);
            let mut leaves = std::mem::take(&mut layout.leaves);
            leaves.sort_by_key(|l| {
                let id = domain.loop_axes[l.position];
                order.iter().position(|&o| o == id).unwrap_or(usize::MAX)
            });
            let covered = leaves
                .iter()
                .try_fold(1u64, |acc, l| acc.checked_mul(l.extent))
                .ok_or(LayoutError::ExtentOverflow { axis })?;
            let ragged = subtree_ragged(domain, axis);
            if ragged {
                if covered != virtual_extent(domain, axis) {
                    return Err(LayoutError::RaggedMerge { axis });
                }
                if !is_chain(domain, axis) {
                    return Err(LayoutError::RaggedNotChain { axis });
                }
                layout.ragged = true;
            }
            let padded = if ragged { covered } else { layout.extent };
            if covered != padded {
                // Part of this axis went into a merge: treat it as one serial piece.
                if leaves.iter().any(|l| l.pt != ParallelType::Serial) {
                    let l = leaves
                        .iter()
                        .find(|l| l.pt != ParallelType::Serial)
                        .map(|l| (l.position, l.pt));
                    if let Some((position, pt)) = l {
                        return Err(LayoutError::ParallelMerge { position, pt });
                    }
                }
                layout.leaves = Vec::new();
                continue;
            }
            let mut stride = padded;
            for leaf in &mut leaves {
                stride /= leaf.extent.max(1);
                leaf.stride = stride;
            }
            for (k, leaf) in leaves.iter().enumerate() {
                if leaf.pt == ParallelType::Stream {
                    let first_local = leaves.iter().position(|l| !l.pt.is_device());
                    if first_local != Some(k) {
                        return Err(LayoutError::StreamNotOutermost {
                            position: leaf.position,
                            axis,
                        });
                    }
                }
            }
            layout.leaves = leaves;
        }
        Ok(Layout { axes })
    }

    /// The per-device (local) shape: logical axes in order, each of its local extent.
    pub fn local_shape(&self) -> Vec<u64> {
        self.axes.iter().map(AxisLayout::local_extent).collect()
    }

    /// The device-parallel splits, ordered `DIDx, DIDy, DIDz`.
    pub fn device_splits(&self) -> Vec<DeviceSplit> {
        let mut out: Vec<DeviceSplit> = self
            .axes
            .iter()
            .enumerate()
            .filter_map(|(axis, a)| {
                a.device_leaf().map(|l| DeviceSplit {
                    pt: l.pt,
                    axis,
                    parts: l.extent,
                    reduction: a.reduction,
                })
            })
            .collect();
        out.sort_by_key(|s| s.pt);
        out
    }

    /// The device split along `pt`, if any.
    pub fn device_split(&self, pt: ParallelType) -> Option<DeviceSplit> {
        self.device_splits().into_iter().find(|s| s.pt == pt)
    }

    /// The Stream split, if any.
    pub fn stream_split(&self) -> Option<StreamSplit> {
        self.axes.iter().enumerate().find_map(|(axis, a)| {
            a.stream_leaf().map(|l| StreamSplit {
                axis,
                chunks: l.extent,
                swizzle: l.swizzle,
                within_device_shard: a.device_leaf().is_some(),
            })
        })
    }

    /// Maps a local index (per logical axis) of the device with the given team indices to the
    /// global index, or `None` when the local index is padding (past the actual extent of an
    /// uneven piece). `team_index(pt)` returns the device's index along `pt`.
    pub fn local_to_global(
        &self,
        local: &[u64],
        team_index: impl Fn(ParallelType) -> u64,
    ) -> Option<Vec<u64>> {
        self.axes
            .iter()
            .zip(local)
            .map(|(a, &li)| {
                if a.leaves.is_empty() {
                    return Some(li);
                }
                // Decompose the local index over the non-device leaves (row-major).
                let mut rest = li;
                let mut digits = vec![0u64; a.leaves.len()];
                for (k, leaf) in a.leaves.iter().enumerate().rev() {
                    if leaf.pt.is_device() {
                        digits[k] = team_index(leaf.pt);
                    } else {
                        digits[k] = rest % leaf.extent.max(1);
                        rest /= leaf.extent.max(1);
                    }
                }
                if !a.ragged {
                    return Some(
                        a.leaves
                            .iter()
                            .zip(&digits)
                            .map(|(l, &d)| d * l.stride)
                            .sum(),
                    );
                }
                // Every level but the last cuts its piece by the chunk rule; the last digit
                // indexes into the last piece.
                let n = a.leaves.len();
                let (start, len) = a.piece(|k| digits[k], n - 1);
                let last = digits[n - 1];
                (last < len).then_some(start + last)
            })
            .collect()
    }
}

/// True when a split below logical axis `axis` is ragged.
fn subtree_ragged(domain: &LoopDomain, axis: usize) -> bool {
    fn below(domain: &LoopDomain, id: IdIndex) -> bool {
        domain.ids[id].ragged
            || domain.ids.iter().enumerate().any(|(i, d)| match d.def {
                IdDef::Split { input, .. } | IdDef::Swizzle { input, .. } if input == id => {
                    below(domain, i)
                }
                _ => false,
            })
    }
    below(domain, axis)
}

/// The extent of logical axis `axis` as its leaves cover it: the product of the largest pieces
/// of every split (the axis' own extent when every split divides).
fn virtual_extent(domain: &LoopDomain, axis: usize) -> u64 {
    fn virt(domain: &LoopDomain, id: IdIndex) -> u64 {
        let mut split = None;
        let mut swizzled = None;
        for (i, d) in domain.ids.iter().enumerate() {
            match d.def {
                IdDef::Split { input, outer: true } if input == id => split = Some((i, i + 1)),
                IdDef::Swizzle { input, .. } if input == id => swizzled = Some(i),
                _ => {}
            }
        }
        match (split, swizzled) {
            (Some((o, i)), _) => virt(domain, o).saturating_mul(virt(domain, i)),
            (None, Some(s)) => virt(domain, s),
            (None, None) => domain.ids[id].extent,
        }
    }
    virt(domain, axis)
}

/// True when every split of logical axis `axis` cuts the inner piece of the previous one (no
/// outer piece is split again).
fn is_chain(domain: &LoopDomain, axis: usize) -> bool {
    let mut node = axis;
    loop {
        let mut next = None;
        for (i, d) in domain.ids.iter().enumerate() {
            match d.def {
                IdDef::Split { input, outer: true } if input == node => {
                    // The outer piece must be a leaf (possibly swizzled).
                    let outer_split = domain.ids.iter().any(|e| {
                        matches!(e.def, IdDef::Split { input: x, .. } if x == i || domain.unswizzled(x) == i)
                    });
                    if outer_split {
                        return false;
                    }
                    next = Some(i + 1);
                }
                IdDef::Swizzle { input, .. } if input == node => next = Some(i),
                _ => {}
            }
        }
        match next {
            Some(n) => node = n,
            None => return true,
        }
    }
}

/// The logical axis a split/swizzle-only domain comes from, or `None` when a merge is involved.
fn trace_to_logical(domain: &LoopDomain, mut id: IdIndex) -> Option<usize> {
    loop {
        match domain.ids[id].def {
            IdDef::Logical(axis) => return Some(axis),
            IdDef::Split { input, .. } | IdDef::Swizzle { input, .. } => id = input,
            IdDef::Merge { .. } => return None,
        }
    }
}

/// The split-tree leaves of logical axis `axis` in outer-to-inner order. Swizzles are
/// transparent: a swizzled domain stands where its input stood.
fn tree_order(domain: &LoopDomain, axis: usize) -> Vec<IdIndex> {
    // children[id] = (outer, inner) for split domains; swizzled[id] = the swizzle made of id.
    let mut children: Vec<Option<(IdIndex, IdIndex)>> = vec![None; domain.ids.len()];
    let mut swizzled: Vec<Option<IdIndex>> = vec![None; domain.ids.len()];
    for (i, d) in domain.ids.iter().enumerate() {
        match d.def {
            IdDef::Split { input, outer: true } => children[input] = Some((i, i + 1)),
            IdDef::Swizzle { input, .. } => swizzled[input] = Some(i),
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut stack = vec![axis];
    while let Some(id) = stack.pop() {
        match (children[id], swizzled[id]) {
            (Some((o, i)), _) => {
                stack.push(i);
                stack.push(o);
            }
            (None, Some(s)) => stack.push(s),
            (None, None) => out.push(id),
        }
    }
    out
}
