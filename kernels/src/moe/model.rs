//! A sequential CPU model of the `moe.cu` kernels, for the tests: each function mirrors one
//! kernel's index math over byte buffers laid out exactly as on the device ([`WireLayout`],
//! [`SymLayout`], the NCCL blocks), one loop iteration per warp item in item order. Run
//! sequentially, atomics hand out positions in item order, so the model reproduces the
//! reference's canonical row order and is compared with it bit for bit.

use half::{bf16, f16};

use super::layout::{nccl_block_bytes, SymLayout, NCCL_HEADER};
use super::{round_to, MoeShape, MoeWire, WireLayout};
use crate::dtype::DType;
use crate::fp8;

/// Which transport's buffers the model lays out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Net {
    Nccl,
    Nvlink,
}

/// One step's inputs of every rank (values of the shape's dtype).
pub(crate) struct Inputs {
    pub x: Vec<Vec<f32>>,
    pub idx: Vec<Vec<i32>>,
    pub w: Vec<Vec<f32>>,
}

/// One rank's results.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RankOut {
    pub counts: Vec<i32>,
    pub expert_x: Vec<f32>,
    pub routing: Vec<i32>,
    pub out: Vec<f32>,
    pub overflow: bool,
    /// Rows received from each source.
    pub received: Vec<usize>,
}

fn put(dtype: DType, buf: &mut [u8], at: usize, v: f32) {
    match dtype {
        DType::BF16 => buf[at..at + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DType::F16 => buf[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        _ => buf[at..at + 4].copy_from_slice(&v.to_le_bytes()),
    }
}

fn get(dtype: DType, buf: &[u8], at: usize) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_le_bytes([buf[at], buf[at + 1]]).to_f32(),
        DType::F16 => f16::from_le_bytes([buf[at], buf[at + 1]]).to_f32(),
        _ => f32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]),
    }
}

