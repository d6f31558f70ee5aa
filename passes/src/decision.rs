//! The decision table: which communication a resharding `set` (producer -> consumer) is.
//!
//! | change (per parallel type `pt`) | decision |
//! |---|---|
//! | split on `a` -> replicated, same mesh | [`Decision::AllGather`] |
//! | split on `a` -> Stream on `a` with `swizzle1d(pt)` | [`Decision::Ring`] (collective permutes) |
//! | split on `a` -> Stream on `a`, no swizzle | [`Decision::StreamBroadcast`] (root = loop index) |
//! | replicated -> split on `b`, same mesh | [`Decision::LocalSlice`] (the data is already there) |
//! | split on `a` -> split on `b` | [`Decision::AllToAll`] |
//! | partial sums -> replicated | [`Decision::AllReduce`] / [`Decision::Reduce`] (other mesh) |
//! | partial sums -> split on `b` | [`Decision::ReduceScatter`] |
//! | the innermost splits of `a` (several parallel types, outer mesh axis first, even) -> replicated | [`Decision::MergedAllGather`] (over their flattened team) |
//! | partial sums along several parallel types -> replicated | [`Decision::MergedAllReduce`] (over their flattened team) |
//! | partial sums along several parallel types -> the innermost splits of `b` (outer mesh axis first, even) | [`Decision::MergedReduceScatter`] (over their flattened team) |
//! | strided split on `a` (inside serial pieces) -> gathered | [`Decision::StridedAllGather`] (then a local reorder) |
//! | replicated -> strided split on `b` | [`Decision::StridedSlice`] (each device keeps its chunk of every serial piece) |
//! | partial sums with a Stream split on `a` and `swizzle1d(pt)` -> split on `a` | [`Decision::ReduceRing`] (a ring of running sums) |
//! | partial sums with a Stream split on `a`, no swizzle -> split on `a` | [`Decision::StreamReduce`] (root = loop index) |
//! | replicated -> replicated, other mesh | [`Decision::Broadcast`] (to the target mesh) |
//! | same splits, other mesh of the same shape | [`Decision::SendRecv`] (one per device pair; a device that keeps its shard copies it) |
//! | split on a 1-D mesh -> replicated on devices of that mesh | [`Decision::Gather`] |
//! | replicated -> split on a 1-D mesh sharing a device | [`Decision::Scatter`] |
//!
//! Rooted collectives need every member to hold the send buffer (and the scatter root to
//! hold it), so `gather`/`reduce` to another mesh need its devices inside the sender mesh and
//! `scatter` a sender inside the receiving mesh; between disjoint meshes the change is split
//! into steps (e.g. all-gather on the source mesh, then a broadcast or per-pair transfer).
//!
//! Axes are value-axis indices (= host axes). A consumer with a Stream split on another axis
//! makes any of these per-chunk (lowered inside the stream loop). Changes on several parallel
//! types at once are one collective over their flattened team (`flattened(m, DIDy, DIDx)`) only
//! in the three merged rows, which DTensor's planner merges too: the members of a flattened team
//! are in row-major order of the mesh axes, so the changed splits must be the innermost levels
//! of their axis' chain in mesh order (outer mesh axis outermost) and divide the axis evenly
//! (over uneven pieces one collective over the flattened team cuts the axis differently from
//! nested ones). Other changes on several parallel types are [`Decision::Unsupported`] here;
//! `decompose_reshardings` splits them into steps.

use std::collections::BTreeMap;

use meshflow_ir::{DeviceMesh, ParallelType};

use crate::analysis::Sharding;
use crate::redistribute::{normalized, placements_of, Cut};
use crate::resharding;

/// Where a tensor's data lies along one device parallel type, in value-axis terms.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split on value axis `axis` into `parts`, at position `depth` of the axis' chain.
    Split {
        /// Value axis.
        axis: usize,
        /// Parts.
        parts: u64,
        /// Position in the axis' chain of splits (0 = outermost).
        depth: usize,
    },
    /// Each device holds a partial sum (a split reduction axis).
    Partial,
}

