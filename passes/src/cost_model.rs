//! The cost model of `choose_decompositions`: predicted times of the [`Plan`]s of one
//! resharding, from a machine [`Profile`]. The formulas, with their derivation from the
//! measurements, are in `docs/schedule-search.md`; in short, per rank, for a team of `d`:
//!
//! | case | plan | time |
//! |---|---|---|
//! | all-gather + consumer | collective | `AG + G` |
//! | | broadcast, per iteration | `cp + c + (d-1)·ov(c, b, κ₁) + d·λ` |
//! | | ring, per iteration | `W(cp, m, …, m; c; κ₁, ω) + d·λ` (simulated) |
//! | | ring prefetch, ring forward | `c + (d-1)·ov(c, m, κ₂) + d·λ` |
//! | | ring bidirectional | `c + (d-1)·ov(2h, 2m½, κ₂) + 2d·λ` |
//! | producer + reduce-scatter | collective | `G + RS` |
//! | | reduce, per iteration | `W(c then r, each iteration; κ₁, ω) + d·λ` (simulated) |
//! | | ring forward, `p` pieces | `c + (d-1)·(ov(p·g, m, κ₂) + a + (p-1)·(σ·a + ℓ)) + d·λ` |
//! | | ring forward accumulating in place, `p` pieces | `T + κ₂·(M − (T − Σg)) + d·λ` (simulated) |
//!
//! `G` is the whole compute op, `c` one chunk of it, `h` half a chunk, `g` one piece; `m`, `b`,
//! `r`, `AG`, `RS` the transport's curves at the bytes one rank moves (`m½`: half a chunk); `cp`
//! a local copy of a chunk and `a` an add of one piece (memory bound); `λ` the loop-step and `ℓ`
//! the launch overhead; `ov(c, m, κ) = max(c + κ·m, m)` a GEMM of `c` beside a transfer of `m`
//! that slows it by `κ` of the transfer's time, `κ₁` when the GEMM was launched first (one
//! worker stream per iteration), `κ₂` when the transfer was (prefetch, neighbour rings); `σ` the
//! slowdown of a GEMM by an add beside it. Consumers that cannot join the stream loop overlap
//! nothing: the transfers and `G` add up. The ring that accumulates in place has no add; its
//! pieces' GEMMs and transfers are simulated in the order the lowering emits them: `T` is
//! when the last GEMM ends, `Σg` the time of all GEMMs, `M` that of all transfers (`m` of
//! `1/p` of a chunk, each), of which what did not run while the main stream waited ran beside
//! a GEMM. `W` simulates a per-iteration schedule over the pool of workers (`per_iteration_us`):
//! iteration `i` on worker `i mod P`, a GEMM waiting on another worker starting `ω·c` before the
//! running one ends (it fills its tail; `ω` the profile's `gemm_overlap`).

use meshflow_ir::DType;

use crate::options::{Decomposition, StreamSchedule};
use crate::plan::Plan;
use crate::profile::{Collective, Profile};

pub use crate::transport::Transport;

/// The profile and the search's constraints.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// The machine.
    pub profile: Profile,
    /// Forces the transport of every plan (`None`: the search picks the transport of least
    /// predicted total time).
    pub transport: Option<Transport>,
}

impl Default for CostModel {
    fn default() -> CostModel {
        CostModel {
            profile: Profile::default_builtin(),
            transport: None,
        }
    }
}

/// The work of one compute op on one device.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Work {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written.
    pub bytes: f64,
    /// Element type.
    pub dtype: DType,
    /// `[m, n, k]` when the op is a GEMM (`m` is the dimension the stream loop cuts).
    pub gemm: Option<[u64; 3]>,
}

impl Work {
    /// No work.
    pub fn none(dtype: DType) -> Work {
        Work {
            flops: 0.0,
            bytes: 0.0,
            dtype,
            gemm: None,
        }
    }

    /// One of `s` equal parts (a GEMM cut along `m`).
    pub fn part(&self, s: u64) -> Work {
        let s = s.max(1);
        Work {
            flops: self.flops / s as f64,
            bytes: self.bytes / s as f64,
            dtype: self.dtype,
            gemm: self.gemm.map(|[m, n, k]| [(m / s).max(1), n, k]),
        }
    }
}

