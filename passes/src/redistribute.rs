//! Planning a resharding on one mesh as a sequence of single-parallel-type steps: DTensor's
//! redistribute planner, over chains of splits.
//!
//! A [`Placements`] lists, per value axis, the device parallel types splitting it, outermost
//! first (its chain), and the parallel types along which the tensor holds partial sums. One
//! step changes one parallel type, by one collective over its team (or none):
//!
//! | move | effect | communication |
//! |---|---|---|
//! | gather | drop the innermost split of an axis | `all_gather` |
//! | slice | append a split to an axis | none (each device keeps its piece) |
//! | all-to-all | move the innermost split of an axis to the end of another axis' chain | `all_to_all` |
//! | reduce | partial sums to replicated | `all_reduce` |
//! | reduce-scatter | partial sums to the end of an axis' chain | `reduce_scatter` |
//!
//! Only the innermost split of a chain can be undone (the others cut pieces that it cuts
//! again), and a new split always cuts the innermost piece, exactly as DTensor's shard order
//! works. Nothing creates partial sums: a target holding partial sums along a parallel type
//! the source does not is unreachable (DTensor refuses `Replicate -> Partial` too).
//!
//! [`plan`] searches the cheapest sequence (Dijkstra): fewest communications first, then
//! fewest elements moved (an all-gather moves its output, an all-to-all and a reduce-scatter
//! their input, an all-reduce twice its buffer), then fewest steps. `[S0, S0] -> [S0, R]` is
//! one all-gather over the inner mesh axis; `[S0, S1] -> [S1, S0]` an all-gather, an
//! all-to-all and a slice; `[P, S0] -> [S0, S0]` an all-gather, a reduce-scatter and a slice.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use meshflow_ir::ParallelType;

