//! The steps [`super::plan`] searches: every placement one collective (or none) away.

use std::collections::BTreeMap;

use meshflow_ir::ParallelType;

use super::{is_plain, normalized, Cost, Cut, Placements};

/// What the search needs to know to enumerate steps.
pub(super) struct Space<'a> {
    /// The mesh's device parallel types with teams of more than one device, inner mesh axes
    /// first (DIDx, DIDy, DIDz), as DTensor's planner: among equally cheap plans the one found
    /// first wins.
    pub pts: Vec<ParallelType>,
    /// The value extents.
    pub extents: &'a [u64],
    /// The team size of every parallel type.
    pub sizes: &'a BTreeMap<ParallelType, u64>,
    /// The target (a strided target axis is approached through its own prefixes).
    pub target: &'a Placements,
    /// Whether merged steps (one collective over a flattened team) are neighbours too.
    pub merge: bool,
}

/// True when `pts` (outermost level first) are in mesh order, outer mesh axis first: the
/// order of a flattened team's members is then the order of the chain's pieces.
pub(crate) fn mesh_ordered(pts: &[ParallelType]) -> bool {
    pts.windows(2)
        .all(|w| w[0].device_rank() > w[1].device_rank())
}

/// `chain` without its innermost device cut and the serial cuts just outside it.
fn gathered(chain: &[Cut]) -> Vec<Cut> {
    let mut g = chain.to_vec();
    g.pop();
    normalized(g)
}

/// The next prefix of a strided `target` chain after `cur` (a prefix of it): up to and with
/// its next device cut, and that cut's parallel type.
fn next_strided(cur: &[Cut], target: &[Cut]) -> Option<(ParallelType, Vec<Cut>)> {
    if target.len() <= cur.len() || target[..cur.len()] != *cur {
        return None;
    }
    let j = cur.len()
        + target[cur.len()..]
            .iter()
            .position(|c| c.device().is_some())?;
    Some((target[j].device()?, target[..=j].to_vec()))
}

impl Space<'_> {
    fn size(&self, p: &Placements) -> u128 {
        p.local_numel(self.extents, self.sizes)
    }

    /// True when `chain` (plain) divides value axis `a` evenly at every level.
    fn divides(&self, a: usize, chain: &[Cut]) -> bool {
        let parts: u64 = chain
            .iter()
            .map(|c| match *c {
                Cut::Device(pt) => self.sizes.get(&pt).copied().unwrap_or(1),
                Cut::Serial(f) => f,
            })
            .product();
        self.extents
            .get(a)
            .is_some_and(|&e| parts > 0 && e.is_multiple_of(parts))
    }

    /// The neighbours of `s` with the cost of reaching them.
    pub fn moves(&self, s: &Placements) -> Vec<(Placements, Cost)> {
        let mut out = Vec::new();
        let rank = s.chains.len();
        let used = s.used();
        let here = self.size(s);
        for &pt in &self.pts {
            let Some(a) = s
                .chains
                .iter()
                .position(|c| c.last() == Some(&Cut::Device(pt)))
            else {
                continue;
            };
            // gather
            let mut g = s.clone();
            g.chains[a] = gathered(&s.chains[a]);
            out.push((g.clone(), (1, self.size(&g), 1)));
            // all-to-all to another axis (plain chains only)
            if is_plain(&s.chains[a]) {
                for b in (0..rank).filter(|&b| b != a && is_plain(&s.chains[b])) {
                    let mut t = g.clone();
                    t.chains[b].push(Cut::Device(pt));
                    out.push((t, (1, here, 1)));
                }
            }
        }
        // Merged gathers: the innermost levels of an evenly divided plain chain, in mesh order.
        for (a, chain) in s.chains.iter().enumerate().filter(|_| self.merge) {
            if !is_plain(chain) || !self.divides(a, chain) {
                continue;
            }
            let pts: Vec<ParallelType> = chain.iter().filter_map(|c| c.device()).collect();
            for k in 2..=pts.len() {
                if !mesh_ordered(&pts[pts.len() - k..]) {
                    break;
                }
                let mut g = s.clone();
                g.chains[a].truncate(pts.len() - k);
                out.push((g.clone(), (1, self.size(&g), 1)));
            }
        }
        for &pt in self.pts.iter().filter(|pt| !used.contains(pt)) {
            for a in 0..rank {
                if is_plain(&s.chains[a]) {
                    let mut t = s.clone();
                    t.chains[a].push(Cut::Device(pt));
                    out.push((t, (0, 0, 1)));
                }
                let target = &self.target.chains[a];
                if !is_plain(target) {
                    if let Some((p, next)) = next_strided(&s.chains[a], target) {
                        if p == pt {
                            let mut t = s.clone();
                            t.chains[a] = next;
                            out.push((t, (0, 0, 1)));
                        }
                    }
                }
            }
        }
        for &pt in &s.partial {
            let mut r = s.clone();
            r.partial.remove(&pt);
            out.push((r.clone(), (1, 2 * here, 1)));
            for a in (0..rank).filter(|&a| is_plain(&s.chains[a])) {
                let mut t = r.clone();
                t.chains[a].push(Cut::Device(pt));
                out.push((t, (1, here, 1)));
            }
        }
        // Merged reductions over several parallel types: all-reduces of any set, and
        // reduce-scatters appending in mesh order onto an evenly divided plain chain.
        let partial: Vec<ParallelType> = s.partial.iter().copied().collect();
        for mask in 1u32..(1 << partial.len()) {
            if mask.count_ones() < 2 || !self.merge {
                continue;
            }
            let mut set: Vec<ParallelType> = (0..partial.len())
                .filter(|&i| mask & (1 << i) != 0)
                .map(|i| partial[i])
                .collect();
            set.sort_by_key(|pt| std::cmp::Reverse(pt.device_rank()));
            let mut r = s.clone();
            for pt in &set {
                r.partial.remove(pt);
            }
            out.push((r.clone(), (1, 2 * here, 1)));
            for a in 0..rank {
                let mut chain = s.chains[a].clone();
                chain.extend(set.iter().map(|&pt| Cut::Device(pt)));
                if is_plain(&chain) && self.divides(a, &chain) {
                    let mut t = r.clone();
                    t.chains[a] = chain;
                    out.push((t, (1, here, 1)));
                }
            }
        }
        out
    }
}