/// An all-gather feeding a compute op.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GatherCase {
    /// Team size `d`.
    pub team: u64,
    /// Bytes of one chunk (one member's shard).
    pub chunk_bytes: f64,
    /// The consumer's work on the whole gathered tensor (none when it has no compute consumer).
    pub consumer: Work,
    /// True when the consumer can join the stream loop (chunk by chunk, overlapped).
    pub overlappable: bool,
    /// Worker streams of the pool the per-iteration schedule spreads its iterations over
    /// ([`PassOptions::num_streams`](crate::PassOptions::num_streams)).
    pub workers: u64,
}

/// A compute op producing partial sums that are reduce-scattered.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ReduceCase {
    /// Team size `d`.
    pub team: u64,
    /// Bytes of one chunk (one member's share of the result).
    pub chunk_bytes: f64,
    /// The producer's work (the whole local partial product).
    pub producer: Work,
    /// Worker streams of the pool the per-iteration schedule spreads its iterations over
    /// ([`PassOptions::num_streams`](crate::PassOptions::num_streams)).
    pub workers: u64,
}

/// What a plan is priced for.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Case {
    /// An all-gather and its consumer.
    Gather(GatherCase),
    /// A producer of partial sums and their reduce-scatter.
    Reduce(ReduceCase),
}

impl Case {
    /// The team size.
    pub fn team(&self) -> u64 {
        match self {
            Case::Gather(g) => g.team,
            Case::Reduce(r) => r.team,
        }
    }
}

/// A GEMM of `c` µs beside a transfer of `m` µs that slows it by `kappa` of the transfer's time.
fn overlapped(c: f64, m: f64, kappa: f64) -> f64 {
    (c + kappa * m).max(m)
}

impl CostModel {
    /// A model over `profile`, free to pick the transport.
    pub fn new(profile: Profile) -> CostModel {
        CostModel {
            profile,
            transport: None,
        }
    }

    /// The transports the search tries: the forced one, or the profile's, NCCL first (it also
    /// works across processes, so it wins ties).
    pub fn transports(&self) -> Vec<Transport> {
        if let Some(t) = self.transport {
            return vec![t];
        }
        let mut ts = self.profile.transports();
        ts.sort_by_key(|&t| t != Transport::Nccl);
        ts
    }

    /// Time of `w`, µs.
    pub fn compute_us(&self, w: &Work) -> f64 {
        let p = &self.profile;
        let half = matches!(w.dtype, DType::BF16 | DType::F16);
        let tflops = match (half, w.gemm) {
            (true, Some([m, n, k])) => p.half_tflops(m, n, k),
            _ => None,
        }
        .unwrap_or(p.gemm.tflops_f32);
        let flop_us = w.flops / (tflops * 1e6);
        let mem_us = w.bytes / (p.memory.hbm_gb_s * 1e3);
        p.host.launch_us + flop_us.max(mem_us)
    }

    /// A local copy of `bytes`, µs.
    pub fn copy_us(&self, bytes: f64) -> f64 {
        let p = &self.profile;
        p.host.launch_us + 2.0 * bytes / (p.memory.hbm_gb_s * 1e3)
    }

    /// An element-wise add writing `bytes`, µs.
    pub fn add_us(&self, bytes: f64) -> f64 {
        let p = &self.profile;
        p.host.launch_us + 3.0 * bytes / (p.memory.hbm_gb_s * 1e3)
    }

    /// Collective `c` of `bytes` on the wire over `t`, and the slowdowns of a GEMM beside it
    /// (gemm first, transfer first; those of the transport that actually moves it).
    fn comm(&self, t: Transport, c: Collective, bytes: f64) -> (f64, f64, f64) {
        let p = &self.profile;
        let s = p.slowdown(p.mover(t, c));
        (p.comm_us(t, c, bytes), s.gemm_first, s.transfer_first)
    }

