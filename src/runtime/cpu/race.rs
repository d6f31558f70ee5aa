//! Happens-before tracking for the CPU backend: vector clocks over streams and
//! communications, and per-buffer access records checked on every access.
//!
//! Timelines are the rank's streams (`0` = main, `1..=pool` workers) and one timeline per
//! communication label. A compute op on stream `s` ticks `s` and accesses under `s`'s clock.
//! A communication posted on `s` gets instance number `n` of its label: it accesses its
//! buffers under `s`'s clock with its own timeline set to `n`, and `wait` joins that clock
//! into the current stream. `synchronize u` joins `u`'s clock into the current stream.
//!
//! Two accesses to overlapping elements conflict when one is a write and the earlier one is
//! not ordered before the later one (`clock[earlier.timeline] < earlier.epoch`). Instances of
//! one label are treated as ordered (waiting on the latest covers earlier ones), as the IR's
//! `wait` contract states.

use std::sync::Arc;

use crate::runtime::backend::{AccessSite, StreamIndex, TensorView};
use crate::runtime::view::contiguous_strides;

/// The elements an access touches, in the coordinates of its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// A box `[lo, hi)` per buffer axis (views made by `shard_by_stream`).
    Boxed(Vec<(u64, u64)>),
    /// A flat element range `[lo, hi)` (any other strided view, conservatively).
    Linear(u64, u64),
}

impl Region {
    /// The region of `view` inside a row-major buffer of `shape`.
    pub fn of<Buf>(shape: &[u64], view: &TensorView<Buf>) -> Region {
        let numel: u64 = view.shape.iter().product();
        if numel == 0 {
            return Region::Linear(0, 0);
        }
        let strides = contiguous_strides(shape);
        if view.shape.len() == shape.len() && view.strides == strides {
            let mut rest = view.offset;
            let mut lo = vec![0u64; shape.len()];
            for k in (0..shape.len()).rev() {
                let e = shape[k].max(1);
                lo[k] = rest % e;
                rest /= e;
            }
            let fits = rest == 0
                && lo
                    .iter()
                    .zip(&view.shape)
                    .zip(shape)
                    .all(|((&l, &n), &e)| l + n <= e);
            if fits {
                return Region::Boxed(
                    lo.iter()
                        .zip(&view.shape)
                        .map(|(&l, &n)| (l, l + n))
                        .collect(),
                );
            }
        }
        let span: u64 = view
            .shape
            .iter()
            .zip(&view.strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum();
        Region::Linear(view.offset, view.offset + span + 1)
    }

    fn linear(&self, shape: &[u64]) -> (u64, u64) {
        match self {
            Region::Linear(lo, hi) => (*lo, *hi),
            Region::Boxed(b) => {
                if b.iter().any(|(l, h)| l >= h) {
                    return (0, 0);
                }
                let strides = contiguous_strides(shape);
                let first: u64 = b.iter().zip(&strides).map(|((l, _), s)| l * s).sum();
                let last: u64 = b.iter().zip(&strides).map(|((_, h), s)| (h - 1) * s).sum();
                (first, last + 1)
            }
        }
    }

    fn overlaps(&self, other: &Region, shape: &[u64]) -> bool {
        match (self, other) {
            (Region::Boxed(a), Region::Boxed(b)) if a.len() == b.len() => a
                .iter()
                .zip(b)
                .all(|(&(al, ah), &(bl, bh))| al < bh && bl < ah),
            _ => {
                let ((al, ah), (bl, bh)) = (self.linear(shape), other.linear(shape));
                al < bh && bl < ah
            }
        }
    }

    fn contains(&self, inner: &Region) -> bool {
        match (self, inner) {
            (Region::Boxed(a), Region::Boxed(b)) if a.len() == b.len() => a
                .iter()
                .zip(b)
                .all(|(&(al, ah), &(bl, bh))| al <= bl && bh <= ah),
            (Region::Linear(al, ah), Region::Linear(bl, bh)) => al <= bl && bh <= ah,
            _ => false,
        }
    }
}

/// One recorded access.
#[derive(Clone, Debug)]
pub(crate) struct Access {
    pub region: Region,
    pub write: bool,
    pub timeline: usize,
    pub epoch: u32,
    pub site: AccessSite,
}

/// The vector clocks of one rank.
#[derive(Clone, Debug)]
pub(crate) struct Clocks {
    streams: Vec<Vec<u32>>,
    instances: Vec<u32>,
    first_comm: usize,
}

impl Clocks {
    pub fn new(pool: usize, labels: usize) -> Clocks {
        let dim = 1 + pool + labels;
        Clocks {
            streams: vec![vec![0; dim]; 1 + pool],
            instances: vec![0; labels],
            first_comm: 1 + pool,
        }
    }

