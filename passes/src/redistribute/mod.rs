//! Planning a resharding on one mesh as a sequence of steps, each one collective (or none):
//! DTensor's redistribute planner over chains of splits, with its merging of consecutive
//! collectives into one over a flattened team.
//!
//! A [`Placements`] lists, per value axis, its chain of [`Cut`]s, outermost first: the device
//! parallel types splitting it and the serial splits a device split lies inside (a strided
//! layout, DTensor's `_StridedShard`), and the parallel types along which the tensor holds
//! partial sums. A step changes one parallel type, or several at once when one collective over
//! their flattened team does it:
//!
//! | move | effect | communication |
//! |---|---|---|
//! | gather | drop the innermost split of an axis (and the serial splits just outside it) | `all_gather` |
//! | merged gather | drop the innermost `k` splits of a plain chain, outer mesh axis first, evenly divided | `all_gather` over their flattened team |
//! | slice | append a split to a plain chain, or the next split of a strided target | none (each device keeps its piece) |
//! | all-to-all | move the innermost split of a plain chain to the end of another plain chain | `all_to_all` |
//! | reduce | partial sums to replicated, along one or several parallel types | `all_reduce` (over a flattened team for several) |
//! | reduce-scatter | partial sums to the end of a plain chain; several at once outer mesh axis first and evenly divided | `reduce_scatter` |
//!
//! The merges follow DTensor's rules: consecutive steps of the same kind on one axis, gathers
//! undoing the inner mesh axis first (so the chain's levels are in mesh order), reduce-scatters
//! appending the outer one first and dividing evenly (over uneven pieces one reduce-scatter
//! over the flattened team would cut the axis differently from two nested ones), all-reduces
//! over any set of parallel types, never an all-to-all.
//!
//! Only the innermost split of a chain can be undone (the others cut pieces that it cuts
//! again), and a new split always cuts the innermost piece, exactly as DTensor's shard order
//! works. A strided chain is reached and left only through these prefixes: its splits are
//! gathered from the inside out and added from the outside in, as DTensor takes
//! `_StridedShard` through `Replicate`. Nothing creates partial sums: a target holding partial
//! sums along a parallel type the source does not is unreachable (DTensor refuses
//! `Replicate -> Partial` too).
//!
//! [`plan`] searches the cheapest sequence (Dijkstra): fewest communications first, then
//! fewest elements moved (an all-gather moves its output, an all-to-all and a reduce-scatter
//! their input, an all-reduce twice its buffer), then fewest steps. `[S0, S0] -> [S0, R]` is
//! one all-gather over the inner mesh axis; `[S0, S0] -> [R, R]` one all-gather over the
//! flattened mesh; `[S0, S1] -> [S1, S0]` an all-gather, an all-to-all and a slice;
//! `[P, S0] -> [S0, S0]` an all-gather, a reduce-scatter and a slice.

mod convert;
mod moves;
#[cfg(test)]
mod tests;

pub use convert::{materialize, placements_of};

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use meshflow_ir::ParallelType;

/// One level of an axis' chain of splits.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cut {
    /// A split over the devices of a parallel type's team.
    Device(ParallelType),
    /// A serial split into this many pieces, with a device split inside it (strided).
    Serial(u64),
}

impl Cut {
    /// The parallel type of a device cut.
    pub fn device(self) -> Option<ParallelType> {
        match self {
            Cut::Device(pt) => Some(pt),
            Cut::Serial(_) => None,
        }
    }
}

/// True when a chain has no serial cut (not strided).
pub fn is_plain(chain: &[Cut]) -> bool {
    chain.iter().all(|c| matches!(c, Cut::Device(_)))
}

/// `chain` without serial cuts after its last device cut (they only shape the local buffer).
pub fn normalized(mut chain: Vec<Cut>) -> Vec<Cut> {
    chain.retain(|c| *c != Cut::Serial(1));
    while matches!(chain.last(), Some(Cut::Serial(_))) {
        chain.pop();
    }
    chain
}