/// Where a tensor's data lies over a mesh, in value-axis terms.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Placements {
    /// Per value axis, the device parallel types splitting it, outermost first.
    pub chains: Vec<Vec<ParallelType>>,
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
            .copied()
            .chain(self.partial.iter().copied())
            .collect()
    }

    /// Per value axis, the local extent on a device: the chain's splits cut the axis level by
    /// level, rounding up (the largest local piece).
    pub fn local_extents(&self, extents: &[u64], sizes: &BTreeMap<ParallelType, u64>) -> Vec<u64> {
        self.chains
            .iter()
            .zip(extents)
            .map(|(chain, &e)| {
                chain.iter().fold(e, |e, pt| {
                    let d = sizes.get(pt).copied().unwrap_or(1).max(1);
                    e.div_ceil(d)
                })
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

    /// DTensor-style text, per value axis: `[S0(DIDy, DIDx), R] P(DIDx)`.
    pub fn describe(&self) -> String {
        let axes: Vec<String> = self
            .chains
            .iter()
            .map(|c| {
                if c.is_empty() {
                    "R".to_string()
                } else {
                    let pts: Vec<&str> = c.iter().map(|p| p.name()).collect();
                    format!("S({})", pts.join(", "))
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

/// The neighbours of `s` with the cost of reaching them.
fn moves(
    s: &Placements,
    pts: &[ParallelType],
    extents: &[u64],
    sizes: &BTreeMap<ParallelType, u64>,
) -> Vec<(Placements, Cost)> {
    let mut out = Vec::new();
    let rank = s.chains.len();
    let used = s.used();
    let size = |p: &Placements| p.local_numel(extents, sizes);
    let here = size(s);
    // Inner mesh axes first (DIDx, DIDy, DIDz), as DTensor's planner: among equally cheap
    // plans the one found first wins.
    for &pt in pts {
        let Some(a) = s.chains.iter().position(|c| c.last() == Some(&pt)) else {
            continue;
        };
        // gather
        let mut g = s.clone();
        g.chains[a].pop();
        let n = size(&g);
        out.push((g.clone(), (1, n, 1)));
        // all-to-all to another axis
        for b in (0..rank).filter(|&b| b != a) {
            let mut t = g.clone();
            t.chains[b].push(pt);
            out.push((t, (1, here, 1)));
        }
    }
    for &pt in pts.iter().filter(|pt| !used.contains(pt)) {
        for a in 0..rank {
            let mut t = s.clone();
            t.chains[a].push(pt);
            out.push((t, (0, 0, 1)));
        }
    }
    for &pt in &s.partial {
        let mut r = s.clone();
        r.partial.remove(&pt);
        out.push((r.clone(), (1, 2 * here, 1)));
        for a in 0..rank {
            let mut t = r.clone();
            t.chains[a].push(pt);
            out.push((t, (1, here, 1)));
        }
    }
    out
}

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
) -> Option<Vec<Placements>> {
    if from == to {
        return Some(Vec::new());
    }
    if from.chains.len() != to.chains.len() || !to.partial.is_subset(&from.partial) {
        return None;
    }
    let pts: Vec<ParallelType> = sizes.keys().copied().collect();
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
        for (next, step) in moves(&s, &pts, extents, sizes) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ParallelType::{DIDx as X, DIDy as Y, DIDz as Z};

    fn pl(chains: &[&[ParallelType]], partial: &[ParallelType]) -> Placements {
        Placements {
            chains: chains.iter().map(|c| c.to_vec()).collect(),
            partial: partial.iter().copied().collect(),
        }
    }

    fn sizes(pts: &[(ParallelType, u64)]) -> BTreeMap<ParallelType, u64> {
        pts.iter().copied().collect()
    }

    /// Communications of a plan: (gathers, all-to-alls, reduces, reduce-scatters).
    fn comms(from: &Placements, steps: &[Placements], to: &Placements) -> (u32, u32, u32, u32) {
        let mut all = vec![from.clone()];
        all.extend(steps.iter().cloned());
        all.push(to.clone());
        let mut c = (0, 0, 0, 0);
        for w in all.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            let na: usize = a.chains.iter().map(Vec::len).sum();
            let nb: usize = b.chains.iter().map(Vec::len).sum();
            if a.partial.len() > b.partial.len() {
                if nb > na {
                    c.3 += 1;
                } else {
                    c.2 += 1;
                }
            } else if na > nb {
                c.0 += 1;
            } else if na == nb {
                c.1 += 1;
            }
        }
        c
    }

    fn run(from: Placements, to: Placements, s: &[(ParallelType, u64)]) -> (u32, u32, u32, u32) {
        let steps = plan(&from, &to, &[16, 16, 16], &sizes(s), &|_| true).expect("reachable");
        comms(&from, &steps, &to)
    }

    #[test]
    fn dtensor_traces_on_a_2d_mesh() {
        let s2 = [(Y, 4), (X, 2)];
        // [S0, S0] -> [S0, R]: one all-gather over the inner mesh axis.
        assert_eq!(
            run(pl(&[&[Y, X], &[]], &[]), pl(&[&[Y], &[]], &[]), &s2),
            (1, 0, 0, 0)
        );
        // [S0, S1] -> [S1, S0]: all-gather, all-to-all, slice.
        assert_eq!(
            run(pl(&[&[Y], &[X]], &[]), pl(&[&[X], &[Y]], &[]), &s2),
            (1, 1, 0, 0)
        );
        // [S0, S0] -> [S1, S1].
        assert_eq!(
            run(pl(&[&[Y, X], &[]], &[]), pl(&[&[], &[Y, X]], &[]), &s2),
            (1, 1, 0, 0)
        );
        // [R, S0] -> [S0, S0]: all-gather, then two slices.
        assert_eq!(
            run(pl(&[&[X], &[]], &[]), pl(&[&[Y, X], &[]], &[]), &s2),
            (1, 0, 0, 0)
        );
        // [P, S0] -> [S0, S0]: all-gather, reduce-scatter, slice.
        assert_eq!(
            run(pl(&[&[X], &[]], &[Y]), pl(&[&[Y, X], &[]], &[]), &s2),
            (1, 0, 0, 1)
        );
        // [P, S0] -> [P, S1]: one all-to-all, the partial sums untouched.
        assert_eq!(
            run(pl(&[&[X], &[]], &[Y]), pl(&[&[], &[X]], &[Y]), &s2),
            (0, 1, 0, 0)
        );
        // [S0, P] -> [R, R].
        assert_eq!(
            run(pl(&[&[Y], &[]], &[X]), pl(&[&[], &[]], &[]), &s2),
            (1, 0, 1, 0)
        );
    }

    #[test]
    fn shard_orders_on_a_3d_mesh() {
        let s3 = [(Z, 2), (Y, 2), (X, 2)];
        // Order (0, 1, 2) -> (1, 2): everything gathered, then sliced again.
        assert_eq!(
            run(
                pl(&[&[Z, Y, X], &[], &[]], &[]),
                pl(&[&[Y, X], &[], &[]], &[]),
                &s3
            )
            .0,
            3
        );
        // Order (1, 0, 2) -> (1, 2): two gathers.
        assert_eq!(
            run(
                pl(&[&[Y, Z, X], &[], &[]], &[]),
                pl(&[&[Y, X], &[], &[]], &[]),
                &s3
            ),
            (2, 0, 0, 0)
        );
        // [S0, S0, S0] -> [S1, S1, S1]: three communications.
        let (g, a, _, _) = run(
            pl(&[&[Z, Y, X], &[], &[]], &[]),
            pl(&[&[], &[Z, Y, X], &[]], &[]),
            &s3,
        );
        assert_eq!(g + a, 3);
    }

    #[test]
    fn partial_targets_need_partial_sources() {
        let s2 = [(Y, 2), (X, 2)];
        let none = plan(
            &pl(&[&[Y], &[]], &[]),
            &pl(&[&[], &[]], &[X]),
            &[8, 8],
            &sizes(&s2),
            &|_| true,
        );
        assert!(none.is_none());
        let same = plan(
            &pl(&[&[], &[]], &[X]),
            &pl(&[&[], &[]], &[X]),
            &[8, 8],
            &sizes(&s2),
            &|_| true,
        );
        assert_eq!(same, Some(Vec::new()));
    }
}
