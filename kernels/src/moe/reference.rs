//! The CPU reference of MoE dispatch and combine, the oracle of the GPU tests.
//!
//! Rows of an expert are kept in the canonical order (source rank, token, k); the GPU transports
//! may order them differently, so tests compare per-expert multisets. Values are f32 holding
//! values of the shape's dtype.

use half::{bf16, f16};

use super::MoeShape;
use crate::dtype::DType;
use crate::error::{KernelError, Result};

/// What dispatch produces on one rank, in canonical row order.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceDispatch {
    /// Rows per local expert, `[L]`, at most `C`.
    pub counts: Vec<i32>,
    /// `(team-global token, k)` of every kept row, per local expert.
    pub rows: Vec<Vec<(i32, i32)>>,
    /// `[L, C, H]`, zero past each count.
    pub expert_x: Vec<f32>,
    /// `[L, C, 2]`, zero past each count.
    pub routing: Vec<i32>,
    /// Whether some expert had more than `C` rows (the extra rows are not kept).
    pub overflow: bool,
}

/// `v` rounded to `dtype` (f32, bf16 or f16; other types are returned unchanged).
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn check_len(what: &str, rank: usize, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::InvalidArgument(format!(
            "reference MoE: {what} of rank {rank} has {got} elements, expected {want}"
        )))
    }
}

/// Dispatch as seen by `rank`, from every rank's tokens `x[s]` (`[T, H]`) and `topk_idx[s]`
/// (`[T, K]`). Entries that are not expert ids are skipped (the GPU raises `BAD_EXPERT`).
pub fn reference_dispatch(
    shape: &MoeShape,
    rank: usize,
    x: &[Vec<f32>],
    topk_idx: &[Vec<i32>],
) -> Result<ReferenceDispatch> {
    shape.validate()?;
    let (w, t, k, h, c) = (
        shape.world,
        shape.tokens,
        shape.top_k,
        shape.hidden,
        shape.capacity,
    );
    let l = shape.local_experts();
    if x.len() != w || topk_idx.len() != w || rank >= w {
        return Err(KernelError::InvalidArgument(format!(
            "reference MoE: {} token sets and {} index sets for a team of {w} (rank {rank})",
            x.len(),
            topk_idx.len()
        )));
    }
    let mut out = ReferenceDispatch {
        counts: vec![0; l],
        rows: vec![Vec::new(); l],
        expert_x: vec![0.0; l * c * h],
        routing: vec![0; l * c * 2],
        overflow: false,
    };
    for (s, (xs, idx)) in x.iter().zip(topk_idx).enumerate() {
        check_len("x", s, xs.len(), t * h)?;
        check_len("topk_idx", s, idx.len(), t * k)?;
        for (i, &e) in idx.iter().enumerate() {
            let Ok(e) = usize::try_from(e) else { continue };
            if e >= shape.experts || e / l != rank {
                continue;
            }
            let le = e % l;
            let j = out.rows[le].len();
            if j >= c {
                out.overflow = true;
                continue;
            }
            let (tt, kk) = (i / k, i % k);
            let token = i32::try_from(s * t + tt).unwrap_or(i32::MAX);
            out.rows[le].push((token, kk as i32));
            let dst = (le * c + j) * h;
            out.expert_x[dst..dst + h].copy_from_slice(&xs[tt * h..(tt + 1) * h]);
            out.routing[(le * c + j) * 2] = token;
            out.routing[(le * c + j) * 2 + 1] = kk as i32;
        }
    }
    for (cnt, rows) in out.counts.iter_mut().zip(&out.rows) {
        *cnt = rows.len() as i32;
    }
    Ok(out)
}

