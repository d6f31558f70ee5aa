//! MoE dispatch: the rows the sim backend's expert-parallel exchange moves and the level-1
//! reference's `moe_dispatch` (the one-member case). The semantics, bit for bit, are those of
//! the `meshflow_ir::moe` module docs.
//!
//! Dispatch sends each token **once per member** hosting one of its experts (a row with the
//! `(local expert, k)` pairs it fans out to, in `k` order), quantized to FP8 when the wire says
//! so; the member appends the rows it receives in canonical order (source member, then token,
//! then `k`), writes the per-expert counts, zero padding, and the routing `(team-global token
//! = src * T + t, k)` of every row. The combine is in [`super::moe_combine`].

use meshflow_ir::{Fp8Scales, MoeWire};
use meshflow_kernels::fp8;

use super::{shape_err, view_err, OpError};
use crate::runtime::data::Storage;
use crate::runtime::view::{View, ViewMut};

/// FP8 payload of dispatched rows: E4M3 codes (`width` per row) and f32 scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Rows {
    /// The codes, `width` per row.
    pub codes: Vec<u8>,
    /// The scales, one per row or one per 128 channels of a row.
    pub scales: Vec<f32>,
    /// Which of the two.
    pub granularity: Fp8Scales,
}

/// Rows travelling between team members.
///
/// Dispatch rows carry `meta = [batch, team-global token, from, to]`, their fan-out targets
/// `targets[from..to]` (`[local expert, k]` in `k` order) and the token (native in `rows`, or
/// FP8 in `fp8` with an empty `rows` of the token dtype). Combine rows carry `meta = [batch,
/// member-local token, 0, 0]` and one partial row each in `rows`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRows {
    /// Metadata per row (see above).
    pub meta: Vec<[i64; 4]>,
    /// Dispatch fan-out targets `[local expert, k]`; empty in a combine.
    pub targets: Vec<[i64; 2]>,
    /// Row data, `meta.len() * width` elements (empty for FP8 rows).
    pub rows: Storage,
    /// FP8 dispatch rows.
    pub fp8: Option<Fp8Rows>,
    /// Elements per row.
    pub width: u64,
}

impl MoeRows {
    /// An empty message of rows of `dtype`, `width` each.
    pub(super) fn empty(dtype: meshflow_ir::DType, width: u64) -> MoeRows {
        MoeRows {
            meta: Vec::new(),
            targets: Vec::new(),
            rows: Storage::zeros(dtype, 0),
            fp8: None,
            width,
        }
    }

    /// Bytes the message body occupies (row data, FP8 codes and scales, metadata).
    pub fn size_bytes(&self) -> u64 {
        let fp8 = self.fp8.as_ref().map_or(0, |f| {
            (f.codes.len() as u64).saturating_add((f.scales.len() as u64).saturating_mul(4))
        });
        self.rows
            .size_bytes()
            .saturating_add(fp8)
            .saturating_add((self.meta.len() as u64).saturating_mul(32))
            .saturating_add((self.targets.len() as u64).saturating_mul(16))
    }
}

pub(super) fn routing_err(op: &'static str, message: String) -> OpError {
    OpError::Routing { op, message }
}

/// Splits `[B.., X, Y]` into `(batch, X, Y)`.
pub(super) fn batch_2(op: &'static str, what: &str, s: &[u64]) -> Result<(u64, u64, u64), OpError> {
    if s.len() < 2 {
        return Err(shape_err(
            op,
            format!("{what} must be [B.., T, _], has {s:?}"),
        ));
    }
    let nb = s.len() - 2;
    Ok((s[..nb].iter().product(), s[nb], s[nb + 1]))
}

/// The kernels crate's name for a scale granularity.
pub(crate) fn kernel_scales(s: Fp8Scales) -> fp8::Fp8Scales {
    match s {
        Fp8Scales::PerToken => fp8::Fp8Scales::PerToken,
        Fp8Scales::Block128 => fp8::Fp8Scales::Block128,
    }
}