    /// The predicted time of `plan` for `case`, µs; `None` when the plan does not apply to the
    /// case (see `docs/schedule-search.md` for the formulas).
    pub fn cost(&self, case: &Case, plan: &Plan) -> Option<f64> {
        let step = self.profile.host.loop_step_us;
        let launch = self.profile.host.launch_us;
        let t = plan.transport;
        match case {
            Case::Gather(g) => {
                let d = g.team.max(1);
                let df = d as f64;
                let whole = self.compute_us(&g.consumer);
                let c = self.compute_us(&g.consumer.part(d));
                let cp = self.copy_us(g.chunk_bytes);
                let (m, k1, k2) = self.comm(t, Collective::Permute, g.chunk_bytes);
                Some(match (plan.decomposition, plan.schedule) {
                    (Decomposition::Collective, _) => {
                        self.comm(t, Collective::AllGather, g.chunk_bytes * (df - 1.0))
                            .0
                            + whole
                    }
                    (Decomposition::StreamBroadcast, StreamSchedule::PerIteration) => {
                        let (b, k1, _) = self.comm(t, Collective::Broadcast, g.chunk_bytes);
                        if g.overlappable {
                            cp + c + (df - 1.0) * overlapped(c, b, k1) + df * step
                        } else {
                            df * b + whole + df * step
                        }
                    }
                    (Decomposition::Ring, StreamSchedule::PerIteration) if g.overlappable => {
                        let w = self
                            .profile
                            .gemm_overlap(self.profile.mover(t, Collective::Permute));
                        let iterations: Vec<Iteration> = (0..d)
                            .map(|i| Iteration {
                                before: if i == 0 {
                                    Before::Copy(cp)
                                } else {
                                    Before::Transfer(m)
                                },
                                gemm: c,
                                after: 0.0,
                            })
                            .collect();
                        per_iteration_us(&iterations, g.workers, k1, w) + df * step
                    }
                    (Decomposition::Ring | Decomposition::RingForward, _) if g.overlappable => {
                        c + (df - 1.0) * overlapped(c, m, k2) + df * step
                    }
                    (Decomposition::Ring | Decomposition::RingForward, _) => {
                        cp + (df - 1.0) * m + whole + df * step
                    }
                    (Decomposition::RingBidirectional, _) => {
                        let half = self.comm(t, Collective::Permute, g.chunk_bytes / 2.0).0;
                        let h = self.compute_us(&g.consumer.part(2 * d));
                        if g.overlappable {
                            c + (df - 1.0) * overlapped(2.0 * h, 2.0 * half, k2) + 2.0 * df * step
                        } else {
                            cp + (df - 1.0) * 2.0 * half + whole + 2.0 * df * step
                        }
                    }
                    _ => return None,
                })
            }
            Case::Reduce(r) => {
                let d = r.team.max(1);
                let df = d as f64;
                let whole = self.compute_us(&r.producer);
                let c = self.compute_us(&r.producer.part(d));
                Some(match (plan.decomposition, plan.schedule) {
                    (Decomposition::Collective, _) => {
                        whole
                            + self
                                .comm(t, Collective::ReduceScatter, r.chunk_bytes * (df - 1.0))
                                .0
                    }
                    (Decomposition::StreamReduce, StreamSchedule::PerIteration) => {
                        let (red, k1, _) = self.comm(t, Collective::Reduce, r.chunk_bytes);
                        let w = self
                            .profile
                            .gemm_overlap(self.profile.mover(t, Collective::Reduce));
                        let iterations = vec![
                            Iteration {
                                before: Before::Nothing,
                                gemm: c,
                                after: red,
                            };
                            d as usize
                        ];
                        per_iteration_us(&iterations, r.workers, k1, w) + df * step
                    }
                    (Decomposition::RingForward, StreamSchedule::Prefetch) if plan.accumulate => {
                        self.accumulating_ring_us(r, t, plan.pieces.max(1))
                    }
                    (Decomposition::RingForward, StreamSchedule::Prefetch) => {
                        let (m, _, k2) = self.comm(t, Collective::Permute, r.chunk_bytes);
                        let p = plan.pieces.max(1);
                        let a = self.add_us(r.chunk_bytes / p as f64);
                        let per_step = if p == 1 {
                            overlapped(c, m, k2) + a
                        } else {
                            let g = self.compute_us(&r.producer.part(d * p));
                            let sigma = self.profile.memory.concurrent_add_slowdown;
                            overlapped(p as f64 * g, m, k2)
                                + a
                                + (p as f64 - 1.0) * (sigma * a + launch)
                        };
                        c + (df - 1.0) * per_step + df * step
                    }
                    _ => return None,
                })
            }
        }
    }
}

/// What an iteration of a per-iteration stream loop does before its GEMM.
#[derive(Copy, Clone, Debug)]
enum Before {
    /// Nothing.
    Nothing,
    /// A local copy of this many µs (the ring's own chunk): no link, no slowdown.
    Copy(f64),
    /// A transfer of this many µs over the link.
    Transfer(f64),
}

