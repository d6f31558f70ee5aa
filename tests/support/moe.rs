//! MoE layer host programs whose dispatch outputs are poisoned before the dispatch, their
//! per-rank inputs with chosen routing, and the expert rows as per-expert multisets: shared by
//! the sim-rank tests (`tests/runtime/moe.rs`, `tests/runtime/moe_weights.rs`) and the GPU
//! tests (`tests/gpu/moe_outputs.rs`, `tests/gpu/moe_weights.rs`),
//! which compare the GPU transports (writing the outputs in place, padding unspecified) with
//! the CPU backend.

use std::collections::BTreeMap;

use meshflow::ir::{DType, DeviceId, HostProgram};
use meshflow::runtime::data::TensorData;

use super::runtime::{host, iota};

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Route {
    /// `k` distinct uniform experts per token.
    Uniform,
    /// Rank 0 routes only to the last rank's experts; nobody routes to rank 1's experts (so
    /// rank 1 receives nothing) when there are enough other experts.
    Ragged,
}

/// Team-global expert ids, `k` distinct per token, tokens of rank 0 first (`[d * t, k]`).
pub fn routing_ids(d: i64, t: i64, e: i64, k: i64, route: Route, rng: &mut u64) -> Vec<i64> {
    let mut next = |n: i64| {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        (*rng % n as u64) as i64
    };
    let experts = e * d;
    let mut ids = Vec::new();
    for r in 0..d {
        let allowed: Vec<i64> = match route {
            Route::Ragged if r == 0 && k <= e => ((d - 1) * e..d * e).collect(),
            Route::Ragged if d >= 3 && experts - e >= k => {
                (0..experts).filter(|x| x / e != 1).collect()
            }
            _ => (0..experts).collect(),
        };
        for _ in 0..t {
            let start = ids.len();
            while (ids.len() - start) < k as usize {
                let x = allowed[next(allowed.len() as i64) as usize];
                if !ids[start..].contains(&x) {
                    ids.push(x);
                }
            }
        }
    }
    ids
}

/// One MoE layer whose dispatch outputs are poisoned (NaN / `INT_POISON`, copied from inputs)
/// before the dispatch writes them.
#[derive(Clone, Copy, Debug)]
pub struct PoisonedMoe {
    /// Ranks.
    pub d: i64,
    /// Tokens per rank.
    pub t: i64,
    /// Experts per rank.
    pub e: i64,
    pub k: i64,
    pub h: i64,
    pub f: i64,
    pub dtype: DType,
    /// The dispatch's wire attributes (`""`, or e.g. `", wire=f8e4m3, scale=token"`).
    pub wire: &'static str,
    /// `expert_x` is the second half (along `H`) of an output `ex_out[e, C, 2H]`: a strided
    /// view (else it is the output itself).
    pub strided: bool,
}

impl PoisonedMoe {
    /// The packed bf16 layer of the sim-rank tests on `d` ranks: 5 tokens per rank, 8 experts
    /// over the team (rounded up to whole experts per rank), top-`k`, width `h` -> 16, the
    /// dispatch's `wire` attributes.
    pub fn on_sim_ranks(d: i64, k: i64, h: i64, wire: &'static str) -> PoisonedMoe {
        PoisonedMoe {
            d,
            t: 5,
            e: (8 + d - 1) / d,
            k,
            h,
            f: 16,
            dtype: DType::BF16,
            wire,
            strided: false,
        }
    }

    /// The packed bf16 layer of the GPU tests on `d` GPUs: 6 tokens per rank, 8 experts over
    /// the team, top-`k`, width `h` -> 32, the dispatch's `wire` attributes.
    pub fn on_gpus(d: usize, k: i64, h: i64, wire: &'static str) -> PoisonedMoe {
        PoisonedMoe {
            d: d as i64,
            t: 6,
            e: 8 / d as i64,
            k,
            h,
            f: 32,
            dtype: DType::BF16,
            wire,
            strided: false,
        }
    }

    /// Routing ids of this layer (see [`routing_ids`]), drawn from a generator seeded by
    /// `seed`.
    pub fn routing_ids(&self, route: Route, seed: u64) -> Vec<i64> {
        let mut rng = seed | 1;
        routing_ids(self.d, self.t, self.e, self.k, route, &mut rng)
    }

    /// The capacity: every token of the team fits in one expert.
    pub fn cap(&self) -> i64 {
        self.t * self.d
    }

    /// Width of the `expert_x` output (`2H` when strided).
    fn width(&self) -> i64 {
        if self.strided {
            2 * self.h
        } else {
            self.h
        }
    }

    /// The host program.
    pub fn host(&self) -> HostProgram {
        let (view_decl, view) = if self.strided {
            (
                "  tensor expert_x: $DT[$e, $cap, $h] on m0\n",
                "  expert_x = shard_by_stream(ex_out, axis=2, chunks=2, index=1)\n",
            )
        } else {
            ("", "")
        };
        let ex = if self.strided { "expert_x" } else { "ex_out" };
        let tpl = format!(
            "
host moe_outputs {{
  mesh m0 = $MESH
  in x: $DT[$t, $h] on m0
  in topk_idx: i32[$t, $k] on m0
  in topk_weights: f32[$t, $k] on m0
  in w_experts: $DT[$e, $h, $f] on m0
  in ex_poison: $DT[$e, $cap, $w] on m0
  in counts_poison: i32[$e] on m0
  in routing_poison: i32[$e, $cap, 2] on m0
  out y: $DT[$t, $f] on m0
  out ex_out: $DT[$e, $cap, $w] on m0
  out expert_counts: i32[$e] on m0
  out routing: i32[$e, $cap, 2] on m0
{view_decl}  tensor expert_y: $DT[$e, $cap, $f] on m0
  copy(ex_poison -> ex_out)
  copy(counts_poison -> expert_counts)
  copy(routing_poison -> routing)
{view}  c0 = moe_dispatch(x, topk_idx -> {ex}, expert_counts, routing, team=slice(m0, DIDx)$WIRE)
  wait c0
  allocate expert_y
  grouped_matmul({ex}, expert_counts, w_experts -> expert_y)
  c1 = moe_combine(expert_y, expert_counts, routing, topk_weights -> y, team=slice(m0, DIDx))
  wait c1
  deallocate expert_y
}}
"
        )
        .replace("$MESH", &iota(self.d))
        .replace("$DT", self.dtype.name())
        .replace("$WIRE", self.wire);
        host(
            &tpl,
            &[
                ("t", self.t),
                ("e", self.e),
                ("k", self.k),
                ("h", self.h),
                ("f", self.f),
                ("cap", self.cap()),
                ("w", self.width()),
            ],
        )
    }

