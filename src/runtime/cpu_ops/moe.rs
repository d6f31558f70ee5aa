//! MoE dispatch and combine: the row packing both the level-1 reference and the CPU backend's
//! expert-parallel exchange are built from.
//!
//! Semantics (pplx-kernels'): on an expert-parallel team of `W` members with `L` local experts
//! each (`E = W * L`), expert `e` lives on member `e / L` as local expert `e % L`. Dispatch
//! sends row `x[t]` for every `(t, k)` to expert `topk_idx[t, k]`; a member appends the rows it
//! receives in canonical order (source team index, then token, then `k`), writes the per-expert
//! counts, zero padding, and the routing `(team-global token = src * T + t, k)` of every row.
//! Combine sends each valid expert row back to its token's member, which computes
//! `out[t] = sum_k w[t, k] * y(t, k)` accumulated in `f32` in `k` order and rounded once. The
//! level-1 reference is the one-member case.

use super::{shape_err, view_err, OpError};
use crate::runtime::data::Storage;
use crate::runtime::view::{View, ViewMut};

/// Rows travelling between team members, each with integer metadata.
///
/// Dispatch metadata is `[batch, local expert, team-global token, k]`; combine metadata is
/// `[batch, local token, k, 0]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRows {
    /// Metadata per row.
    pub meta: Vec<[i64; 4]>,
    /// Row data, `meta.len() * width` elements.
    pub rows: Storage,
    /// Elements per row.
    pub width: u64,
}

fn routing_err(op: &'static str, message: String) -> OpError {
    OpError::Routing { op, message }
}

/// Splits `[B.., X, Y]` into `(batch, X, Y)`.
fn batch_2(op: &'static str, what: &str, s: &[u64]) -> Result<(u64, u64, u64), OpError> {
    if s.len() < 2 {
        return Err(shape_err(
            op,
            format!("{what} must be [B.., T, _], has {s:?}"),
        ));
    }
    let nb = s.len() - 2;
    Ok((s[..nb].iter().product(), s[nb], s[nb + 1]))
}

/// Packs the rows of `x[B.., T, H]` for each of `team` members by `topk_idx[B.., T, K]`,
/// in ascending `(token, k)` order. `my_index` numbers the tokens team-globally.
pub fn pack_dispatch(
    x: &View<'_>,
    topk_idx: &View<'_>,
    my_index: usize,
    team: usize,
    local_experts: u64,
) -> Result<Vec<MoeRows>, OpError> {
    const OP: &str = "moe_dispatch";
    let (b, t, h) = batch_2(OP, "x", x.shape())?;
    let (bi, ti, k) = batch_2(OP, "topk_idx", topk_idx.shape())?;
    if x.shape()[..x.shape().len() - 2] != topk_idx.shape()[..topk_idx.shape().len() - 2]
        || (bi, ti) != (b, t)
    {
        return Err(shape_err(
            OP,
            format!(
                "topk_idx {:?} does not match tokens {:?}",
                topk_idx.shape(),
                x.shape()
            ),
        ));
    }
    let experts = local_experts * team as u64;
    let (xs, idx) = (x.to_storage(), topk_idx.to_i64());
    let mut out: Vec<MoeRows> = (0..team)
        .map(|_| MoeRows {
            meta: Vec::new(),
            rows: Storage::zeros(x.dtype(), 0),
            width: h,
        })
        .collect();
    let h = h as usize;
    for bb in 0..b {
        for tt in 0..t {
            for kk in 0..k {
                let flat = ((bb * t + tt) * k + kk) as usize;
                let e = idx[flat];
                if e < 0 || e as u64 >= experts {
                    return Err(routing_err(
                        OP,
                        format!(
                            "topk_idx[{bb}, {tt}, {kk}] = {e} is not an expert id in 0..{experts}"
                        ),
                    ));
                }
                let dest = &mut out[(e as u64 / local_experts) as usize];
                let token = my_index as i64 * t as i64 + tt as i64;
                dest.meta
                    .push([bb as i64, e % local_experts as i64, token, kk as i64]);
                let row = ((bb * t + tt) as usize) * h;
                dest.rows.extend_from(&xs, row..row + h);
            }
        }
    }
    Ok(out)
}

