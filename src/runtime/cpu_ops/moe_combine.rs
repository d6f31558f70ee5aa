//! MoE combine on the CPU: the sim backend's exchange (expert side: [`pack_combine`], token
//! side: [`unpack_combine`]) and the level-1 reference ([`moe_combine`]), all following the
//! summation order of the `meshflow_ir::moe` module docs: per member holding some of a token's
//! experts, `P = Σ_k w[t, k] · y(t, k)` in ascending `k` (f32, separate multiply and add, from
//! +0) rounded to the dtype of `expert_y`; then `out[t] = Σ_r P_r` in ascending member order
//! (f32 from +0), rounded once.

use std::collections::BTreeMap;

use super::moe::{batch_2, routing_err, MoeRows};
use super::{shape_err, view_err, OpError};
use crate::runtime::data::Storage;
use crate::runtime::view::{View, ViewMut};

const OP: &str = "moe_combine";

/// The valid rows of `expert_y[B.., L, C, F]` by `(batch, team-global token, group)`, each
/// with its `k` and row index (`group(l)` is the member holding local expert `l`); tokens are
/// checked against `0..total_tokens`, and a `(batch, token, k)` may come back only once.
type RowsByPartial = BTreeMap<(u64, i64, u64), Vec<(i64, usize)>>;

struct ExpertRows {
    rows: RowsByPartial,
    /// `F`.
    width: u64,
    /// The rows of `expert_y` as f32.
    ys: Vec<f32>,
    dtype: meshflow_ir::DType,
}

fn rows_by_partial(
    expert_y: &View<'_>,
    counts: &View<'_>,
    routing: &View<'_>,
    total_tokens: u64,
    group: impl Fn(u64) -> u64,
) -> Result<ExpertRows, OpError> {
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
    let (cnt, rt) = (counts.to_i64(), routing.to_i64());
    let mut rows = RowsByPartial::new();
    for (g, &n) in cnt.iter().enumerate() {
        if n < 0 || n as u64 > c {
            return Err(routing_err(
                OP,
                format!("expert count {n} is outside 0..={c}"),
            ));
        }
        let (bb, le) = (g as u64 / l.max(1), g as u64 % l.max(1));
        for r in 0..n as u64 {
            let row = (g as u64 * c + r) as usize;
            let (token, kk) = (rt[row * 2], rt[row * 2 + 1]);
            if token < 0 || token as u64 >= total_tokens || kk < 0 {
                return Err(routing_err(
                    OP,
                    format!("routing names token {token}, slot {kk}, outside 0..{total_tokens}"),
                ));
            }
            let entry = rows.entry((bb, token, group(le))).or_default();
            if entry.iter().any(|&(k2, _)| k2 == kk) {
                return Err(routing_err(
                    OP,
                    format!("two expert rows for token {token}, slot {kk}"),
                ));
            }
            entry.push((kk, row));
        }
    }
    Ok(ExpertRows {
        rows,
        width: f,
        ys: expert_y.to_f32(),
        dtype: expert_y.dtype(),
    })
}

/// The partial of `rows` (sorted here by `k`): `Σ w(k) · y` in ascending `k`, in f32 from +0,
/// rounded to the dtype of `expert_y`.
fn partial(
    er: &ExpertRows,
    rows: &mut [(i64, usize)],
    weight: impl Fn(i64) -> Result<f32, OpError>,
) -> Result<Storage, OpError> {
    rows.sort_by_key(|&(k, _)| k);
    let f = er.width as usize;
    let mut acc = vec![0.0f32; f];
    for &(k, row) in rows.iter() {
        let w = weight(k)?;
        for (a, y) in acc.iter_mut().zip(&er.ys[row * f..(row + 1) * f]) {
            *a += w * y;
        }
    }
    Ok(Storage::from_f32(er.dtype, &acc))
}

/// The weight `weights[member][(b * T + t) * K + k]`, checked.
fn weight_of(
    weights: &[f32],
    b: u64,
    t: u64,
    k: i64,
    tokens: u64,
    top_k: u64,
) -> Result<f32, OpError> {
    if k as u64 >= top_k {
        return Err(routing_err(
            OP,
            format!("routing names top-k slot {k}, outside 0..{top_k}"),
        ));
    }
    weights
        .get(((b * tokens + t) * top_k + k as u64) as usize)
        .copied()
        .ok_or_else(|| shape_err(OP, "the weights are shorter than the routing needs"))
}