    /// Per-rank inputs: random tokens, weights and experts (seeded), the routing `ids` (of
    /// [`routing_ids`]), poison for the outputs.
    pub fn inputs(
        &self,
        ids: &[i64],
        seed: u64,
    ) -> BTreeMap<DeviceId, BTreeMap<String, TensorData>> {
        let (t, k, e, h, f, cap) = (
            self.t as u64,
            self.k as u64,
            self.e as u64,
            self.h as u64,
            self.f as u64,
            self.cap() as u64,
        );
        let dt = self.dtype;
        (0..self.d as usize)
            .map(|r| {
                let s = seed.wrapping_add(r as u64 * 0x9E37_79B9);
                let mine = &ids[r * (t * k) as usize..(r + 1) * (t * k) as usize];
                // Positive weights, small enough to keep sums in range.
                let w: Vec<f32> = (0..t * k).map(|i| 0.25 + (i % 7) as f32 / 8.0).collect();
                let m = BTreeMap::from([
                    ("x".into(), TensorData::random(dt, &[t, h], s).unwrap()),
                    (
                        "topk_idx".into(),
                        TensorData::from_i64(DType::I32, &[t, k], mine).unwrap(),
                    ),
                    (
                        "topk_weights".into(),
                        TensorData::from_f32(DType::F32, &[t, k], &w).unwrap(),
                    ),
                    (
                        "w_experts".into(),
                        TensorData::random(dt, &[e, h, f], s ^ 0x55).unwrap(),
                    ),
                    (
                        "ex_poison".into(),
                        TensorData::poison(dt, &[e, cap, self.width() as u64]).unwrap(),
                    ),
                    (
                        "counts_poison".into(),
                        TensorData::poison(DType::I32, &[e]).unwrap(),
                    ),
                    (
                        "routing_poison".into(),
                        TensorData::poison(DType::I32, &[e, cap, 2]).unwrap(),
                    ),
                ]);
                (r, m)
            })
            .collect()
    }

    /// One rank's expert rows: per local expert, the sorted `(token, k, row bits)` of its
    /// valid rows (padding is not looked at: GPUs leave it unspecified).
    pub fn expert_rows(
        &self,
        out: &BTreeMap<String, TensorData>,
    ) -> Vec<Vec<(i64, i64, Vec<u64>)>> {
        let (ex, counts, routing) = (&out["ex_out"], &out["expert_counts"], &out["routing"]);
        let (c, h, w) = (self.cap() as usize, self.h as usize, self.width() as usize);
        let first = w - h;
        (0..self.e as usize)
            .map(|x| {
                let n = counts.storage().get_i64(x).unwrap();
                assert!(
                    (0..=c as i64).contains(&n),
                    "expert {x}: count {n} outside 0..={c}"
                );
                let mut rows: Vec<(i64, i64, Vec<u64>)> = (0..n as usize)
                    .map(|j| {
                        let r = (x * c + j) * 2;
                        let row = (0..h)
                            .map(|q| ex.storage().bits((x * c + j) * w + first + q).unwrap())
                            .collect();
                        (
                            routing.storage().get_i64(r).unwrap(),
                            routing.storage().get_i64(r + 1).unwrap(),
                            row,
                        )
                    })
                    .collect();
                rows.sort();
                rows
            })
            .collect()
    }
}

/// `host` (an MoE layer whose combine reads the input `topk_weights`) with the combine's
/// weights computed inside the program after the dispatch instead: `w_late`, a copy of
/// `topk_weights` made between the dispatch and the combine. The values are the same, but
/// they cannot travel with the dispatch (the evaluator gives them to the combine), so the two
/// programs compare the two ways of moving the weights.
pub fn with_late_weights(host: &HostProgram) -> HostProgram {
    let text = host.to_string();
    let mut out = String::new();
    let mut combines = 0;
    for line in text.lines() {
        if line.trim() == "}" {
            out.push_str("  deallocate w_late\n");
        }
        if line.contains("= moe_combine(") {
            combines += 1;
            out.push_str(&line.replace(", topk_weights ->", ", w_late ->"));
        } else {
            out.push_str(line);
        }
        out.push('\n');
        if let Some(decl) = line.trim().strip_prefix("in topk_weights:") {
            out.push_str(&format!("  tensor w_late:{decl}\n"));
        }
        if line.contains("= moe_dispatch(") {
            out.push_str("  allocate w_late\n  copy(topk_weights -> w_late)\n");
        }
    }
    assert_eq!(combines, 1, "one moe_combine expected in\n{text}");
    meshflow::ir::parse_host(&out).unwrap_or_else(|e| panic!("{e}\n{out}"))
}
