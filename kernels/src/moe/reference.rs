//! The CPU reference of MoE dispatch and combine, the oracle of the GPU tests.
//!
//! Rows of an expert are kept in the canonical order (source rank, token, k); the GPU transports
//! may order them differently, so tests compare per-expert multisets. Values are f32 holding
//! values of the shape's dtype. The combine follows the summation order of the module docs
//! (per-rank partials in `k` order, rounded to the dtype, then summed in rank order).

use half::{bf16, f16};

use super::{MoeShape, MoeWire};
use crate::dtype::DType;
use crate::error::{KernelError, Result};

/// What dispatch produces on one rank, in canonical row order.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceDispatch {
    /// Rows per local expert, `[L]`, at most `C`.
    pub counts: Vec<i32>,
    /// `(team-global token, k)` of every kept row, per local expert.
    pub rows: Vec<Vec<(i32, i32)>>,
    /// `[L, C, H]`, zero past each count (FP8 rows dequantized).
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

/// The expert id `e` if it names an expert of `shape`.
fn expert(shape: &MoeShape, e: i32) -> Option<usize> {
    usize::try_from(e).ok().filter(|&e| e < shape.experts)
}

/// Dispatch as seen by `rank`, from every rank's tokens `x[s]` (`[T, H]`) and `topk_idx[s]`
/// (`[T, K]`), each row encoded as `wire`. Entries that are not expert ids are skipped (the
/// GPU raises `BAD_EXPERT`).
pub fn reference_dispatch(
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    x: &[Vec<f32>],
    topk_idx: &[Vec<i32>],
) -> Result<ReferenceDispatch> {
    shape.validate()?;
    wire.validate(shape)?;
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
        for tt in 0..t {
            let mine: Vec<(usize, usize)> = (0..k)
                .filter_map(|kk| expert(shape, idx[tt * k + kk]).map(|e| (kk, e)))
                .filter(|&(_, e)| e / l == rank)
                .collect();
            if mine.is_empty() {
                continue;
            }
            // One row travels to this rank; it fans out to the local experts in k order.
            let row = wire.arrived_row(shape, &xs[tt * h..(tt + 1) * h])?;
            let token = i32::try_from(s * t + tt).unwrap_or(i32::MAX);
            for (kk, e) in mine {
                let le = e % l;
                let j = out.rows[le].len();
                if j >= c {
                    out.overflow = true;
                    continue;
                }
                out.rows[le].push((token, kk as i32));
                let dst = (le * c + j) * h;
                out.expert_x[dst..dst + h].copy_from_slice(&row);
                out.routing[(le * c + j) * 2] = token;
                out.routing[(le * c + j) * 2 + 1] = kk as i32;
            }
        }
    }
    for (cnt, rows) in out.counts.iter_mut().zip(&out.rows) {
        *cnt = rows.len() as i32;
    }
    Ok(out)
}