/// One iteration of a per-iteration stream loop: what moves before its GEMM, the GEMM (µs),
/// and a transfer after it (µs, 0 for none).
#[derive(Copy, Clone, Debug)]
struct Iteration {
    before: Before,
    gemm: f64,
    after: f64,
}

/// The per-iteration schedule (`assign_streams`) of `iterations`, simulated: iteration `i`
/// runs on worker `i mod workers`, after that worker's previous iteration (all start
/// together); transfers take the link one at a time; GEMMs run one at a time, except that a
/// GEMM already waiting on another worker starts `overlap` of the running GEMM's time before
/// it ends (it fills the running one's tail); a GEMM loses `kappa` of the time of the
/// transfers that run beside it (three passes, each charging the overlaps of the last).
/// Returns when the last GEMM or transfer ends, µs.
fn per_iteration_us(iterations: &[Iteration], workers: u64, kappa: f64, overlap: f64) -> f64 {
    let workers = workers.max(1) as usize;
    let mut extra = vec![0.0f64; iterations.len()];
    let mut end = 0.0f64;
    for _ in 0..3 {
        let mut free = vec![0.0f64; workers];
        let mut link = 0.0f64;
        // (start, end) of every GEMM and every transfer.
        let mut gemms: Vec<(f64, f64)> = Vec::with_capacity(iterations.len());
        let mut transfers: Vec<(f64, f64)> = Vec::new();
        // When the last GEMM ends, its time, and its worker.
        let mut last: Option<(f64, f64, usize)> = None;
        for (i, it) in iterations.iter().enumerate() {
            let w = i % workers;
            let mut ready = free[w];
            match it.before {
                Before::Nothing => {}
                Before::Copy(us) => ready += us,
                Before::Transfer(us) => {
                    let start = ready.max(link);
                    link = start + us;
                    transfers.push((start, link));
                    ready = link;
                }
            }
            let start = match last {
                Some((e, g, lw)) if lw != w => ready.max(e - overlap * g),
                Some((e, _, _)) => ready.max(e),
                None => ready,
            };
            let stop = start + it.gemm + extra[i];
            gemms.push((start, stop));
            last = Some((stop, it.gemm, w));
            free[w] = stop;
            if it.after > 0.0 {
                let start = stop.max(link);
                link = start + it.after;
                transfers.push((start, link));
                free[w] = link;
            }
        }
        end = free.iter().copied().fold(link, f64::max);
        for (x, &(a, b)) in extra.iter_mut().zip(&gemms) {
            let beside: f64 = transfers
                .iter()
                .map(|&(s, e)| (e.min(b) - s.max(a)).max(0.0))
                .sum();
            *x = kappa * beside;
        }
    }
    end
}

impl CostModel {
    /// The reduce-scatter ring that accumulates in place ([`Plan::accumulate`]), `p` pieces
    /// per step over `t`: the schedule the lowering emits, simulated. The main stream runs
    /// every piece's GEMM in order (step 0 plain, later steps accumulating); piece `q` of step
    /// `k < d − 1` then moves on worker 0 (after the previous transfer); a GEMM of step `k`
    /// starts once the transfer it adds onto has landed: piece by piece where the lowering
    /// waits for each piece (the last step, and the middle step of `d = 3`), after all of
    /// step `k − 1`'s transfers otherwise (the steps of the loop in between wait for all of
    /// theirs). The transfers that run beside GEMMs slow them by `κ₂` of their time.
    fn accumulating_ring_us(&self, r: &ReduceCase, t: Transport, p: u64) -> f64 {
        let d = r.team.max(1);
        let step = self.profile.host.loop_step_us;
        let plain = r.producer.part(d * p);
        let g0 = self.compute_us(&plain);
        let ga = self.compute_us(&Work {
            bytes: plain.bytes + r.chunk_bytes / p as f64,
            ..plain
        });
        let (mp, _, k2) = self.comm(t, Collective::Permute, r.chunk_bytes / p as f64);
        let (p, last) = (p as usize, d as usize - 1);
        let (mut main, mut worker) = (0.0f64, 0.0f64);
        let mut landed = vec![0.0f64; p];
        for k in 0..=last {
            let per_piece = k == last || (d == 3 && k == 1);
            if k > 0 && !per_piece {
                main = landed.iter().copied().fold(main, f64::max);
            }
            for arrived in landed.iter_mut() {
                if k > 0 && per_piece {
                    main = main.max(*arrived);
                }
                main += if k == 0 { g0 } else { ga };
                if k < last {
                    worker = worker.max(main) + mp;
                    *arrived = worker;
                }
            }
        }
        let busy = g0 * p as f64 + ga * (p * last) as f64;
        let moving = mp * (p * last) as f64;
        let beside = (moving - (main - busy)).max(0.0);
        main + k2 * beside + d as f64 * step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: u64, n: u64, k: u64) -> Work {
        Work {
            flops: 2.0 * (m * n * k) as f64,
            bytes: 2.0 * (m * k + n * k + m * n) as f64,
            dtype: DType::BF16,
            gemm: Some([m, n, k]),
        }
    }