/// Appends received rows (`msgs` in source team order) into `expert_x[B.., L, C, H]`,
/// writing `counts[B.., L]`, `routing[B.., L, C, 2]` and zero padding.
pub fn unpack_dispatch(
    msgs: &[MoeRows],
    my_index: usize,
    expert_x: &mut ViewMut<'_>,
    counts: &mut ViewMut<'_>,
    routing: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    const OP: &str = "moe_dispatch";
    let s = expert_x.shape().to_vec();
    if s.len() < 3 {
        return Err(shape_err(
            OP,
            format!("expert_x must be [B.., L, C, H], has {s:?}"),
        ));
    }
    let nb = s.len() - 3;
    let (l, c, h) = (s[nb], s[nb + 1], s[nb + 2]);
    let b: u64 = s[..nb].iter().product();
    let mut want = s[..nb].to_vec();
    want.push(l);
    if counts.shape() != want.as_slice() {
        return Err(shape_err(
            OP,
            format!("expert_counts must be {want:?}, is {:?}", counts.shape()),
        ));
    }
    want.extend([c, 2]);
    if routing.shape() != want.as_slice() {
        return Err(shape_err(
            OP,
            format!("routing must be {want:?}, is {:?}", routing.shape()),
        ));
    }
    let mut ex = Storage::zeros(expert_x.dtype(), (b * l * c * h) as usize);
    let mut cnt = vec![0i64; (b * l) as usize];
    let mut rt = vec![0i64; (b * l * c * 2) as usize];
    for msg in msgs {
        if msg.width != h || msg.rows.dtype() != expert_x.dtype() {
            return Err(shape_err(
                OP,
                format!(
                    "received rows of {} x {}, expert_x holds {} x {h}",
                    msg.rows.dtype(),
                    msg.width,
                    expert_x.dtype()
                ),
            ));
        }
        for (i, &[bb, le, token, kk]) in msg.meta.iter().enumerate() {
            if bb < 0 || bb as u64 >= b || le < 0 || le as u64 >= l {
                return Err(routing_err(
                    OP,
                    format!("row for batch {bb}, local expert {le} is out of range"),
                ));
            }
            let g = (bb as u64 * l + le as u64) as usize;
            let r = cnt[g] as u64;
            if r >= c {
                return Err(OpError::Capacity {
                    expert: my_index as i64 * l as i64 + le,
                    capacity: c,
                });
            }
            let dst = ((g as u64 * c + r) * h) as usize;
            let src = i * h as usize;
            if !ex.write_at(dst, &msg.rows, src..src + h as usize) {
                return Err(shape_err(
                    OP,
                    "a received message is shorter than its metadata",
                ));
            }
            let ri = ((g as u64 * c + r) * 2) as usize;
            rt[ri] = token;
            rt[ri + 1] = kk;
            cnt[g] += 1;
        }
    }
    expert_x.assign_storage(&ex).map_err(view_err(OP))?;
    counts.assign_i64(&cnt).map_err(view_err(OP))?;
    routing.assign_i64(&rt).map_err(view_err(OP))
}

/// Packs the valid rows of `expert_y[B.., L, C, F]` back to the members owning their tokens
/// (`tokens` tokens per member).
pub fn pack_combine(
    expert_y: &View<'_>,
    counts: &View<'_>,
    routing: &View<'_>,
    team: usize,
    tokens: u64,
) -> Result<Vec<MoeRows>, OpError> {
    const OP: &str = "moe_combine";
    let s = expert_y.shape();
    if s.len() < 3 {
        return Err(shape_err(
            OP,
            format!("expert_y must be [B.., L, C, F], has {s:?}"),
        ));
    }
    let nb = s.len() - 3;
    let (l, c, f) = (s[nb], s[nb + 1], s[nb + 2]);
    let mut want = s[..nb].to_vec();
    want.push(l);
    if counts.shape() != want.as_slice() {
        return Err(shape_err(
            OP,
            format!("expert_counts must be {want:?}, is {:?}", counts.shape()),
        ));
    }
    want.extend([c, 2]);
    if routing.shape() != want.as_slice() {
        return Err(shape_err(
            OP,
            format!("routing must be {want:?}, is {:?}", routing.shape()),
        ));
    }
    let (ys, cnt, rt) = (expert_y.to_storage(), counts.to_i64(), routing.to_i64());
    let mut out: Vec<MoeRows> = (0..team)
        .map(|_| MoeRows {
            meta: Vec::new(),
            rows: Storage::zeros(expert_y.dtype(), 0),
            width: f,
        })
        .collect();
    let total_tokens = tokens * team as u64;
    for (g, &n) in cnt.iter().enumerate() {
        if n < 0 || n as u64 > c {
            return Err(routing_err(
                OP,
                format!("expert count {n} is outside 0..={c}"),
            ));
        }
        let bb = g as u64 / l.max(1);
        for r in 0..n as u64 {
            let ri = ((g as u64 * c + r) * 2) as usize;
            let (token, kk) = (rt[ri], rt[ri + 1]);
            if token < 0 || token as u64 >= total_tokens {
                return Err(routing_err(
                    OP,
                    format!("routing names token {token}, outside 0..{total_tokens}"),
                ));
            }
            let dest = &mut out[(token as u64 / tokens) as usize];
            dest.meta
                .push([bb as i64, (token as u64 % tokens) as i64, kk, 0]);
            let row = ((g as u64 * c + r) * f) as usize;
            dest.rows.extend_from(&ys, row..row + f as usize);
        }
    }
    Ok(out)
}

