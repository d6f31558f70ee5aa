//! MoE ops of the reference on full tensors: dispatch gives each expert its rows in ascending
//! `(token, k)` order (as they arrive over the op's wire), zero padding and the routing
//! `(token, k)` of each row; combine is `out[t] = sum_k w[t, k] * y(t, k)` in `f64`, rounded
//! once. The sharded backends must agree with this bit for bit on the dispatched rows and
//! within tolerance on the combined values (they sum in the two stages of the
//! `meshflow_ir::moe` docs, rounding each partial to the dtype).

use meshflow_ir::MoeWire;

use super::dense::{numel, Dense};
use super::fp8::over_wire;
use super::ops::{same_shape, OutType};

/// Splits `[B.., X, Y]` into `(batch shape, X, Y)`.
fn batch_2<'s>(what: &str, s: &'s [u64]) -> Result<(&'s [u64], u64, u64), String> {
    if s.len() < 2 {
        return Err(format!("{what} must be [B.., _, _], has {s:?}"));
    }
    let nb = s.len() - 2;
    Ok((&s[..nb], s[nb], s[nb + 1]))
}

/// Splits `[B.., X, Y, Z]` into `(batch shape, X, Y, Z)`.
fn batch_3<'s>(what: &str, s: &'s [u64]) -> Result<(&'s [u64], u64, u64, u64), String> {
    if s.len() < 3 {
        return Err(format!("{what} must be [B.., _, _, _], has {s:?}"));
    }
    let nb = s.len() - 3;
    Ok((&s[..nb], s[nb], s[nb + 1], s[nb + 2]))
}

fn with(batch: &[u64], tail: &[u64]) -> Vec<u64> {
    let mut v = batch.to_vec();
    v.extend_from_slice(tail);
    v
}

/// `out[b, e, r, :] = expert_x[b, e, r, :] @ w[e]` for rows `r < counts[b, e]`, zero after.
pub(crate) fn grouped_matmul(
    ex: &Dense,
    counts: &Dense,
    w: &Dense,
    (dtype, shape): &OutType,
) -> Result<Dense, String> {
    let (batch, e, c, h) = batch_3("expert_x", &ex.shape)?;
    same_shape("expert_counts", &counts.shape, &with(batch, &[e]))?;
    if w.shape.len() != 3 || w.shape[0] != e || w.shape[1] != h {
        return Err(format!("weights must be [{e}, {h}, F], have {:?}", w.shape));
    }
    let f = w.shape[2];
    same_shape("the output", shape, &with(batch, &[e, c, f]))?;
    let (xv, cv, wv) = (ex.floats(), counts.ints(), w.floats());
    let (e, c, h, f) = (e as usize, c as usize, h as usize, f as usize);
    let mut res = vec![0.0f64; numel(shape)?];
    for (g, &count) in cv.iter().enumerate() {
        let expert = g % e.max(1);
        let rows = usize::try_from(count)
            .ok()
            .filter(|&n| n <= c)
            .ok_or_else(|| format!("expert count {count} is outside 0..={c}"))?;
        for r in 0..rows {
            for j in 0..f {
                let mut acc = 0.0f64;
                for k in 0..h {
                    acc += xv[(g * c + r) * h + k] * wv[(expert * h + k) * f + j];
                }
                res[(g * c + r) * f + j] = acc;
            }
        }
    }
    Ok(Dense::from_f64(*dtype, shape, res))
}