    fn plan(d: Decomposition, schedule: StreamSchedule, transport: Transport) -> Plan {
        Plan {
            decomposition: d,
            pieces: 1,
            schedule,
            transport,
            accumulate: false,
        }
    }

    #[test]
    fn measured_gemms_cost_what_was_measured() {
        let m = CostModel::default();
        let us = m.compute_us(&gemm(8192, 4096, 8192));
        // 687.4 us measured (profiles/h200x2.json) plus one launch (3.43 us).
        assert!((us - 690.8).abs() < 1.0, "{us}");
        // Halving the rows halves the time at the same throughput (plus one launch).
        let half = m.compute_us(&gemm(8192, 4096, 8192).part(2));
        assert!((half - 351.3).abs() < 1.0, "{half}");
    }

    #[test]
    fn plans_that_do_not_fit_the_case_have_no_cost() {
        let m = CostModel::default();
        let g = Case::Gather(GatherCase {
            team: 2,
            chunk_bytes: 1e6,
            consumer: gemm(1024, 1024, 1024),
            overlappable: true,
            workers: 2,
        });
        let nccl = Transport::Nccl;
        let ring = plan(Decomposition::Ring, StreamSchedule::Prefetch, nccl);
        assert!(m.cost(&g, &ring).is_some());
        let reduce = plan(
            Decomposition::StreamReduce,
            StreamSchedule::PerIteration,
            nccl,
        );
        assert!(m.cost(&g, &reduce).is_none());
        let r = Case::Reduce(ReduceCase {
            team: 2,
            chunk_bytes: 1e6,
            producer: gemm(1024, 1024, 1024),
            workers: 2,
        });
        for d in [
            Decomposition::StreamBroadcast,
            Decomposition::Ring,
            Decomposition::RingBidirectional,
        ] {
            assert!(m
                .cost(&r, &plan(d, StreamSchedule::Prefetch, nccl))
                .is_none());
        }
        assert!(m
            .cost(
                &r,
                &plan(Decomposition::RingForward, StreamSchedule::Prefetch, nccl)
            )
            .is_some());
    }

    #[test]
    fn the_ring_accumulating_in_place_hides_its_transfers_only_in_pieces() {
        let m = CostModel::default();
        // GEMM+RS 16384 x 8192 x 8192 on 2 ranks (local K 4096), bf16.
        let r = ReduceCase {
            team: 2,
            chunk_bytes: 8192.0 * 8192.0 * 2.0,
            producer: gemm(16384, 8192, 4096),
            workers: 2,
        };
        let t = Transport::CopyEngine;
        let cost = |pieces, accumulate| {
            let plan = Plan {
                pieces,
                accumulate,
                ..plan(Decomposition::RingForward, StreamSchedule::Prefetch, t)
            };
            m.cost(&Case::Reduce(r), &plan).unwrap()
        };
        // One piece: nothing overlaps the transfer (the second GEMM adds onto what arrived).
        let c = m.compute_us(&r.producer.part(2));
        let (mv, _, _) = m.comm(t, Collective::Permute, r.chunk_bytes);
        let want = 2.0 * c + mv + 2.0 * m.profile.host.loop_step_us;
        assert!(
            (cost(1, true) - want).abs() < 1.0,
            "{} vs {want}",
            cost(1, true)
        );
        assert!(cost(1, true) > cost(1, false));
        // In pieces each piece's transfer runs under the next GEMMs, and no add is left.
        assert!(cost(2, true) < cost(1, true));
        assert!(cost(2, true) < cost(2, false));
    }
}
