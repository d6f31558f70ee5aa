//! The elements of a buffer that one access touches.

/// The elements of one axis: `x` in `lo..hi` with `(x - lo) % period < len`. A contiguous
/// span has `period == 0` (every `x` in `lo..hi`).
///
/// Periodic spans describe the union of many equally spaced chunks (the chunks of every
/// `p`-th loop iteration), which the stream-order check uses to stand for iterations it does
/// not visit one by one.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    /// First element.
    pub lo: u64,
    /// One past the last element.
    pub hi: u64,
    /// Distance between the starts of two pieces (`0`: one contiguous piece).
    pub period: u64,
    /// Length of each piece (`period > 0` only).
    pub len: u64,
}

impl Span {
    /// The contiguous span `lo..hi`.
    pub fn new(lo: u64, hi: u64) -> Span {
        Span {
            lo,
            hi,
            period: 0,
            len: 0,
        }
    }

    /// `count` pieces of `len` elements, the first at `lo`, starts `period` apart.
    pub fn periodic(lo: u64, len: u64, period: u64, count: u64) -> Span {
        let hi = lo
            .saturating_add(period.saturating_mul(count.saturating_sub(1)))
            .saturating_add(len);
        if count <= 1 || period <= len {
            return Span::new(lo, hi);
        }
        Span {
            lo,
            hi,
            period,
            len,
        }
    }

    fn is_empty(&self) -> bool {
        self.lo >= self.hi
    }

    fn dense(&self) -> bool {
        self.period == 0
    }

    /// True when `x` is one of the span's elements.
    fn has(&self, x: u64) -> bool {
        x >= self.lo && x < self.hi && (self.dense() || (x - self.lo) % self.period < self.len)
    }

    /// The first element `>= x`, if any.
    fn first_from(&self, x: u64) -> Option<u64> {
        let x = x.max(self.lo);
        if x >= self.hi {
            return None;
        }
        if self.dense() {
            return Some(x);
        }
        let r = (x - self.lo) % self.period;
        let next = if r < self.len {
            x
        } else {
            x.saturating_add(self.period - r)
        };
        (next < self.hi).then_some(next)
    }

    /// True when the two spans share an element.
    pub fn overlaps(&self, other: &Span) -> bool {
        let (lo, hi) = (self.lo.max(other.lo), self.hi.min(other.hi));
        if lo >= hi {
            return false;
        }
        if self.dense() && other.dense() {
            return true;
        }
        if self.dense() {
            return other.first_from(lo).is_some_and(|x| x < hi);
        }
        if other.dense() {
            return self.first_from(lo).is_some_and(|x| x < hi);
        }
        if self.period == other.period && hi - lo >= 2 * self.period {
            // Long enough that only the residues matter: two windows on a circle.
            let p = self.period;
            let (a, b) = (self.lo % p, other.lo % p);
            return (b + p - a) % p < self.len || (a + p - b) % p < other.len;
        }
        // Walk the pieces of one span inside the common range (bounded; beyond, assume they
        // overlap, which only makes the check stricter).
        let mut x = self.first_from(lo);
        for _ in 0..4096 {
            let Some(start) = x.filter(|&s| s < hi) else {
                return false;
            };
            let end = (start - (start - self.lo) % self.period)
                .saturating_add(self.len)
                .min(hi);
            if other.first_from(start).is_some_and(|y| y < end) {
                return true;
            }
            x = self.first_from(end);
        }
        true
    }

    /// True when every element of `other` is one of `self`'s.
    fn contains(&self, other: &Span) -> bool {
        if other.is_empty() {
            return true;
        }
        if self.dense() {
            return self.lo <= other.lo && other.hi <= self.hi;
        }
        self == other || (other.dense() && other.hi - other.lo == 1 && self.has(other.lo))
    }
}

/// The elements of a buffer an access touches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    /// One span per buffer axis (views made by `shard_by_stream`, and unions of them).
    Boxed(Vec<Span>),
    /// A flat element range `lo..hi` (any other strided view, conservatively).
    Linear(u64, u64),
}

/// Row-major strides of `shape`.
fn strides_of(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1].saturating_mul(shape[k + 1].max(1));
    }
    strides
}

impl Region {
    /// The whole of a buffer of `shape`.
    pub fn whole(shape: &[u64]) -> Region {
        Region::Boxed(shape.iter().map(|&e| Span::new(0, e)).collect())
    }