/// `moe_dispatch(x[B.., T, H], topk_idx[B.., T, K])` into `expert_x[B.., E, C, H]`,
/// `counts[B.., E]` and `routing[B.., E, C, 2]`, the tokens travelling as `wire` (FP8:
/// quantized and dequantized, [`super::fp8`]).
pub(crate) fn dispatch(
    x: &Dense,
    idx: &Dense,
    wire: MoeWire,
    outs: &[OutType],
) -> Result<Vec<Dense>, String> {
    let [(ex_t, ex_s), (cnt_t, cnt_s), (rt_t, rt_s)] = outs else {
        return Err("moe_dispatch has three outputs".into());
    };
    let (batch, t, h) = batch_2("x", &x.shape)?;
    let (ibatch, it, k) = batch_2("topk_idx", &idx.shape)?;
    if ibatch != batch || it != t {
        return Err(format!(
            "topk_idx {:?} does not fit x {:?}",
            idx.shape, x.shape
        ));
    }
    let (_, e, c, _) = batch_3("expert_x", ex_s)?;
    same_shape("expert_x", ex_s, &with(batch, &[e, c, h]))?;
    same_shape("expert_counts", cnt_s, &with(batch, &[e]))?;
    same_shape("routing", rt_s, &with(batch, &[e, c, 2]))?;
    let b = numel(batch)?;
    let (t, h, k, e, c) = (t as usize, h as usize, k as usize, e as usize, c as usize);
    let (xv, iv) = (over_wire(&x.floats(), h, wire, x.dtype), idx.ints());
    let mut rows = vec![0.0f64; b * e * c * h];
    let mut counts = vec![0i64; b * e];
    let mut routing = vec![0i64; b * e * c * 2];
    for bb in 0..b {
        for tt in 0..t {
            for kk in 0..k {
                let expert = iv[(bb * t + tt) * k + kk];
                let ei = usize::try_from(expert)
                    .ok()
                    .filter(|&v| v < e)
                    .ok_or_else(|| {
                        format!(
                            "topk_idx[{bb}, {tt}, {kk}] = {expert} is not an expert id in 0..{e}"
                        )
                    })?;
                let g = bb * e + ei;
                let r = counts[g] as usize;
                if r >= c {
                    return Err(format!(
                        "expert {expert} receives more than its capacity of {c} rows"
                    ));
                }
                for j in 0..h {
                    rows[(g * c + r) * h + j] = xv[(bb * t + tt) * h + j];
                }
                routing[(g * c + r) * 2] = tt as i64;
                routing[(g * c + r) * 2 + 1] = kk as i64;
                counts[g] += 1;
            }
        }
    }
    Ok(vec![
        Dense::from_f64(*ex_t, ex_s, rows),
        Dense::from_i64(*cnt_t, cnt_s, counts),
        Dense::from_i64(*rt_t, rt_s, routing),
    ])
}

/// `moe_combine(expert_y[B.., E, C, F], counts, routing, topk_weights[B.., T, K])`:
/// `out[b, t, :] = sum_k w[b, t, k] * expert_y[row of (t, k)]`; every `(t, k)` must have
/// exactly one row.
pub(crate) fn combine(
    ey: &Dense,
    counts: &Dense,
    routing: &Dense,
    weights: &Dense,
    (dtype, shape): &OutType,
) -> Result<Dense, String> {
    let (batch, e, c, f) = batch_3("expert_y", &ey.shape)?;
    same_shape("expert_counts", &counts.shape, &with(batch, &[e]))?;
    same_shape("routing", &routing.shape, &with(batch, &[e, c, 2]))?;
    let (wbatch, t, k) = batch_2("topk_weights", &weights.shape)?;
    if wbatch != batch {
        return Err(format!(
            "topk_weights {:?} does not fit expert_y",
            weights.shape
        ));
    }
    same_shape("the output", shape, &with(batch, &[t, f]))?;
    let b = numel(batch)?;
    let (e, c, f, t, k) = (e as usize, c as usize, f as usize, t as usize, k as usize);
    let (yv, cv, rv, wv) = (ey.floats(), counts.ints(), routing.ints(), weights.floats());
    let mut seen = vec![false; b * t * k];
    let mut res = vec![0.0f64; b * t * f];
    for g in 0..b * e {
        let bb = g / e.max(1);
        let rows = usize::try_from(cv[g])
            .ok()
            .filter(|&n| n <= c)
            .ok_or_else(|| format!("expert count {} is outside 0..={c}", cv[g]))?;
        for r in 0..rows {
            let (tt, kk) = (rv[(g * c + r) * 2], rv[(g * c + r) * 2 + 1]);
            let (Some(tt), Some(kk)) = (
                usize::try_from(tt).ok().filter(|&v| v < t),
                usize::try_from(kk).ok().filter(|&v| v < k),
            ) else {
                return Err(format!("routing names token {tt}, slot {kk}: out of range"));
            };
            let slot = (bb * t + tt) * k + kk;
            if std::mem::replace(&mut seen[slot], true) {
                return Err(format!("two expert rows for token {tt}, slot {kk}"));
            }
            for j in 0..f {
                res[(bb * t + tt) * f + j] += wv[slot] * yv[(g * c + r) * f + j];
            }
        }
    }
    if let Some(missing) = seen.iter().position(|&s| !s) {
        return Err(format!(
            "no expert row came back for token {}, slot {}",
            missing / k.max(1) % t.max(1),
            missing % k.max(1)
        ));
    }
    Ok(Dense::from_f64(*dtype, shape, res))
}