/// Combine on one rank: `out[t] = Σ_k w[t, k] · y(t, k)` over `[T, F]`, accumulated in f32 in
/// `k` order (separate multiply and add) and rounded once to the dtype. `row(t, k)` is the
/// expert output for `(t, k)`, or `None` for a row that was dropped (it contributes nothing).
pub fn reference_combine(
    shape: &MoeShape,
    weights: &[f32],
    row: impl Fn(usize, usize) -> Option<Vec<f32>>,
) -> Result<Vec<f32>> {
    let (t, k, f) = (shape.tokens, shape.top_k, shape.out_hidden);
    check_len("weights", 0, weights.len(), t * k)?;
    let mut out = vec![0.0f32; t * f];
    for (tt, acc) in out.chunks_mut(f.max(1)).enumerate().take(t) {
        for kk in 0..k {
            let Some(y) = row(tt, kk) else { continue };
            if y.len() != f {
                return Err(KernelError::InvalidArgument(format!(
                    "reference MoE: expert row for token {tt}, slot {kk} has {} elements, expected {f}",
                    y.len()
                )));
            }
            let wk = weights[tt * k + kk];
            for (a, yv) in acc.iter_mut().zip(y) {
                *a += wk * yv;
            }
        }
        for a in acc.iter_mut() {
            *a = round_to(shape.dtype, *a);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, experts: usize, top_k: usize, capacity: usize) -> MoeShape {
        MoeShape {
            world,
            experts,
            top_k,
            tokens: 3,
            hidden: 2,
            out_hidden: 2,
            capacity,
            dtype: DType::F32,
        }
    }

    #[test]
    fn dispatch_routes_rows_in_canonical_order() {
        let s = shape(2, 4, 2, 4);
        let x = vec![
            vec![0., 1., 10., 11., 20., 21.],
            vec![100., 101., 110., 111., 120., 121.],
        ];
        // rank 0 tokens: (0: e1, e2) (1: e3, e0) (2: e1, e3); rank 1: (0: e0, e2) (1: e1, e2) (2: e3, e2)
        let idx = vec![vec![1, 2, 3, 0, 1, 3], vec![0, 2, 1, 2, 3, 2]];
        let r0 = reference_dispatch(&s, 0, &x, &idx).unwrap();
        assert_eq!(r0.counts, vec![2, 3]);
        assert_eq!(r0.rows[0], vec![(1, 1), (3, 0)]);
        assert_eq!(r0.rows[1], vec![(0, 0), (2, 0), (4, 0)]);
        assert_eq!(&r0.expert_x[..4], &[10., 11., 100., 101.]);
        assert_eq!(&r0.expert_x[4..8], &[0.; 4]);
        assert_eq!(&r0.routing[..4], &[1, 1, 3, 0]);
        let r1 = reference_dispatch(&s, 1, &x, &idx).unwrap();
        assert_eq!(r1.counts, vec![4, 3]);
        assert!(!r1.overflow);
    }

    #[test]
    fn dispatch_drops_rows_past_capacity_and_bad_ids() {
        let s = shape(1, 2, 1, 2);
        let x = vec![vec![1.; 6]];
        let idx = vec![vec![0, 0, 0]];
        let r = reference_dispatch(&s, 0, &x, &idx).unwrap();
        assert_eq!(r.counts, vec![2, 0]);
        assert!(r.overflow);
        let r = reference_dispatch(&s, 0, &x, &[vec![0, 7, -1]]).unwrap();
        assert_eq!(r.counts, vec![1, 0]);
        assert!(!r.overflow);
        assert!(reference_dispatch(&s, 0, &x, &[vec![0, 1]]).is_err());
        assert!(reference_dispatch(&s, 1, &x, &idx).is_err());
    }

    #[test]
    fn combine_weights_in_k_order_and_rounds_once() {
        let s = MoeShape {
            dtype: DType::BF16,
            tokens: 1,
            ..shape(1, 2, 2, 2)
        };
        let out = reference_combine(&s, &[0.5, 0.25], |_, k| {
            Some(if k == 0 {
                vec![1.0, 2.0]
            } else {
                vec![4.0, 1.0 / 3.0]
            })
        })
        .unwrap();
        assert_eq!(out[0], 1.5);
        assert_eq!(out[1], round_to(DType::BF16, 1.0 + 0.25 / 3.0));
        let dropped = reference_combine(&s, &[0.5, 0.25], |_, k| (k == 1).then(|| vec![4.0, 4.0]));
        assert_eq!(dropped.unwrap(), vec![1.0, 1.0]);
        assert!(reference_combine(&s, &[0.5], |_, _| None).is_err());
    }
}