/// Where a tensor's data lies over a mesh, in value-axis terms.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Placements {
    /// Per value axis, its chain of cuts, outermost first (never ending in a serial cut).
    pub chains: Vec<Vec<Cut>>,
    /// The parallel types along which the tensor holds partial sums.
    pub partial: BTreeSet<ParallelType>,
}

impl Placements {
    /// No splits and no partial sums on `rank` value axes.
    pub fn replicated(rank: usize) -> Placements {
        Placements {
            chains: vec![Vec::new(); rank],
            partial: BTreeSet::new(),
        }
    }

    /// The parallel types used (splits and partial sums).
    pub fn used(&self) -> BTreeSet<ParallelType> {
        self.chains
            .iter()
            .flatten()
            .filter_map(|c| c.device())
            .chain(self.partial.iter().copied())
            .collect()
    }

    /// Per value axis, the local extent on a device: the chain's cuts cut the axis level by
    /// level, rounding up (the largest piece), and a device keeps every serial piece.
    pub fn local_extents(&self, extents: &[u64], sizes: &BTreeMap<ParallelType, u64>) -> Vec<u64> {
        self.chains
            .iter()
            .zip(extents)
            .map(|(chain, &e)| {
                let mut serial = 1u64;
                let piece = chain.iter().fold(e, |e, cut| {
                    let d = match *cut {
                        Cut::Device(pt) => sizes.get(&pt).copied().unwrap_or(1),
                        Cut::Serial(f) => {
                            serial = serial.saturating_mul(f);
                            f
                        }
                    };
                    e.div_ceil(d.max(1))
                });
                piece.saturating_mul(serial)
            })
            .collect()
    }

    /// Elements a device holds.
    pub fn local_numel(&self, extents: &[u64], sizes: &BTreeMap<ParallelType, u64>) -> u128 {
        self.local_extents(extents, sizes)
            .iter()
            .map(|&e| u128::from(e))
            .product()
    }

    /// DTensor-style text, per value axis: `[S(DIDy, DIDx), S(serial 3, DIDx), R]` and
    /// `partial over DIDz`.
    pub fn describe(&self) -> String {
        let axes: Vec<String> = self
            .chains
            .iter()
            .map(|c| {
                if c.is_empty() {
                    "R".to_string()
                } else {
                    let cuts: Vec<String> = c
                        .iter()
                        .map(|cut| match cut {
                            Cut::Device(pt) => pt.name().to_string(),
                            Cut::Serial(f) => format!("serial {f}"),
                        })
                        .collect();
                    format!("S({})", cuts.join(", "))
                }
            })
            .collect();
        let mut s = format!("[{}]", axes.join(", "));
        if !self.partial.is_empty() {
            let pts: Vec<&str> = self.partial.iter().map(|p| p.name()).collect();
            s.push_str(&format!(" partial over {}", pts.join(", ")));
        }
        s
    }
}

/// One step's cost: communications, elements moved, steps.
type Cost = (u32, u128, u32);

/// The cheapest sequence of placements from `from` to `to`, each one step from the previous
/// (both ends excluded), or `None` when `to` cannot be reached. `sizes` gives the team size of
/// every device parallel type of the mesh; `allowed` filters the intermediate placements
/// (e.g. those whose splits fit the tensor).
pub fn plan(
    from: &Placements,
    to: &Placements,
    extents: &[u64],
    sizes: &BTreeMap<ParallelType, u64>,
    allowed: &dyn Fn(&Placements) -> bool,
    merge: bool,
) -> Option<Vec<Placements>> {
    if from == to {
        return Some(Vec::new());
    }
    if from.chains.len() != to.chains.len() || !to.partial.is_subset(&from.partial) {
        return None;
    }
    let space = moves::Space {
        pts: sizes.keys().copied().collect(),
        extents,
        sizes,
        target: to,
        merge: false,
    };
    let path = search(&space, from, to, allowed)?;
    if !merge {
        return Some(path);
    }
    let merging = moves::Space {
        merge: true,
        ..space
    };
    Some(merge_steps(&merging, from, path, to))
}