    pub fn comm_timeline(&self, label: usize) -> usize {
        self.first_comm + label
    }

    /// Ticks stream `s` for a new op; returns its timeline, epoch and clock.
    pub fn tick(&mut self, s: StreamIndex) -> (usize, u32, &[u32]) {
        let c = &mut self.streams[s.0];
        c[s.0] += 1;
        (s.0, c[s.0], c)
    }

    /// A new instance of `label` posted on stream `s`: its clock.
    pub fn post(&mut self, s: StreamIndex, label: usize) -> Arc<[u32]> {
        self.instances[label] += 1;
        let mut clock = self.streams[s.0].clone();
        clock[self.first_comm + label] = self.instances[label];
        clock.into()
    }

    /// Stream `s` waits for `clock`.
    pub fn join(&mut self, s: StreamIndex, clock: &[u32]) {
        for (a, &b) in self.streams[s.0].iter_mut().zip(clock) {
            *a = (*a).max(b);
        }
    }

    /// Stream `s` waits for everything enqueued on `other`.
    pub fn sync(&mut self, s: StreamIndex, other: StreamIndex) {
        let o = self.streams[other.0].clone();
        self.join(s, &o);
    }
}

/// Joins `b` into `a` (same dimension).
pub(crate) fn join_into(a: &mut [u32], b: &[u32]) {
    for (x, &y) in a.iter_mut().zip(b) {
        *x = (*x).max(y);
    }
}

/// The first recorded access that conflicts with a new access.
pub(crate) fn conflict<'a>(
    records: &'a [Access],
    shape: &[u64],
    region: &Region,
    write: bool,
    clock: &[u32],
) -> Option<&'a Access> {
    records.iter().find(|r| {
        (r.write || write)
            && clock.get(r.timeline).copied().unwrap_or(0) < r.epoch
            && r.region.overlaps(region, shape)
    })
}

/// Records an access, dropping older records it makes redundant.
pub(crate) fn record(records: &mut Vec<Access>, access: Access, clock: &[u32]) {
    records.retain(|r| {
        let ordered = clock.get(r.timeline).copied().unwrap_or(0) >= r.epoch;
        let redundant = ordered && access.region.contains(&r.region) && (access.write || !r.write);
        !redundant
    });
    records.push(access);
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_ir::{DType, EntityRef, HostTensorId};

    fn view(offset: u64, shape: Vec<u64>, strides: Vec<u64>) -> TensorView<u32> {
        TensorView {
            tensor: HostTensorId::new(0),
            buffer: 0,
            dtype: DType::F32,
            offset,
            shape,
            strides,
        }
    }

    #[test]
    fn chunk_regions_are_boxes() {
        let base = [4u64, 6];
        let left = Region::of(&base, &view(0, vec![4, 3], vec![6, 1]));
        let right = Region::of(&base, &view(3, vec![4, 3], vec![6, 1]));
        assert_eq!(left, Region::Boxed(vec![(0, 4), (0, 3)]));
        assert!(!left.overlaps(&right, &base));
        let row = Region::of(&base, &view(6, vec![1, 6], vec![6, 1]));
        assert!(row.overlaps(&left, &base) && row.overlaps(&right, &base));
        let odd = Region::of(&base, &view(1, vec![3], vec![6]));
        assert_eq!(odd, Region::Linear(1, 14));
    }
}