/// Combine on one rank from its `topk_idx[T, K]` and `weights[T, K]`: for each token, every
/// rank `r` hosting one of its experts returns `P_r = Σ_k w[t, k] · y(t, k)` over the token's
/// experts on `r` in `k` order (f32, separate multiply and add, starting from +0), rounded to
/// the dtype; `out[t]` is the sum of those partials in ascending `r` (f32, from +0), rounded
/// once. `row(t, k)` is the expert output for `(t, k)`, or `None` for a row that was dropped
/// (it contributes nothing). Ids that are not experts are skipped.
pub fn reference_combine(
    shape: &MoeShape,
    topk_idx: &[i32],
    weights: &[f32],
    row: impl Fn(usize, usize) -> Option<Vec<f32>>,
) -> Result<Vec<f32>> {
    let (t, k, f, l) = (
        shape.tokens,
        shape.top_k,
        shape.out_hidden,
        shape.local_experts(),
    );
    check_len("weights", 0, weights.len(), t * k)?;
    check_len("topk_idx", 0, topk_idx.len(), t * k)?;
    let mut out = vec![0.0f32; t * f];
    let mut partial = vec![0.0f32; f];
    for (tt, acc) in out.chunks_mut(f.max(1)).enumerate().take(t) {
        for r in 0..shape.world {
            let mut any = false;
            partial.fill(0.0);
            for kk in 0..k {
                let Some(e) = expert(shape, topk_idx[tt * k + kk]) else {
                    continue;
                };
                if e / l != r {
                    continue;
                }
                any = true;
                let Some(y) = row(tt, kk) else { continue };
                if y.len() != f {
                    return Err(KernelError::InvalidArgument(format!(
                        "reference MoE: expert row for token {tt}, slot {kk} has {} elements, \
                         expected {f}",
                        y.len()
                    )));
                }
                let wk = weights[tt * k + kk];
                for (p, yv) in partial.iter_mut().zip(y) {
                    *p += wk * yv;
                }
            }
            if any {
                for (a, p) in acc.iter_mut().zip(&partial) {
                    *a += round_to(shape.dtype, *p);
                }
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
    use crate::fp8::Fp8Scales;

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
        let r0 = reference_dispatch(&s, MoeWire::Native, 0, &x, &idx).unwrap();
        assert_eq!(r0.counts, vec![2, 3]);
        assert_eq!(r0.rows[0], vec![(1, 1), (3, 0)]);
        assert_eq!(r0.rows[1], vec![(0, 0), (2, 0), (4, 0)]);
        assert_eq!(&r0.expert_x[..4], &[10., 11., 100., 101.]);
        assert_eq!(&r0.expert_x[4..8], &[0.; 4]);
        assert_eq!(&r0.routing[..4], &[1, 1, 3, 0]);
        let r1 = reference_dispatch(&s, MoeWire::Native, 1, &x, &idx).unwrap();
        assert_eq!(r1.counts, vec![4, 3]);
        assert!(!r1.overflow);
    }

    #[test]
    fn dispatch_drops_rows_past_capacity_and_bad_ids() {
        let s = shape(1, 2, 1, 2);
        let x = vec![vec![1.; 6]];
        let idx = vec![vec![0, 0, 0]];
        let r = reference_dispatch(&s, MoeWire::Native, 0, &x, &idx).unwrap();
        assert_eq!(r.counts, vec![2, 0]);
        assert!(r.overflow);
        let r = reference_dispatch(&s, MoeWire::Native, 0, &x, &[vec![0, 7, -1]]).unwrap();
        assert_eq!(r.counts, vec![1, 0]);
        assert!(!r.overflow);
        assert!(reference_dispatch(&s, MoeWire::Native, 0, &x, &[vec![0, 1]]).is_err());
        assert!(reference_dispatch(&s, MoeWire::Native, 1, &x, &idx).is_err());
    }

    #[test]
    fn fp8_dispatch_dequantizes_each_token_once() {
        let s = MoeShape {
            hidden: 16,
            tokens: 1,
            dtype: DType::BF16,
            ..shape(1, 2, 2, 2)
        };
        let row: Vec<f32> = (0..16).map(|i| round_to(s.dtype, 0.1 + i as f32)).collect();
        let wire = MoeWire::Fp8E4m3(Fp8Scales::PerToken);
        let r = reference_dispatch(&s, wire, 0, std::slice::from_ref(&row), &[vec![1, 0]]).unwrap();
        let want = wire.arrived_row(&s, &row).unwrap();
        assert_eq!(&r.expert_x[..16], &want[..]);
        assert_eq!(&r.expert_x[32..48], &want[..]);
        assert!(reference_dispatch(
            &s,
            MoeWire::Fp8E4m3(Fp8Scales::Block128),
            0,
            &[row],
            &[vec![1, 0]]
        )
        .is_err());
    }

    #[test]
    fn combine_sums_rank_partials_in_rank_order() {
        // 2 ranks x 2 experts; the token picks e2 (rank 1), e0 (rank 0), e3 (rank 1).
        let s = MoeShape {
            dtype: DType::BF16,
            tokens: 1,
            ..shape(2, 4, 3, 2)
        };
        let w = [0.5, 0.25, 1.0];
        let y = |k: usize| -> Vec<f32> {
            match k {
                0 => vec![1.0, 1.0 / 3.0],
                1 => vec![4.0, 3.0],
                _ => vec![0.125, 1e-3],
            }
        };
        let out = reference_combine(&s, &[2, 0, 3], &w, |_, k| Some(y(k))).unwrap();
        let r = |v: f32| round_to(DType::BF16, v);
        // Rank 0's partial: 0.25 * y1; rank 1's: 0.5 * y0 + 1.0 * y2.
        let p0 = [r(0.25 * 4.0), r(0.25 * 3.0)];
        let p1 = [r(0.5 * 1.0 + 0.125), r(0.5 * (1.0f32 / 3.0) + 1e-3)];
        assert_eq!(out, vec![r(p0[0] + p1[0]), r(p0[1] + p1[1])]);
        // A dropped row contributes nothing; bad ids are skipped.
        let dropped = reference_combine(&s, &[2, 0, 9], &w, |_, k| (k == 1).then(|| y(k))).unwrap();
        assert_eq!(dropped, vec![1.0, 0.75]);
        assert!(reference_combine(&s, &[2, 0, 3], &[0.5], |_, _| None).is_err());
    }
}