/// What one step does, for merging: a gather of an axis, reductions, or a reduce-scatter
/// onto an axis (`None` for anything else).
#[derive(Copy, Clone, PartialEq, Eq)]
enum Kind {
    Gather(usize),
    Reduce,
    ReduceScatter(usize),
}

fn kind(a: &Placements, b: &Placements) -> Option<Kind> {
    let changed: Vec<usize> = (0..a.chains.len())
        .filter(|&k| a.chains[k] != b.chains[k])
        .collect();
    let reduces = b.partial.is_subset(&a.partial) && b.partial.len() < a.partial.len();
    match (changed.as_slice(), reduces) {
        ([], true) => Some(Kind::Reduce),
        (&[k], false) if a.partial == b.partial && a.chains[k].starts_with(&b.chains[k]) => {
            Some(Kind::Gather(k))
        }
        (&[k], true) if b.chains[k].starts_with(&a.chains[k]) => Some(Kind::ReduceScatter(k)),
        _ => None,
    }
}

/// DTensor's merging of consecutive collectives: runs of steps of the same kind (gathers of
/// one axis, reductions, reduce-scatters onto one axis) become one step where a merged move
/// ([`moves::Space`] with `merge`) reaches the run's end directly.
fn merge_steps(
    space: &moves::Space<'_>,
    from: &Placements,
    path: Vec<Placements>,
    to: &Placements,
) -> Vec<Placements> {
    let mut all = vec![from.clone()];
    all.extend(path);
    all.push(to.clone());
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < all.len() {
        let k0 = kind(&all[i], &all[i + 1]);
        let mut j = i + 1;
        if k0.is_some() {
            let next = space.moves(&all[i]);
            let mut end = i + 1;
            while end + 1 < all.len() && kind(&all[end], &all[end + 1]) == k0 {
                end += 1;
                if next.iter().any(|(n, c)| n == &all[end] && c.0 == 1) {
                    j = end;
                }
            }
        }
        if j + 1 < all.len() {
            out.push(all[j].clone());
        }
        i = j;
    }
    out
}

/// Dijkstra over `space` (see [`plan`]).
fn search(
    space: &moves::Space<'_>,
    from: &Placements,
    to: &Placements,
    allowed: &dyn Fn(&Placements) -> bool,
) -> Option<Vec<Placements>> {
    let mut best: HashMap<Placements, Cost> = HashMap::new();
    let mut prev: HashMap<Placements, Placements> = HashMap::new();
    let mut heap: BinaryHeap<Reverse<(Cost, u64, Placements)>> = BinaryHeap::new();
    let mut seq = 0u64;
    best.insert(from.clone(), (0, 0, 0));
    heap.push(Reverse(((0, 0, 0), seq, from.clone())));
    while let Some(Reverse((cost, _, s))) = heap.pop() {
        if best.get(&s).is_some_and(|&c| c < cost) {
            continue;
        }
        if &s == to {
            let mut path = Vec::new();
            let mut cur = s;
            while let Some(p) = prev.get(&cur) {
                if p == from {
                    break;
                }
                path.push(p.clone());
                cur = p.clone();
            }
            path.reverse();
            return Some(path);
        }
        for (next, step) in space.moves(&s) {
            // Partial sums the target keeps must never be reduced on the way.
            if !to.partial.is_subset(&next.partial) || (&next != to && !allowed(&next)) {
                continue;
            }
            let c = (cost.0 + step.0, cost.1 + step.1, cost.2 + step.2);
            if best.get(&next).is_none_or(|&b| c < b) {
                best.insert(next.clone(), c);
                prev.insert(next.clone(), s.clone());
                seq += 1;
                heap.push(Reverse((c, seq, next)));
            }
        }
    }
    None
}
