//! How a reshape regroups axes, and which device splits survive it.
//!
//! [`view_groups`] cuts the input and output shapes of a reshape into groups of consecutive
//! axes with equal element counts (the smallest such groups, size-1 axes on their own), as
//! DTensor's view rules do: `[2, 3, 4] -> [2, 12]` is `[0] -> [0]`, `[1, 2] -> [1]`;
//! `[B, S, H] -> [B, S, nh, hd]` is `[0] -> [0]`, `[1] -> [1]`, `[2] -> [2, 3]`.
//!
//! Inside a group the elements are one row-major block. A device split of a group's **first**
//! input axis into `d` parts gives each device one contiguous block of the group, which is the
//! same as splitting the group's first output axis into `d` parts when that extent divides by
//! `d` (the head split: `H` split over `d` devices is `nh` split over `d` when `d | nh`). A
//! split of any later axis of a group is strided on the output and has no outer-split form:
//! the reshape must replicate that mesh axis first (`reshape`) or is refused (`view`).

use std::ops::Range;

/// One group of a reshape: input axes `inputs` hold the same elements as output axes
/// `outputs` (either may be empty for a size-1 axis of the other side).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewGroup {
    /// Consecutive input axes.
    pub inputs: Range<usize>,
    /// Consecutive output axes.
    pub outputs: Range<usize>,
}

/// The groups of a reshape from `from` to `to`, or `None` when the element counts differ
/// (or an extent is 0).
pub fn view_groups(from: &[u64], to: &[u64]) -> Option<Vec<ViewGroup>> {
    let count = |s: &[u64]| {
        s.iter().try_fold(
            1u64,
            |acc, &e| if e == 0 { None } else { acc.checked_mul(e) },
        )
    };
    if count(from)? != count(to)? {
        return None;
    }
    let (mut i, mut j) = (0usize, 0usize);
    let mut groups = Vec::new();
    while i < from.len() || j < to.len() {
        let (i0, j0) = (i, j);
        let mut f = 1u64;
        if i < from.len() {
            f = from[i];
            i += 1;
        }
        let mut t = 1u64;
        if j < to.len() {
            t = to[j];
            j += 1;
        }
        if f == 1 && t != 1 {
            // A size-1 input axis on its own.
            j = j0;
        } else if f != 1 && t == 1 {
            // A size-1 output axis on its own.
            i = i0;
        } else {
            while f != t {
                if f < t {
                    f = f.checked_mul(*from.get(i)?)?;
                    i += 1;
                } else {
                    t = t.checked_mul(*to.get(j)?)?;
                    j += 1;
                }
            }
        }
        groups.push(ViewGroup {
            inputs: i0..i,
            outputs: j0..j,
        });
    }
    Some(groups)
}

/// Per output axis of a reshape from `from` to `to`, the input axis whose device split
/// carries over to it (the first axes of a group, see the module docs), or `None`.
/// Divisibility is the caller's business: the split carries over only when the output
/// axis' extent divides by the number of parts too.
pub fn view_sources(from: &[u64], to: &[u64]) -> Vec<Option<usize>> {
    let mut out = vec![None; to.len()];
    for g in view_groups(from, to).unwrap_or_default() {
        if !g.inputs.is_empty() && !g.outputs.is_empty() {
            out[g.outputs.start] = Some(g.inputs.start);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(from: &[u64], to: &[u64]) -> Vec<(Vec<usize>, Vec<usize>)> {
        view_groups(from, to)
            .unwrap()
            .into_iter()
            .map(|g| (g.inputs.collect(), g.outputs.collect()))
            .collect()
    }

    #[test]
    fn dtensor_examples() {
        assert_eq!(
            groups(&[2, 3, 4], &[2, 12]),
            vec![(vec![0], vec![0]), (vec![1, 2], vec![1])]
        );
        assert_eq!(
            groups(&[3, 4, 8, 3], &[12, 4, 2, 3]),
            vec![
                (vec![0, 1], vec![0]),
                (vec![2], vec![1, 2]),
                (vec![3], vec![3])
            ]
        );
        assert_eq!(groups(&[2, 3], &[3, 2]), vec![(vec![0, 1], vec![0, 1])]);
        assert_eq!(
            groups(&[1, 6], &[6, 1]),
            vec![(vec![0], vec![]), (vec![1], vec![0]), (vec![], vec![1])]
        );
        assert!(view_groups(&[2, 3], &[5]).is_none());
    }

    #[test]
    fn head_split_maps_hidden_to_heads() {
        assert_eq!(
            view_sources(&[2, 4, 24], &[2, 4, 6, 4]),
            vec![Some(0), Some(1), Some(2), None]
        );
        assert_eq!(
            view_sources(&[2, 4, 6, 4], &[2, 4, 24]),
            vec![Some(0), Some(1), Some(2)]
        );
        assert_eq!(view_sources(&[4, 1, 6], &[24]), vec![Some(0)]);
        assert_eq!(view_sources(&[8], &[1, 8]), vec![None, Some(0)]);
    }
}