/// Packs the tokens of `x[B.., T, H]` for each of `team` members by `topk_idx[B.., T, K]`: one
/// row per (token, member hosting one of its experts), in ascending (batch, token) order,
/// encoded as `wire`. `my_index` numbers the tokens team-globally.
pub fn pack_dispatch(
    x: &View<'_>,
    topk_idx: &View<'_>,
    my_index: usize,
    team: usize,
    local_experts: u64,
    wire: MoeWire,
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
    if let Some(why) = wire.width_error(h) {
        return Err(shape_err(OP, why));
    }
    let experts = local_experts * team as u64;
    let (xs, idx) = (x.to_storage(), topk_idx.to_i64());
    let xf = (wire != MoeWire::Native).then(|| xs.to_f32_vec());
    let mut out: Vec<MoeRows> = (0..team)
        .map(|_| {
            let mut m = MoeRows::empty(x.dtype(), h);
            if let MoeWire::Fp8E4m3(granularity) = wire {
                m.fp8 = Some(Fp8Rows {
                    codes: Vec::new(),
                    scales: Vec::new(),
                    granularity,
                });
            }
            m
        })
        .collect();
    let (h, k) = (h as usize, k as usize);
    for bb in 0..b as usize {
        for tt in 0..t as usize {
            let row_at = bb * t as usize + tt;
            let ids = &idx[row_at * k..(row_at + 1) * k];
            for (kk, &e) in ids.iter().enumerate() {
                if e < 0 || e as u64 >= experts {
                    return Err(routing_err(
                        OP,
                        format!(
                            "topk_idx[{bb}, {tt}, {kk}] = {e} is not an expert id in 0..{experts}"
                        ),
                    ));
                }
            }
            let token = my_index as i64 * t as i64 + tt as i64;
            let mut quantized: Option<(Vec<u8>, Vec<f32>)> = None;
            for (d, dest) in out.iter_mut().enumerate() {
                let from = dest.targets.len() as i64;
                for (kk, &e) in ids.iter().enumerate() {
                    if (e as u64 / local_experts) as usize == d {
                        dest.targets.push([e % local_experts as i64, kk as i64]);
                    }
                }
                let to = dest.targets.len() as i64;
                if to == from {
                    continue;
                }
                dest.meta.push([bb as i64, token, from, to]);
                let range = row_at * h..(row_at + 1) * h;
                match (&mut dest.fp8, wire, &xf) {
                    (Some(f), MoeWire::Fp8E4m3(g), Some(xf)) => {
                        if quantized.is_none() {
                            quantized =
                                Some(fp8::quantize_row(&xf[range], kernel_scales(g)).ok_or_else(
                                    || shape_err(OP, format!("{h} channels cannot be quantized")),
                                )?);
                        }
                        if let Some((codes, scales)) = &quantized {
                            f.codes.extend_from_slice(codes);
                            f.scales.extend_from_slice(scales);
                        }
                    }
                    _ => {
                        dest.rows.extend_from(&xs, range);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The token of row `i` of `msg` as it arrives: the native row, or the FP8 row dequantized
/// and rounded to `dtype`.
fn arrived_row(op: &'static str, msg: &MoeRows, i: usize, h: usize) -> Result<Storage, OpError> {
    let short = || shape_err(op, "a received message is shorter than its metadata");
    match &msg.fp8 {
        None => {
            if msg.rows.len() < (i + 1) * h {
                return Err(short());
            }
            Ok(msg.rows.slice(i * h..(i + 1) * h))
        }
        Some(f) => {
            let g = kernel_scales(f.granularity);
            let n = g
                .per_row(h)
                .ok_or_else(|| shape_err(op, "FP8 rows of a bad width"))?;
            let codes = f.codes.get(i * h..(i + 1) * h).ok_or_else(short)?;
            let scales = f.scales.get(i * n..(i + 1) * n).ok_or_else(short)?;
            let v = fp8::dequantize_row(codes, scales, g).ok_or_else(short)?;
            Ok(Storage::from_f32(msg.rows.dtype(), &v))
        }
    }
}

/// Fans received rows (`msgs` in source team order) out into `expert_x[B.., L, C, H]`,
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
        for (i, &[bb, token, from, to]) in msg.meta.iter().enumerate() {
            if bb < 0 || bb as u64 >= b || from < 0 || to < from || to as usize > msg.targets.len()
            {
                return Err(routing_err(
                    OP,
                    format!("received row {i} (batch {bb}, targets {from}..{to}) is out of range"),
                ));
            }
            let row = arrived_row(OP, msg, i, h as usize)?;
            for &[le, kk] in &msg.targets[from as usize..to as usize] {
                if le < 0 || le as u64 >= l {
                    return Err(routing_err(
                        OP,
                        format!("row for local expert {le} is out of range 0..{l}"),
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
                if !ex.write_at(dst, &row, 0..h as usize) {
                    return Err(shape_err(OP, "a received row does not fit expert_x"));
                }
                let ri = ((g as u64 * c + r) * 2) as usize;
                rt[ri] = token;
                rt[ri + 1] = kk;
                cnt[g] += 1;
            }
        }
    }
    expert_x.assign_storage(&ex).map_err(view_err(OP))?;
    counts.assign_i64(&cnt).map_err(view_err(OP))?;
    routing.assign_i64(&rt).map_err(view_err(OP))
}

/// Level-1 `moe_dispatch` on full tensors: `expert_x[B.., E, C, H]` receives, per expert,
/// the rows `(t, k)` with `topk_idx[t, k] == e` in ascending `(t, k)` order (FP8 rows
/// quantized and dequantized as the wire says).
pub fn moe_dispatch(
    x: &View<'_>,
    topk_idx: &View<'_>,
    wire: MoeWire,
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
    let msgs = pack_dispatch(x, topk_idx, 0, 1, experts, wire)?;
    unpack_dispatch(&msgs, 0, expert_x, counts, routing)
}