    /// True when the region has no element.
    pub fn is_empty(&self) -> bool {
        match self {
            Region::Boxed(b) => b.iter().any(Span::is_empty),
            Region::Linear(lo, hi) => lo >= hi,
        }
    }

    /// The smallest flat range `lo..hi` of a row-major buffer of `shape` holding the region.
    pub fn hull(&self, shape: &[u64]) -> (u64, u64) {
        match self {
            Region::Linear(lo, hi) => (*lo, *hi),
            Region::Boxed(b) => {
                if self.is_empty() || b.len() != shape.len() {
                    return (0, 0);
                }
                // Saturating: a buffer too large to index has one (conservative) hull.
                let strides = strides_of(shape);
                let at = |f: &dyn Fn(&Span) -> u64| {
                    b.iter().zip(&strides).fold(0u64, |acc, (s, st)| {
                        acc.saturating_add(f(s).saturating_mul(*st))
                    })
                };
                let (first, last) = (at(&|s| s.lo), at(&|s| s.hi - 1));
                (first, last.saturating_add(1))
            }
        }
    }

    /// True when the region is exactly its [`hull`](Region::hull): a contiguous range of
    /// a row-major buffer of `shape`.
    pub fn is_dense(&self, shape: &[u64]) -> bool {
        match self {
            Region::Linear(..) => true,
            Region::Boxed(b) => {
                if b.len() != shape.len() || b.iter().any(|s| !s.dense()) {
                    return false;
                }
                // Past the first axis with more than one index, every axis is whole.
                match b.iter().position(|s| s.hi - s.lo > 1) {
                    None => true,
                    Some(k) => b
                        .iter()
                        .zip(shape)
                        .skip(k + 1)
                        .all(|(s, &e)| s.lo == 0 && s.hi == e),
                }
            }
        }
    }

    /// True when the two regions of a buffer of `shape` share an element.
    pub fn overlaps(&self, other: &Region, shape: &[u64]) -> bool {
        match (self, other) {
            (Region::Boxed(a), Region::Boxed(b)) if a.len() == b.len() => {
                a.iter().zip(b).all(|(x, y)| x.overlaps(y))
            }
            _ => {
                let ((al, ah), (bl, bh)) = (self.hull(shape), other.hull(shape));
                al < bh && bl < ah
            }
        }
    }

    /// True when every element of `inner` is in `self`.
    pub fn contains(&self, inner: &Region) -> bool {
        match (self, inner) {
            (Region::Boxed(a), Region::Boxed(b)) if a.len() == b.len() => {
                a.iter().zip(b).all(|(x, y)| x.contains(y))
            }
            (Region::Linear(al, ah), Region::Linear(bl, bh)) => al <= bl && bh <= ah,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_boxes_overlap_by_axis() {
        let base = [4u64, 6];
        let left = Region::Boxed(vec![Span::new(0, 4), Span::new(0, 3)]);
        let right = Region::Boxed(vec![Span::new(0, 4), Span::new(3, 6)]);
        assert!(!left.overlaps(&right, &base));
        let row = Region::Boxed(vec![Span::new(1, 2), Span::new(0, 6)]);
        assert!(row.overlaps(&left, &base) && row.overlaps(&right, &base));
        assert!(row.is_dense(&base) && !left.is_dense(&base));
        assert_eq!(left.hull(&base), (0, 21));
    }

    #[test]
    fn periodic_spans_hit_only_their_pieces() {
        // Rows 8..12, 16..20, 24..28 (every other chunk of 4 rows from row 8).
        let every_other = Span::periodic(8, 4, 8, 3);
        assert_eq!((every_other.lo, every_other.hi), (8, 28));
        assert!(every_other.overlaps(&Span::new(16, 20)));
        assert!(!every_other.overlaps(&Span::new(12, 16)));
        assert!(!every_other.overlaps(&Span::new(28, 40)));
        let odd = Span::periodic(12, 4, 8, 3);
        assert!(!every_other.overlaps(&odd));
        assert!(every_other.overlaps(&Span::periodic(0, 4, 8, 10)));
        let long_even = Span::periodic(0, 4, 8, 1000);
        let long_odd = Span::periodic(4, 4, 8, 1000);
        assert!(!long_even.overlaps(&long_odd));
        assert!(long_even.overlaps(&Span::periodic(6, 4, 8, 1000)));
        // Adjacent chunks merge into one contiguous span.
        assert_eq!(Span::periodic(0, 4, 4, 3), Span::new(0, 12));
    }
}