fn put_i32(buf: &mut [u8], at: usize, v: i32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn get_i32(buf: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

fn get_f32(buf: &[u8], at: usize) -> f32 {
    f32::from_bits(get_i32(buf, at) as u32)
}

/// `warp_write_wire_row`: payload, scales, metadata of token `token` at `dst[at..]`.
#[allow(clippy::too_many_arguments)]
fn write_wire_row(
    shape: &MoeShape,
    wire: MoeWire,
    lay: &WireLayout,
    dst: &mut [u8],
    at: usize,
    x_row: &[f32],
    token: usize,
    idx_row: &[i32],
    w_row: Option<&[f32]>,
) {
    let es = shape.dtype.size_bytes();
    match wire {
        MoeWire::Native => {
            for (i, v) in x_row.iter().enumerate() {
                put(shape.dtype, dst, at + i * es, *v);
            }
        }
        MoeWire::Fp8E4m3(scales) => {
            let (codes, s) = fp8::quantize_row(x_row, scales).expect("validated width");
            dst[at..at + codes.len()].copy_from_slice(&codes);
            for (i, v) in s.iter().enumerate() {
                dst[at + lay.scale_off + 4 * i..][..4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    put_i32(dst, at + lay.meta_off, token as i32);
    let k = shape.top_k;
    for (kk, &e) in idx_row.iter().enumerate() {
        put_i32(dst, at + lay.idx_off() + 4 * kk, e);
        let w = w_row.map_or(0.0, |w| w[kk]);
        dst[at + lay.weights_off(k) + 4 * kk..][..4].copy_from_slice(&w.to_le_bytes());
    }
}

/// `warp_read_wire_row`: the payload of the row at `src[at..]`, as values of the dtype.
fn read_wire_row(
    shape: &MoeShape,
    wire: MoeWire,
    lay: &WireLayout,
    src: &[u8],
    at: usize,
) -> Vec<f32> {
    let h = shape.hidden;
    match wire {
        MoeWire::Native => (0..h)
            .map(|i| get(shape.dtype, src, at + i * shape.dtype.size_bytes()))
            .collect(),
        MoeWire::Fp8E4m3(scales) => {
            let n = scales.per_row(h).expect("validated width");
            let s: Vec<f32> = (0..n)
                .map(|i| get_f32(src, at + lay.scale_off + 4 * i))
                .collect();
            fp8::dequantize_row(&src[at..at + h], &s, scales)
                .expect("validated width")
                .into_iter()
                .map(|v| round_to(shape.dtype, v))
                .collect()
        }
    }
}

/// Runs one step of `net` with the weights at dispatch (`early`) or at combine, and
/// `expert(e, row)` as every expert's computation.
pub(crate) fn run(
    shape: &MoeShape,
    wire: MoeWire,
    net: Net,
    inp: &Inputs,
    early: bool,
    expert: impl Fn(usize, &[f32]) -> Vec<f32>,
) -> Vec<RankOut> {
    let (w, t, k, h, f) = (
        shape.world,
        shape.tokens,
        shape.top_k,
        shape.hidden,
        shape.out_hidden,
    );
    let (l, c, e_total) = (shape.local_experts(), shape.capacity, shape.experts);
    let lay = WireLayout::of(shape, wire);
    let stride = lay.stride;
    let blocks = nccl_block_bytes(shape, wire);
    let sym = SymLayout::of(shape, wire);
    let rb = shape.y_row_bytes();
    let valid = |e: i32| e >= 0 && (e as usize) < e_total;

    let mut symm = vec![vec![0u8; sym.total]; w];
    let mut send = vec![vec![0u8; w * blocks]; w];
    let mut recv = vec![vec![0u8; w * blocks]; w];
    let mut sent_pos = vec![vec![-1i32; t * w]; w];

    // moe_{nccl,nvl}_dispatch_send: one item per (token, destination), then the last block.
    for s in 0..w {
        let mut cnt = vec![0i32; w];
        for item in 0..t * w {
            let (tt, d) = (item / w, item % w);
            let idx = &inp.idx[s][tt * k..(tt + 1) * k];
            if !idx.iter().any(|&e| valid(e) && e as usize / l == d) {
                sent_pos[s][tt * w + d] = -1;
                continue;
            }
            let pos = cnt[d] as usize;
            cnt[d] += 1;
            let (buf, at) = match net {
                Net::Nvlink => (&mut symm[d], sym.rows + (s * t + pos) * stride),
                Net::Nccl => (&mut send[s], d * blocks + NCCL_HEADER + pos * stride),
            };
            let w_row = early.then(|| &inp.w[s][tt * k..(tt + 1) * k]);
            write_wire_row(
                shape,
                wire,
                &lay,
                buf,
                at,
                &inp.x[s][tt * h..(tt + 1) * h],
                tt,
                idx,
                w_row,
            );
            sent_pos[s][tt * w + d] = pos as i32;
        }
        for (d, &n) in cnt.iter().enumerate() {
            match net {
                Net::Nvlink => put_i32(&mut symm[d], sym.counts + 4 * s, n),
                Net::Nccl => put_i32(&mut send[s], d * blocks, n),
            }
        }
    }
    if net == Net::Nccl {
        for d in 0..w {
            for s in (0..w).filter(|&s| s != d) {
                let part = send[s][d * blocks..(d + 1) * blocks].to_vec();
                recv[d][s * blocks..(s + 1) * blocks].copy_from_slice(&part);
            }
        }
    }

    // Where a rank finds the rows and count of source s (`Sources` in moe_dispatch.cu).
    let row_base = |s: usize| -> usize {
        match net {
            Net::Nvlink => sym.rows + s * t * stride,
            Net::Nccl => s * blocks + NCCL_HEADER,
        }
    };
    let count = |bufs: (&Vec<u8>, &Vec<u8>, &Vec<u8>), r: usize, s: usize| -> i32 {
        let (symm_r, send_r, recv_r) = bufs;
        match net {
            Net::Nvlink => get_i32(symm_r, sym.counts + 4 * s),
            Net::Nccl => get_i32(if s == r { send_r } else { recv_r }, s * blocks),
        }
    };

    // moe_dispatch_recv: one item per received row (s, j), k in order; counts by the last block.
    let mut outs = Vec::with_capacity(w);
    let mut fans = Vec::with_capacity(w);
    for r in 0..w {
        let rows_buf = |s: usize| -> &Vec<u8> {
            match net {
                Net::Nvlink => &symm[r],
                Net::Nccl if s == r => &send[r],
                Net::Nccl => &recv[r],
            }
        };
        let mut ecnt = vec![0i32; l];
        let mut fan = vec![-1i32; w * t * k];
        let mut o = RankOut {
            counts: vec![0; l],
            expert_x: vec![0.0; l * c * h],
            routing: vec![0; l * c * 2],
            out: vec![0.0; t * f],
            overflow: false,
            received: vec![0; w],
        };
        for item in 0..w * t {
            let (s, j) = (item / t, item % t);
            let n = count((&symm[r], &send[r], &recv[r]), r, s).clamp(0, t as i32) as usize;
            o.received[s] = n;
            if j >= n {
                continue;
            }
            let buf = rows_buf(s);
            let at = row_base(s) + j * stride;
            let token = get_i32(buf, at + lay.meta_off);
            for kk in 0..k {
                let e = get_i32(buf, at + lay.idx_off() + 4 * kk);
                if !(valid(e) && e as usize / l == r) {
                    continue;
                }
                let le = e as usize - r * l;
                let slot = ecnt[le] as usize;
                ecnt[le] += 1;
                if slot >= c {
                    o.overflow = true;
                    continue;
                }
                let row = le * c + slot;
                let v = read_wire_row(shape, wire, &lay, buf, at);
                o.expert_x[row * h..(row + 1) * h].copy_from_slice(&v);
                o.routing[row * 2] = (s * t) as i32 + token;
                o.routing[row * 2 + 1] = kk as i32;
                fan[item * k + kk] = row as i32;
            }
        }
        for (cnt, e) in o.counts.iter_mut().zip(&ecnt) {
            *cnt = (*e).min(c as i32);
        }
        outs.push(o);
        fans.push(fan);
    }

    // The experts: y rows from the kept expert_x rows (padding never read).
    let ys: Vec<Vec<f32>> = (0..w)
        .map(|r| {
            let o = &outs[r];
            let mut y = vec![f32::NAN; l * c * f];
            for le in 0..l {
                for j in 0..o.counts[le] as usize {
                    let row = &o.expert_x[(le * c + j) * h..(le * c + j + 1) * h];
                    y[(le * c + j) * f..(le * c + j + 1) * f]
                        .copy_from_slice(&expert(r * l + le, row));
                }
            }
            y
        })
        .collect();

    // Late weights: moe_nvl_weights_send / the NCCL weight exchange.
    let mut w_recv = vec![vec![0.0f32; w * t * k]; w];
    if !early {
        for d in 0..w {
            for s in 0..w {
                for q in 0..t * k {
                    match net {
                        Net::Nvlink => {
                            let at = sym.weights + (s * t * k + q) * 4;
                            symm[d][at..at + 4].copy_from_slice(&inp.w[s][q].to_le_bytes());
                        }
                        Net::Nccl if s != d => w_recv[d][s * t * k + q] = inp.w[s][q],
                        Net::Nccl => {}
                    }
                }
            }
        }
    }

    // moe_{nccl,nvl}_combine_send: one item per received row (s, j).
    let mut comb_send = vec![vec![0u8; w * t * rb]; w];
    for r in 0..w {
        for item in 0..w * t {
            let (s, j) = (item / t, item % t);
            let n = count((&symm[r], &send[r], &recv[r]), r, s).clamp(0, t as i32) as usize;
            if j >= n {
                continue;
            }
            let buf = match net {
                Net::Nvlink => &symm[r],
                Net::Nccl if s == r => &send[r],
                Net::Nccl => &recv[r],
            };
            let at = row_base(s) + j * stride;
            let tt = get_i32(buf, at + lay.meta_off) as usize;
            let weight = |kk: usize| -> f32 {
                if early {
                    get_f32(buf, at + lay.weights_off(k) + 4 * kk)
                } else {
                    match net {
                        Net::Nvlink => get_f32(&symm[r], sym.weights + ((s * t + tt) * k + kk) * 4),
                        Net::Nccl if s == r => inp.w[r][tt * k + kk],
                        Net::Nccl => w_recv[r][(s * t + tt) * k + kk],
                    }
                }
            };
            let mut acc = vec![0.0f32; f];
            for kk in 0..k {
                let fr = fans[r][item * k + kk];
                if fr < 0 {
                    continue;
                }
                let wk = weight(kk);
                for (col, a) in acc.iter_mut().enumerate() {
                    *a += wk * ys[r][fr as usize * f + col];
                }
            }
            let mut partial = vec![0u8; rb];
            for (col, a) in acc.iter().enumerate() {
                put(
                    shape.dtype,
                    &mut partial,
                    col * shape.dtype.size_bytes(),
                    *a,
                );
            }
            match net {
                Net::Nvlink => {
                    let at = sym.partials + (r * t + j) * rb;
                    symm[s][at..at + rb].copy_from_slice(&partial);
                }
                Net::Nccl => comb_send[r][(s * t + j) * rb..][..rb].copy_from_slice(&partial),
            }
        }
    }
    let mut comb_recv = vec![vec![0u8; w * t * rb]; w];
    if net == Net::Nccl {
        for s in 0..w {
            for r in (0..w).filter(|&r| r != s) {
                let part = comb_send[r][s * t * rb..(s + 1) * t * rb].to_vec();
                comb_recv[s][r * t * rb..(r + 1) * t * rb].copy_from_slice(&part);
            }
        }
    }

    // moe_combine_recv: out[t] = Σ_r partial at (r * T + sent_pos[t, r]).
    for (s, o) in outs.iter_mut().enumerate() {
        for tt in 0..t {
            for col in 0..f {
                let mut acc = 0.0f32;
                for r in 0..w {
                    let p = sent_pos[s][tt * w + r];
                    if p < 0 {
                        continue;
                    }
                    let at = (r * t + p as usize) * rb + col * shape.dtype.size_bytes();
                    acc += match net {
                        Net::Nvlink => get(shape.dtype, &symm[s], sym.partials + at),
                        Net::Nccl if r == s => get(shape.dtype, &comb_send[s], at),
                        Net::Nccl => get(shape.dtype, &comb_recv[s], at),
                    };
                }
                o.out[tt * f + col] = round_to(shape.dtype, acc);
            }
        }
    }
    outs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::Fp8Scales;
    use crate::moe::{reference_combine, reference_dispatch, MoeTraffic};

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn expert_fn(shape: &MoeShape, e: usize, x: &[f32]) -> Vec<f32> {
        let scale = 0.5 + (e % 13) as f32 / 8.0;
        (0..shape.out_hidden)
            .map(|i| round_to(shape.dtype, x[i % shape.hidden] * scale))
            .collect()
    }

    /// Random inputs: distinct experts per token (or one rank's tokens all to the last rank's
    /// experts when `skew`), and a bad id when `bad`.
    fn inputs(shape: &MoeShape, rng: &mut Rng, skew: bool, bad: bool) -> Inputs {
        let (t, k, e, h) = (shape.tokens, shape.top_k, shape.experts, shape.hidden);
        let l = shape.local_experts();
        let mut inp = Inputs {
            x: Vec::new(),
            idx: Vec::new(),
            w: Vec::new(),
        };
        for r in 0..shape.world {
            inp.x.push(
                (0..t * h)
                    .map(|_| round_to(shape.dtype, rng.unit() * 4.0 - 2.0))
                    .collect(),
            );
            inp.w.push((0..t * k).map(|_| 0.05 + rng.unit()).collect());
            let (lo, n) = if skew && r == 0 && shape.world > 1 {
                ((shape.world - 1) * l, l)
            } else {
                (0, e)
            };
            let mut idx = Vec::with_capacity(t * k);
            for _ in 0..t {
                let start = idx.len();
                while idx.len() - start < k {
                    let ex = (lo + rng.below(n)) as i32;
                    if !idx[start..].contains(&ex) {
                        idx.push(ex);
                    }
                }
            }
            if bad && !idx.is_empty() {
                let at = rng.below(idx.len());
                idx[at] = (e + 3) as i32;
            }
            inp.idx.push(idx);
        }
        inp
    }

    /// One model configuration: the shape, the wire, skewed routing, a bad id, and the
    /// capacity as the largest expert load divided by `cap_div`.
    struct Case {
        world: usize,
        experts: usize,
        top_k: usize,
        tokens: usize,
        hidden: usize,
        out_hidden: usize,
        dtype: DType,
        wire: MoeWire,
        skew: bool,
        bad: bool,
        cap_div: usize,
    }

    #[test]
    fn model_of_both_transports_matches_the_reference_bit_for_bit() {
        let mut rng = Rng(0x5EED_1234);
        let cases = [
            Case {
                world: 1,
                experts: 4,
                top_k: 2,
                tokens: 5,
                hidden: 16,
                out_hidden: 16,
                dtype: DType::F32,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 1,
            },
            Case {
                world: 2,
                experts: 2,
                top_k: 1,
                tokens: 6,
                hidden: 16,
                out_hidden: 8,
                dtype: DType::BF16,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 1,
            },
            Case {
                world: 2,
                experts: 8,
                top_k: 8,
                tokens: 4,
                hidden: 32,
                out_hidden: 32,
                dtype: DType::BF16,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 1,
            },
            Case {
                world: 3,
                experts: 6,
                top_k: 2,
                tokens: 5,
                hidden: 16,
                out_hidden: 16,
                dtype: DType::F16,
                wire: MoeWire::Native,
                skew: true,
                bad: true,
                cap_div: 1,
            },
            Case {
                world: 4,
                experts: 16,
                top_k: 4,
                tokens: 3,
                hidden: 128,
                out_hidden: 64,
                dtype: DType::BF16,
                wire: MoeWire::Fp8E4m3(Fp8Scales::Block128),
                skew: true,
                bad: false,
                cap_div: 1,
            },
            Case {
                world: 4,
                experts: 8,
                top_k: 2,
                tokens: 4,
                hidden: 48,
                out_hidden: 48,
                dtype: DType::F32,
                wire: MoeWire::Fp8E4m3(Fp8Scales::PerToken),
                skew: false,
                bad: true,
                cap_div: 1,
            },
            Case {
                world: 8,
                experts: 16,
                top_k: 8,
                tokens: 2,
                hidden: 16,
                out_hidden: 16,
                dtype: DType::BF16,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 1,
            },
            Case {
                world: 2,
                experts: 4,
                top_k: 2,
                tokens: 8,
                hidden: 16,
                out_hidden: 16,
                dtype: DType::BF16,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 2,
            },
            Case {
                world: 2,
                experts: 4,
                top_k: 3,
                tokens: 0,
                hidden: 16,
                out_hidden: 16,
                dtype: DType::BF16,
                wire: MoeWire::Native,
                skew: false,
                bad: false,
                cap_div: 1,
            },
        ];
        for Case {
            world: w,
            experts: e,
            top_k: k,
            tokens: t,
            hidden: h,
            out_hidden: f,
            dtype,
            wire,
            skew,
            bad,
            cap_div: div,
        } in cases
        {
            let mut shape = MoeShape {
                world: w,
                experts: e,
                top_k: k,
                tokens: t,
                hidden: h,
                out_hidden: f,
                capacity: 1,
                dtype,
            };
            let inp = inputs(&shape, &mut rng, skew, bad);
            let mut per = vec![0usize; e];
            for &x in inp.idx.iter().flatten() {
                if (x as usize) < e {
                    per[x as usize] += 1;
                }
            }
            shape.capacity = (per.into_iter().max().unwrap_or(0) / div).max(1);
            let traffic = MoeTraffic::from_routing(&shape, wire, &inp.idx).unwrap();
            for net in [Net::Nccl, Net::Nvlink] {
                for early in [true, false] {
                    let label = format!("{shape:?} {wire:?} {net:?} early={early}");
                    let got = run(&shape, wire, net, &inp, early, |e, x| {
                        expert_fn(&shape, e, x)
                    });
                    for (r, o) in got.iter().enumerate() {
                        let want = reference_dispatch(&shape, wire, r, &inp.x, &inp.idx).unwrap();
                        assert_eq!(o.counts, want.counts, "{label} rank {r}");
                        assert_eq!(o.routing, want.routing, "{label} rank {r}");
                        assert_eq!(o.overflow, want.overflow, "{label} rank {r}");
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&o.expert_x), bits(&want.expert_x), "{label} rank {r}");
                        let received: Vec<usize> = (0..w).map(|s| traffic.rows[s][r]).collect();
                        assert_eq!(o.received, received, "{label} rank {r}");
                    }
                    // The kept rows of every rank, by (team-global token, k).
                    let kept: std::collections::HashSet<(i32, i32)> = (0..w)
                        .flat_map(|r| {
                            reference_dispatch(&shape, wire, r, &inp.x, &inp.idx)
                                .unwrap()
                                .rows
                                .into_iter()
                                .flatten()
                        })
                        .collect();
                    for (s, o) in got.iter().enumerate() {
                        let want = reference_combine(&shape, &inp.idx[s], &inp.w[s], |tt, kk| {
                            let ex = inp.idx[s][tt * k + kk];
                            let g = (s * t + tt) as i32;
                            kept.contains(&(g, kk as i32)).then(|| {
                                let row = wire
                                    .arrived_row(&shape, &inp.x[s][tt * h..(tt + 1) * h])
                                    .unwrap();
                                expert_fn(&shape, ex as usize, &row)
                            })
                        })
                        .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&o.out), bits(&want), "{label} rank {s} combine");
                    }
                }
            }
        }
    }
}