/// Expert side of the sim's combine: the partial rows of `expert_y[B.., L, C, F]` for each of
/// `team` members (the tokens' members), one per (batch, token) with rows here, in ascending
/// (batch, token) order. `weights[s]` are member `s`'s `topk_weights[B.., T, K]` as f32.
pub fn pack_combine(
    expert_y: &View<'_>,
    counts: &View<'_>,
    routing: &View<'_>,
    weights: &[Vec<f32>],
    tokens: u64,
    top_k: u64,
) -> Result<Vec<MoeRows>, OpError> {
    let team = weights.len();
    let er = rows_by_partial(expert_y, counts, routing, tokens * team as u64, |_| 0)?;
    let mut out: Vec<MoeRows> = (0..team)
        .map(|_| MoeRows::empty(er.dtype, er.width))
        .collect();
    let mut rows = er.rows.clone();
    for ((bb, token, _), rs) in rows.iter_mut() {
        let (s, t) = ((*token as u64 / tokens) as usize, *token as u64 % tokens);
        let p = partial(&er, rs, |k| {
            weight_of(&weights[s], *bb, t, k, tokens, top_k)
        })?;
        let dest = &mut out[s];
        dest.meta.push([*bb as i64, t as i64, 0, 0]);
        dest.rows.extend_from(&p, 0..p.len());
    }
    Ok(out)
}

/// Token side of the sim's combine: `out[B.., T, F] = Σ_r P_r` over the partials of `msgs`
/// (one message per member, in member order), in f32 from +0, rounded once. Every token must
/// get at least one partial.
pub fn unpack_combine(msgs: &[MoeRows], out: &mut ViewMut<'_>) -> Result<(), OpError> {
    let (b, t, f) = batch_2(OP, "out", out.shape())?;
    let mut res = vec![0f32; (b * t * f) as usize];
    let mut seen = vec![false; (b * t) as usize];
    let fu = f as usize;
    for (r, msg) in msgs.iter().enumerate() {
        if msg.width != f {
            return Err(shape_err(
                OP,
                format!("received rows of width {}, out has {f}", msg.width),
            ));
        }
        let vals = msg.rows.to_f32_vec();
        if vals.len() < msg.meta.len() * fu {
            return Err(shape_err(
                OP,
                "a received message is shorter than its metadata",
            ));
        }
        let mut mine = vec![false; (b * t) as usize];
        for (i, &[bb, tt, _, _]) in msg.meta.iter().enumerate() {
            if bb < 0 || bb as u64 >= b || tt < 0 || tt as u64 >= t {
                return Err(routing_err(
                    OP,
                    format!("a partial for batch {bb}, token {tt} is out of range"),
                ));
            }
            let at = (bb as u64 * t + tt as u64) as usize;
            if std::mem::replace(&mut mine[at], true) {
                return Err(routing_err(
                    OP,
                    format!("member {r} returned two partials for token {tt}"),
                ));
            }
            seen[at] = true;
            for (a, p) in res[at * fu..(at + 1) * fu]
                .iter_mut()
                .zip(&vals[i * fu..(i + 1) * fu])
            {
                *a += p;
            }
        }
    }
    if let Some(at) = seen.iter().position(|s| !s) {
        return Err(routing_err(
            OP,
            format!("no expert row came back for token {}", at as u64 % t.max(1)),
        ));
    }
    out.assign_f32(&res).map_err(view_err(OP))
}

/// Level-1 `moe_combine` on full tensors, with the experts `[B.., E, C, F]` split over `groups`
/// members (`E / groups` each), as the op's sharding has them.
pub fn moe_combine(
    expert_y: &View<'_>,
    counts: &View<'_>,
    routing: &View<'_>,
    weights: &View<'_>,
    groups: u64,
    out: &mut ViewMut<'_>,
) -> Result<(), OpError> {
    let (b, tokens, k) = batch_2(OP, "topk_weights", weights.shape())?;
    let (bo, to, f) = batch_2(OP, "out", out.shape())?;
    let wb = &weights.shape()[..weights.shape().len() - 2];
    if (bo, to) != (b, tokens) || &out.shape()[..out.shape().len() - 2] != wb {
        return Err(shape_err(
            OP,
            format!(
                "out {:?} does not match topk_weights {:?}",
                out.shape(),
                weights.shape()
            ),
        ));
    }
    let s = expert_y.shape();
    let experts = s.len().checked_sub(3).map_or(0, |nb| s[nb]);
    if groups == 0 || !experts.is_multiple_of(groups) {
        return Err(shape_err(
            OP,
            format!("{experts} experts cannot be split over {groups} members"),
        ));
    }
    let per = experts / groups;
    let er = rows_by_partial(expert_y, counts, routing, tokens, |e| e / per)?;
    let w = weights.to_f32();
    let fu = f as usize;
    let mut res = vec![0f32; (b * tokens) as usize * fu];
    let mut seen = vec![false; (b * tokens) as usize];
    let mut rows = er.rows.clone();
    // Keys ascend by (batch, token, group): the partials of a token are added in group order.
    for ((bb, token, _), rs) in rows.iter_mut() {
        let t = *token as u64;
        let p = partial(&er, rs, |kk| weight_of(&w, *bb, t, kk, tokens, k))?.to_f32_vec();
        let at = (*bb * tokens + t) as usize;
        seen[at] = true;
        for (a, v) in res[at * fu..(at + 1) * fu].iter_mut().zip(&p) {
            *a += v;
        }
    }
    if let Some(at) = seen.iter().position(|s| !s) {
        return Err(routing_err(
            OP,
            format!(
                "no expert row came back for token {}",
                at as u64 % tokens.max(1)
            ),
        ));
    }
    out.assign_f32(&res).map_err(view_err(OP))
}