/// Combines received expert rows: `out[B.., T, F] = sum_k w[t, k] * y(t, k)` with
/// `weights[B.., T, K]`, accumulated in `f32` in `k` order and rounded once.
pub fn unpack_combine(
    msgs: &[MoeRows],
    weights: &View<'_>,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    const OP: &str = "moe_combine";
    let (b, t, k) = batch_2(OP, "topk_weights", weights.shape())?;
    let (bo, to, f) = batch_2(OP, "out", out.shape())?;
    let wb = &weights.shape()[..weights.shape().len() - 2];
    if (bo, to) != (b, t) || &out.shape()[..out.shape().len() - 2] != wb {
        return Err(shape_err(
            OP,
            format!(
                "out {:?} does not match topk_weights {:?}",
                out.shape(),
                weights.shape()
            ),
        ));
    }
    // slot[(b, t, k)] = (message, row)
    let mut slot: Vec<Option<(usize, usize)>> = vec![None; (b * t * k) as usize];
    for (mi, msg) in msgs.iter().enumerate() {
        if msg.width != f {
            return Err(shape_err(
                OP,
                format!("received rows of width {}, out has {f}", msg.width),
            ));
        }
        for (ri, &[bb, tt, kk, _]) in msg.meta.iter().enumerate() {
            if bb < 0 || bb as u64 >= b || tt < 0 || tt as u64 >= t || kk < 0 || kk as u64 >= k {
                return Err(routing_err(
                    OP,
                    format!("expert row for batch {bb}, token {tt}, slot {kk} is out of range"),
                ));
            }
            let s = &mut slot[((bb as u64 * t + tt as u64) * k + kk as u64) as usize];
            if s.replace((mi, ri)).is_some() {
                return Err(routing_err(
                    OP,
                    format!("two expert rows for token {tt}, slot {kk}"),
                ));
            }
        }
    }
    let rows: Vec<Vec<f32>> = msgs.iter().map(|m| m.rows.to_f32_vec()).collect();
    let w = weights.to_f32();
    let f = f as usize;
    let mut res = vec![0f32; (b * t) as usize * f];
    for (bt, acc) in res.chunks_mut(f.max(1)).enumerate().take((b * t) as usize) {
        for kk in 0..k as usize {
            let flat = bt * k as usize + kk;
            let Some((mi, ri)) = slot[flat] else {
                return Err(routing_err(
                    OP,
                    format!(
                        "no expert row came back for token {}, slot {kk}",
                        bt as u64 % t.max(1)
                    ),
                ));
            };
            let y = &rows[mi][ri * f..(ri + 1) * f];
            let wk = w[flat];
            for (a, &yv) in acc.iter_mut().zip(y) {
                *a += wk * yv;
            }
        }
    }
    out.assign_f32(&res).map_err(view_err(OP))
}

/// Level-1 `moe_dispatch` on full tensors: `expert_x[B.., E, C, H]` receives, per expert,
/// the rows `(t, k)` with `topk_idx[t, k] == e` in ascending `(t, k)` order.
pub fn moe_dispatch(
    x: &View<'_>,
    topk_idx: &View<'_>,
    expert_x: &mut ViewMut<'_>,
    counts: &mut ViewMut<'_>,
    routing: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    let s = expert_x.shape();
    let experts = s.len().checked_sub(3).map(|nb| s[nb]).ok_or_else(|| {
        shape_err(
            "moe_dispatch",
            format!("expert_x must be [B.., E, C, H], has {s:?}"),
        )
    })?;
    let msgs = pack_dispatch(x, topk_idx, 0, 1, experts)?;
    unpack_dispatch(&msgs, 0, expert_x, counts, routing)
}

/// Level-1 `moe_combine` on full tensors.
pub fn moe_combine(
    expert_y: &View<'_>,
    counts: &View<'_>,
    routing: &View<'_>,
    weights: &View<'_>,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    let (_, tokens, _) = batch_2("moe_combine", "topk_weights", weights.shape())?;
    let msgs = pack_combine(expert_y, counts, routing, 1, tokens)?;
    unpack_combine(&msgs, weights, out)
}
