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
//! makes any of these per-chunk (lowered inside the stream loop). Changes on two parallel types
//! at once are [`Decision::Unsupported`] here; `decompose_reshardings` splits them into steps.

use std::collections::BTreeMap;

use meshflow_ir::{DeviceMesh, ParallelType};

use crate::analysis::Sharding;
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
            Decision::SendRecv => "send_recv per device pair".into(),
            Decision::Broadcast => "broadcast to another mesh".into(),
            Decision::Gather { pt, .. } => format!("gather over {pt} to another mesh"),
            Decision::Scatter { pt, .. } => format!("scatter over {pt} to another mesh"),
            Decision::Reduce { pt } => format!("reduce over {pt} to another mesh"),
            Decision::Unsupported(why) => format!("unsupported: {why}"),
        }
    }
}

/// The decision for `c = set(p)`.
pub fn decide(p: &Sharding, pm: &DeviceMesh, c: &Sharding, cm: &DeviceMesh) -> Decision {
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