/// Device placements by parallel type, in value-axis terms.
pub fn placements(sh: &Sharding) -> BTreeMap<ParallelType, Placement> {
    sh.spec
        .device
        .iter()
        .map(|(&pt, s)| {
            let p = match sh.value_index(s.axis) {
                Some(axis) => Placement::Split {
                    axis,
                    parts: s.parts,
                    depth: s.depth,
                },
                None => Placement::Partial,
            };
            (pt, p)
        })
        .collect()
}

/// `split on axis 1`, `partial sums` or `replicated`.
fn describe(p: Option<Placement>) -> String {
    match p {
        Some(Placement::Split { axis, .. }) => format!("a split of axis {axis}"),
        Some(Placement::Partial) => "partial sums".into(),
        None => "replicated".into(),
    }
}

/// One row of the decision table (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No data moves: a local copy.
    LocalCopy,
    /// All-gather of value axis `axis` over the `pt` team.
    AllGather {
        /// The parallel type.
        pt: ParallelType,
        /// The gathered value axis.
        axis: usize,
    },
    /// A ring of collective permutes in a stream loop over `axis`.
    Ring {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// A broadcast per stream iteration, rooted at the loop index.
    StreamBroadcast {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Replicated to split on the same mesh: each device slices its own chunk.
    LocalSlice {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Split on `from` to split on `to`.
    AllToAll {
        /// The parallel type.
        pt: ParallelType,
        /// The producer's split value axis.
        from: usize,
        /// The consumer's split value axis.
        to: usize,
    },
    /// Partial sums to replicated, same mesh.
    AllReduce {
        /// The parallel type.
        pt: ParallelType,
    },
    /// Partial sums to split on `axis`.
    ReduceScatter {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// The innermost splits of value axis `axis` along `pts` (outer mesh axis first) to
    /// replicated: one all-gather over their flattened team.
    MergedAllGather {
        /// The parallel types, outer mesh axis first.
        pts: Vec<ParallelType>,
        /// The gathered value axis.
        axis: usize,
    },
    /// Partial sums along `pts` (outer mesh axis first) to replicated: one all-reduce over
    /// their flattened team.
    MergedAllReduce {
        /// The parallel types, outer mesh axis first.
        pts: Vec<ParallelType>,
    },
    /// Partial sums along `pts` (outer mesh axis first) to the innermost splits of value axis
    /// `axis`, in that order: one reduce-scatter over their flattened team.
    MergedReduceScatter {
        /// The parallel types, outer mesh axis first.
        pts: Vec<ParallelType>,
        /// The value axis.
        axis: usize,
    },
    /// The innermost split of value axis `axis` along `pt` inside `serial` serial pieces (a
    /// strided layout: the device holds its chunk of every piece, in piece order) to the
    /// chain without it: an all-gather over the `pt` team (blocks in member order), then a local
    /// reorder of the `[member, piece]` blocks into `[piece, member]`.
    StridedAllGather {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
        /// The serial pieces a device holds along the axis (the product of the serial splits).
        serial: u64,
    },
    /// A new innermost split of value axis `axis` along `pt` inside `serial` serial pieces (a
    /// strided target): each device keeps its chunk of every piece, locally.
    StridedSlice {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
        /// The serial pieces a device holds along the axis afterwards.
        serial: u64,
    },
    /// Partial sums computed chunk by chunk in a swizzled stream loop over `axis` (one chunk
    /// per team member) to split on `axis`: running sums travel around a ring of neighbours,
    /// each rank adding its partial product of the chunk on arrival.
    ReduceRing {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Partial sums computed chunk by chunk in a stream loop over `axis` (no swizzle, one chunk
    /// per team member) to split on `axis`: a reduce per iteration, rooted at the loop index.
    StreamReduce {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Same splits on another mesh of the same shape: one transfer per device pair.
    SendRecv,
    /// Replicated to replicated on another mesh.
    Broadcast,
    /// Split (1-D producer mesh) to replicated on another mesh: one gather per receiver.
    Gather {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Replicated to split on another 1-D mesh.
    Scatter {
        /// The parallel type.
        pt: ParallelType,
        /// The value axis.
        axis: usize,
    },
    /// Partial sums (1-D producer mesh) to replicated on another mesh: one reduce per receiver.
    Reduce {
        /// The parallel type.
        pt: ParallelType,
    },
    /// Not a row of the table.
    Unsupported(String),
}

impl Decision {
    /// A short description, e.g. `all_gather over DIDx`.
    pub fn describe(&self) -> String {
        match self {
            Decision::LocalCopy => "local copy".into(),
            Decision::AllGather { pt, .. } => format!("all_gather over {pt}"),
            Decision::Ring { pt, .. } => format!("collective_permute ring over {pt}"),
            Decision::StreamBroadcast { pt, .. } => format!("stream broadcast over {pt}"),
            Decision::LocalSlice { pt, .. } => format!("local slice along {pt}"),
            Decision::AllToAll { pt, .. } => format!("all_to_all over {pt}"),
            Decision::AllReduce { pt } => format!("all_reduce over {pt}"),
            Decision::ReduceScatter { pt, .. } => format!("reduce_scatter over {pt}"),
            Decision::ReduceRing { pt, .. } => format!("reduce_scatter ring over {pt}"),
            Decision::StreamReduce { pt, .. } => format!("stream reduce over {pt}"),
            Decision::StridedAllGather { pt, serial, .. } => {
                format!("all_gather over {pt} of {serial} strided pieces")
            }
            Decision::StridedSlice { pt, serial, .. } => {
                format!("local slice along {pt} of {serial} strided pieces")
            }
            Decision::MergedAllGather { pts, .. } => format!("all_gather over {}", names(pts)),
            Decision::MergedAllReduce { pts } => format!("all_reduce over {}", names(pts)),
            Decision::MergedReduceScatter { pts, .. } => {
                format!("reduce_scatter over {}", names(pts))
            }
            Decision::SendRecv => "send_recv per device pair".into(),
            Decision::Broadcast => "broadcast to another mesh".into(),
            Decision::Gather { pt, .. } => format!("gather over {pt} to another mesh"),
            Decision::Scatter { pt, .. } => format!("scatter over {pt} to another mesh"),
            Decision::Reduce { pt } => format!("reduce over {pt} to another mesh"),
            Decision::Unsupported(why) => format!("unsupported: {why}"),
        }
    }
}

/// `DIDy, DIDx`.
fn names(pts: &[ParallelType]) -> String {
    pts.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
}

/// Per value axis of `sh`, its device splits over teams of more than one device, outermost
/// first: `(parallel type, parts)`.
fn chain_of(sh: &Sharding, axis: usize) -> Vec<(ParallelType, u64)> {
    let mut levels: Vec<(usize, ParallelType, u64)> = placements(sh)
        .into_iter()
        .filter_map(|(pt, p)| match p {
            Placement::Split {
                axis: a,
                parts,
                depth,
            } if a == axis && parts > 1 => Some((depth, pt, parts)),
            _ => None,
        })
        .collect();
    levels.sort();
    levels
        .into_iter()
        .map(|(_, pt, parts)| (pt, parts))
        .collect()
}

/// One of the merged rows for a change along several parallel types `changed` at once, if
/// it is one (see the module docs).
fn merged(p: &Sharding, c: &Sharding, changed: &[ParallelType], stream: bool) -> Option<Decision> {
    if stream || p.stream().is_some() || c.stream().is_some() {
        return None;
    }
    let (pv, cv) = (placements(p), placements(c));
    let mut pts = changed.to_vec();
    pts.sort_by_key(|pt| std::cmp::Reverse(pt.device_rank()));
    if pts
        .iter()
        .all(|pt| pv.get(pt) == Some(&Placement::Partial) && !cv.contains_key(pt))
    {
        return Some(Decision::MergedAllReduce { pts });
    }
    // The innermost levels of `sh`'s chain on `axis` are `pts` in mesh order and the whole
    // chain divides the axis evenly; the other side keeps the rest of the chain.
    let innermost = |sh: &Sharding, other: &Sharding, axis: usize| -> bool {
        if sh.spec.is_strided() || other.spec.is_strided() {
            return false;
        }
        let chain = chain_of(sh, axis);
        let k = pts.len();
        let Some(rest) = chain.len().checked_sub(k) else {
            return false;
        };
        let inner: Vec<ParallelType> = chain[rest..].iter().map(|&(pt, _)| pt).collect();
        let parts: u64 = chain.iter().map(|&(_, n)| n).product();
        let even = sh
            .value_axes
            .get(axis)
            .and_then(|&a| sh.layout.axes.get(a))
            .is_some_and(|x| !x.ragged && x.extent.is_multiple_of(parts));
        inner == pts && even && chain_of(other, axis) == chain[..rest]
    };
    let split_axis = |v: &BTreeMap<ParallelType, Placement>| -> Option<usize> {
        let axes: Vec<usize> = pts
            .iter()
            .map(|pt| match v.get(pt) {
                Some(Placement::Split { axis, .. }) => Some(*axis),
                _ => None,
            })
            .collect::<Option<_>>()?;
        axes.windows(2).all(|w| w[0] == w[1]).then(|| axes[0])
    };
    if pts.iter().all(|pt| !cv.contains_key(pt)) {
        let axis = split_axis(&pv)?;
        return innermost(p, c, axis).then_some(Decision::MergedAllGather { pts, axis });
    }
    if pts.iter().all(|pt| pv.get(pt) == Some(&Placement::Partial)) {
        let axis = split_axis(&cv)?;
        return innermost(c, p, axis).then_some(Decision::MergedReduceScatter { pts, axis });
    }
    None
}

/// The serial pieces outside the `pt` split of value axis `axis` of `sh` (the product of the
/// serial splits before it in the axis' chain; 1 when there are none): a device holds one
/// piece of its `pt` chunk per serial piece. Serial splits inside the `pt` split cut its
/// chunk only and do not count.
fn serial_on(sh: &Sharding, axis: usize, pt: ParallelType) -> u64 {
    let Some(&a) = sh.value_axes.get(axis) else {
        return 1;
    };
    let depth = sh.spec.device.get(&pt).map_or(usize::MAX, |s| s.depth);
    sh.spec
        .serial
        .iter()
        .filter(|s| s.axis == a && s.depth < depth)
        .map(|s| s.parts)
        .product()
}

/// True when value axis `axis` of `sh` has a serial split with a device split inside it.
fn strided_on(sh: &Sharding, axis: usize) -> bool {
    sh.value_axes
        .get(axis)
        .is_some_and(|&a| sh.spec.is_strided_on(a))
}

/// Per value axis of `sh`, its chain of cuts without splits over teams of one device.
fn cut_chains(sh: &Sharding, mesh: &DeviceMesh) -> Vec<Vec<Cut>> {
    placements_of(sh)
        .chains
        .into_iter()
        .map(|c| {
            normalized(
                c.into_iter()
                    .filter(|cut| {
                        cut.device()
                            .is_none_or(|pt| mesh.size_of(pt).unwrap_or(1) > 1)
                    })
                    .collect(),
            )
        })
        .collect()
}

/// True when value axis `axis` of `sh` is split unevenly.
fn ragged_on(sh: &Sharding, axis: usize) -> bool {
    sh.value_axes
        .get(axis)
        .and_then(|&a| sh.layout.axes.get(a))
        .is_some_and(|x| x.ragged)
}

/// `d` for strided layouts: a gather of a strided axis or a slice into one becomes its
/// strided row; any other row touching a strided axis is refused (the planner reaches and
/// leaves strided chains through gathers and slices only).
fn strided(p: &Sharding, pm: &DeviceMesh, c: &Sharding, cm: &DeviceMesh, d: Decision) -> Decision {
    if !p.spec.is_strided() && !c.spec.is_strided() {
        return d;
    }
    // The same device digits with other serial pieces around them hold other elements.
    if d == Decision::LocalCopy && cut_chains(p, pm) != cut_chains(c, cm) {
        return Decision::Unsupported(
            "the serial pieces of a strided axis change (decompose_reshardings gathers and \
             slices it)"
                .into(),
        );
    }
    let strided_axis = |axis: usize| strided_on(p, axis) || strided_on(c, axis);
    let uneven = |sh: &Sharding, axis: usize| {
        Decision::Unsupported(format!(
            "value axis {axis} is strided (a split inside serial pieces) and split unevenly \
             (extent {}): strided layouts need every split to divide",
            sh.value_axes
                .get(axis)
                .and_then(|&a| sh.layout.axes.get(a))
                .map_or(0, |x| x.extent)
        ))
    };
    match d {
        Decision::AllGather { axis, .. } | Decision::LocalSlice { axis, .. }
            if strided_axis(axis) && (ragged_on(p, axis) || ragged_on(c, axis)) =>
        {
            uneven(p, axis)
        }
        Decision::AllGather { pt, axis } if serial_on(p, axis, pt) > 1 => {
            Decision::StridedAllGather {
                pt,
                axis,
                serial: serial_on(p, axis, pt),
            }
        }
        Decision::LocalSlice { pt, axis } if serial_on(c, axis, pt) > 1 => Decision::StridedSlice {
            pt,
            axis,
            serial: serial_on(c, axis, pt),
        },
        // A gather or slice of a split outside every serial piece of the axis moves whole
        // chunks in member order, as on a plain chain.
        d @ (Decision::AllGather { .. } | Decision::LocalSlice { .. }) => d,
        Decision::ReduceScatter { axis, .. }
        | Decision::Ring { axis, .. }
        | Decision::StreamBroadcast { axis, .. }
        | Decision::ReduceRing { axis, .. }
        | Decision::StreamReduce { axis, .. }
        | Decision::Gather { axis, .. }
        | Decision::Scatter { axis, .. }
            if strided_axis(axis) =>
        {
            Decision::Unsupported(format!(
                "value axis {axis} is strided (a split inside serial pieces): it is only \
                 gathered (from its innermost split) or sliced (into a strided target) on one \
                 mesh, never a {}",
                d.describe()
            ))
        }
        Decision::AllToAll { from, to, .. } if strided_axis(from) || strided_axis(to) => {
            Decision::Unsupported(format!(
                "an all-to-all between value axes {from} and {to}, one of them strided (a \
                 split inside serial pieces): gather the strided axis first"
            ))
        }
        Decision::SendRecv | Decision::Broadcast => Decision::Unsupported(
            "a strided layout (a split inside serial pieces) moves between meshes only \
             gathered"
                .into(),
        ),
        d => d,
    }
}

/// The decision for `c = set(p)`.
pub fn decide(p: &Sharding, pm: &DeviceMesh, c: &Sharding, cm: &DeviceMesh) -> Decision {
    strided(p, pm, c, cm, decide_plain(p, pm, c, cm))
}

/// [`decide`] before the strided rows.
fn decide_plain(p: &Sharding, pm: &DeviceMesh, c: &Sharding, cm: &DeviceMesh) -> Decision {
    let r = resharding::analyze(p, pm, c, cm);
    let pv = placements(p);
    let cv = placements(c);
    if r.mesh_changed {
        let one = |v: &BTreeMap<ParallelType, Placement>| {
            (v.len() == 1)
                .then(|| v.iter().next().map(|(&pt, &pl)| (pt, pl)))
                .flatten()
        };
        let no_partial = !pv.values().any(|p| *p == Placement::Partial);
        if pv.is_empty() && cv.is_empty() {
            return Decision::Broadcast;
        }
        if pv == cv && no_partial && pm.shape() == cm.shape() {
            return Decision::SendRecv;
        }
        // Rooted collectives need the root to hold the send buffer (gather, reduce: every
        // receiver is in the sender mesh) or one sender in the receiving mesh (scatter).
        let receivers_send = cm.devices().iter().all(|&d| pm.contains(d));
        if cv.is_empty() && pm.ndims() == 1 && receivers_send {
            match one(&pv) {
                Some((pt, Placement::Split { axis, .. })) => return Decision::Gather { pt, axis },
                Some((pt, Placement::Partial)) => return Decision::Reduce { pt },
                None => {}
            }
        }
        let sender_receives = pm.devices().iter().any(|&d| cm.contains(d));
        if pv.is_empty() && cm.ndims() == 1 && sender_receives {
            if let Some((pt, Placement::Split { axis, .. })) = one(&cv) {
                return Decision::Scatter { pt, axis };
            }
        }
        return Decision::Unsupported(
            "the mesh changes together with the sharding in a way no single communication \
             covers (decompose_reshardings splits it into steps)"
                .into(),
        );
    }
    let Some(&pt) = r.device.first() else {
        return Decision::LocalCopy;
    };
    if r.device.len() > 1 {
        if let Some(d) = merged(p, c, &r.device, r.stream) {
            return d;
        }
        let pts: Vec<&str> = r.device.iter().map(|p| p.name()).collect();
        return Decision::Unsupported(format!(
            "the sharding changes along {} at once (decompose_reshardings splits this into steps)",
            pts.join(" and ")
        ));
    }
    let team = pm.size_of(pt).unwrap_or(1) as u64;
    // One step changes the innermost split of a chain: a split with others inside it cuts
    // pieces they cut again, so it can be neither gathered nor added alone.
    let inner = |sh: &Sharding, what: &str| -> Option<String> {
        let Some(Placement::Split { axis, depth, .. }) = placements(sh).get(&pt).copied() else {
            return None;
        };
        // Splits inside this one over teams of one device cut nothing.
        let inside = placements(sh).iter().any(|(&q, p)| {
            matches!(*p, Placement::Split { axis: a, depth: d, parts } if a == axis && d > depth && parts > 1 && q != pt)
        });
        inside.then(|| {
            format!(
                "the {what}'s {pt} split is not the innermost split of its axis (the splits \
                 inside it must change first)"
            )
        })
    };
    if let Some(why) = inner(p, "producer").or_else(|| inner(c, "consumer")) {
        return Decision::Unsupported(why);
    }
    match (pv.get(&pt).copied(), cv.get(&pt).copied()) {
        (Some(Placement::Split { axis, .. }), None) if r.stream => {
            let Some(cs) = c.stream() else {
                return Decision::Unsupported(
                    "internal: stream resharding without a stream".into(),
                );
            };
            if c.value_index(cs.axis) != Some(axis) {
                return Decision::Unsupported(format!(
                    "the consumer's Stream split is on another axis than the {pt} split being gathered"
                ));
            }
            if cs.chunks != team {
                return Decision::Unsupported(format!(
                    "gathering a {pt} split over a Stream axis needs one chunk per team member \
                     ({team}), not {}",
                    cs.chunks
                ));
            }
            match cs.swizzle {
                Some(sw) if sw == pt => Decision::Ring { pt, axis },
                None => Decision::StreamBroadcast { pt, axis },
                Some(sw) => Decision::Unsupported(format!(
                    "swizzle1d along {sw} on a Stream axis that gathers a {pt} split"
                )),
            }
        }
        (Some(Placement::Split { axis, .. }), None) => Decision::AllGather { pt, axis },
        (Some(Placement::Partial), None) => Decision::AllReduce { pt },
        (Some(Placement::Partial), Some(Placement::Split { axis, .. })) => match p.stream() {
            Some(ps)
                if c.stream().is_none()
                    && ps.chunks == team
                    && p.value_index(ps.axis) == Some(axis) =>
            {
                match ps.swizzle {
                    Some(sw) if sw == pt => Decision::ReduceRing { pt, axis },
                    None => Decision::StreamReduce { pt, axis },
                    Some(_) => Decision::ReduceScatter { pt, axis },
                }
            }
            _ => Decision::ReduceScatter { pt, axis },
        },
        (None, Some(Placement::Split { axis, .. })) => Decision::LocalSlice { pt, axis },
        (Some(Placement::Split { axis: from, .. }), Some(Placement::Split { axis: to, .. }))
            if from != to =>
        {
            Decision::AllToAll { pt, from, to }
        }
        (_, Some(Placement::Partial)) => Decision::Unsupported(format!(
            "the consumer holds partial sums along {pt} but the producer does not: nothing \
             creates partial sums (Replicate -> Partial is refused, as in DTensor)"
        )),
        (p, c) => Decision::Unsupported(format!(
            "no communication turns {} into {} along {pt}",
            describe(p),
            describe(c)
        )),
    }
}
