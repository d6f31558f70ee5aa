//! Happens-before tracking for the CPU backend, on the shared [`ordering`](crate::ordering)
//! primitives: vector clocks over the rank's streams (`0` = main, `1..=pool` workers) and
//! communication labels, and one [`Shadow`](crate::ordering::Shadow) per buffer.
//!
//! A compute op on stream `s` ticks `s` and accesses under `s`'s clock. A communication
//! posted on `s` gets instance number `n` of its label: it accesses its buffers under `s`'s
//! clock with its own timeline set to `n`, and `wait` joins that clock into the current
//! stream. `synchronize u` joins `u`'s clock into the current stream. Two accesses to
//! overlapping elements conflict when one is a write and the earlier one is not ordered
//! before the later one. Checking costs time linear in the accesses (see the shadow's docs).

use crate::ordering::{Region, Span};
use crate::runtime::backend::TensorView;
use crate::runtime::view::contiguous_strides;

/// The region of `view` inside a row-major buffer of `shape`: a box when the view is a box
/// of the buffer (views made by `shard_by_stream`), else its flat range, conservatively.
pub(crate) fn region_of<Buf>(shape: &[u64], view: &TensorView<Buf>) -> Region {
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
                    .map(|(&l, &n)| Span::new(l, l + n))
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
        let left = region_of(&base, &view(0, vec![4, 3], vec![6, 1]));
        let right = region_of(&base, &view(3, vec![4, 3], vec![6, 1]));
        assert_eq!(left, Region::Boxed(vec![Span::new(0, 4), Span::new(0, 3)]));
        assert!(!left.overlaps(&right, &base));
        let row = region_of(&base, &view(6, vec![1, 6], vec![6, 1]));
        assert!(row.overlaps(&left, &base) && row.overlaps(&right, &base));
        let odd = region_of(&base, &view(1, vec![3], vec![6]));
        assert_eq!(odd, Region::Linear(1, 14));
    }
}
