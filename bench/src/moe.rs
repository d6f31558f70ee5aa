//! Latency of dispatch and combine on the GPUs of this process, for `meshflow bench moe`.
//!
//! Every rank runs in its own thread. After warm-up the ranks synchronize once (a timing
//! barrier: they leave it together), then queue
//! `iters` steps back to back (no host synchronization inside the timed loop, so the GPUs run in
//! lockstep through the transport's own waits); CUDA events around the dispatch (send + recv,
//! the weights travelling with the rows unless [`LATE_WEIGHTS_ENV`] is set, padding not zeroed) and the combine (send + recv) time
//! each step on each rank. A step's time is the slowest rank's; the result is the median over
//! steps. The expert computation is the identity (`expert_y` is `expert_x`, so `F = H`).
//! Bandwidth is reported the way DeepEP does, on the deduplicated bytes ([`MoeTraffic`]: the
//! busiest rank's received bytes over the phase time).

use std::sync::Barrier;
use std::time::Duration;

use meshflow::kernels::moe::{
    CombineRequest, DispatchRequest, MoeShape, MoeTraffic, MoeTransport, MoeWire,
};
use meshflow::kernels::{DType, Device, DeviceBuffer, Event, KernelError, Result, Stream};
use meshflow::runtime::rendezvous::{LocalRendezvous, Rendezvous};

/// One benchmark configuration (per rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeCase {
    /// Tokens per rank `T`.
    pub tokens: usize,
    /// Token width `H` (= `F`).
    pub hidden: usize,
    /// Experts per token `K`.
    pub top_k: usize,
    /// Experts `E`.
    pub experts: usize,
    /// Element type.
    pub dtype: DType,
    /// How dispatch encodes the rows.
    pub wire: MoeWire,
    /// Timed steps.
    pub iters: usize,
    /// Untimed steps first.
    pub warmup: usize,
}

impl MoeCase {
    /// The DeepSeek-V3-like decode case at `tokens` tokens per rank: H = 7168,
    /// K = 8, E = 256, bf16, 50 timed steps after 10 warm-up steps.
    pub fn deepseek(tokens: usize) -> MoeCase {
        MoeCase {
            tokens,
            hidden: 7168,
            top_k: 8,
            experts: 256,
            dtype: DType::BF16,
            wire: MoeWire::Native,
            iters: 50,
            warmup: 10,
        }
    }
}

/// The measured latency of one engine on one case.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeResult {
    /// The engine's name ([`MoeTransport::name`]: `nccl`, `nvlink`).
    pub transport: &'static str,
    /// The layer shape run (capacity chosen from the generated routing).
    pub shape: MoeShape,
    /// How dispatch encoded the rows.
    pub wire: MoeWire,
    /// The bytes of one step (the same routing every step).
    pub traffic: MoeTraffic,
    /// Median over steps of the slowest rank's dispatch (send + recv), in µs.
    pub dispatch_us: f64,
    /// Median over steps of the slowest rank's combine (send + recv), in µs.
    pub combine_us: f64,
    /// Whether every rank's status word stayed clean (no overflow, no timeout).
    pub status_ok: bool,
    /// Whether the steps ran as replays of a CUDA graph (the evaluator path's low-latency
    /// mode: no host work between steps).
    pub graph: bool,
    /// Evaluator path: the device time of a whole step (the run's device time over its
    /// steps: the phases, the host program's work between them, and the device's idle time
    /// whenever the host falls behind), µs; the median over iterations of the slowest rank.
    pub step_us: Option<f64>,
    /// Evaluator path: the host's time to issue one step (without waiting for the device), µs;
    /// the median over iterations of the slowest rank.
    pub host_us: Option<f64>,
}

impl MoeResult {
    /// The transport's name in tables: with `+graph` for replayed steps.
    pub fn label(&self) -> String {
        if self.graph {
            format!("{}+graph", self.transport)
        } else {
            self.transport.to_string()
        }
    }
}

impl MoeResult {
    /// Dispatch bandwidth in GB/s: the busiest rank's received bytes over the dispatch time.
    pub fn dispatch_gbps(&self) -> f64 {
        MoeTraffic::gbps(self.traffic.max_bytes().0, self.dispatch_us)
    }

    /// Combine bandwidth in GB/s: the busiest rank's received bytes over the combine time.
    pub fn combine_gbps(&self) -> f64 {
        MoeTraffic::gbps(self.traffic.max_bytes().1, self.combine_us)
    }
}

/// Small deterministic generator (xorshift64*).
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
}

/// Uniform routing: `K` distinct experts per token, for every rank.
pub(crate) fn routing(case: &MoeCase, world: usize, seed: u64) -> Vec<Vec<i32>> {
    let mut rng = Rng(seed | 1);
    (0..world)
        .map(|_| {
            let mut idx = Vec::with_capacity(case.tokens * case.top_k);
            for _ in 0..case.tokens {
                let start = idx.len();
                while idx.len() - start < case.top_k {
                    let e = rng.below(case.experts) as i32;
                    if !idx[start..].contains(&e) {
                        idx.push(e);
                    }
                }
            }
            idx
        })
        .collect()
}

/// Runs `case` on `devices` (one rank per device) with the engines `make` creates for a shape
/// and the case's wire format (one per rank, e.g.
/// [`NvlinkMoe::team_with_wire`](meshflow::kernels::moe::NvlinkMoe::team_with_wire) or
/// [`NcclMoe::team_with_wire`](meshflow::kernels::moe::NcclMoe::team_with_wire)).
pub fn measure_moe<T: MoeTransport>(
    devices: &[Device],
    case: &MoeCase,
    make: impl FnOnce(&[Device], &MoeShape, MoeWire) -> Result<Vec<T>>,
) -> Result<MoeResult> {
    let world = devices.len();
    if world == 0 || case.iters == 0 {
        return Err(KernelError::InvalidArgument(
            "MoE bench needs devices and iterations".into(),
        ));
    }
    let idx = routing(case, world, 0x5EED ^ case.tokens as u64);
    let shape = shape_for(case, world, &idx)?;
    let traffic = MoeTraffic::from_routing(&shape, case.wire, &idx)?;
    let ranks = make(devices, &shape, case.wire)?;
    let transport = ranks.first().map_or("none", |r| r.name());
    let (dispatch_us, combine_us, status_ok) = run(devices, case, &idx, ranks)?;
    Ok(MoeResult {
        transport,
        shape,
        wire: case.wire,
        traffic,
        dispatch_us,
        combine_us,
        status_ok,
        graph: false,
        step_us: None,
        host_us: None,
    })
}

/// The layer shape of `case` on `world` ranks with routing `idx`: the capacity is the
/// busiest expert's rows plus an eighth, rounded up to 16 rows.
pub(crate) fn shape_for(case: &MoeCase, world: usize, idx: &[Vec<i32>]) -> Result<MoeShape> {
    let mut per_expert = vec![0usize; case.experts];
    for e in idx.iter().flatten() {
        if let Some(n) = per_expert.get_mut(*e as usize) {
            *n += 1;
        }
    }
    let max = per_expert.iter().copied().max().unwrap_or(0);
    let shape = MoeShape {
        world,
        experts: case.experts,
        top_k: case.top_k,
        tokens: case.tokens,
        hidden: case.hidden,
        out_hidden: case.hidden,
        capacity: (max + max / 8 + 4).div_ceil(16) * 16,
        dtype: case.dtype,
    };
    shape.validate()?;
    case.wire.validate(&shape)?;
    Ok(shape)
}

/// Per-rank timings: `(dispatch ms, combine ms)` per step, and whether the status stayed clean.
type RankTimes = (Vec<(f32, f32)>, bool);

fn run<T: MoeTransport>(
    devices: &[Device],
    case: &MoeCase,
    idx: &[Vec<i32>],
    ranks: Vec<T>,
) -> Result<(f64, f64, bool)> {
    let barrier = Barrier::new(devices.len());
    let start = LocalRendezvous::new("bench-moe");
    let times: Vec<Result<RankTimes>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .zip(devices)
            .zip(idx)
            .map(|((t, dev), idx)| {
                let (barrier, start) = (&barrier, &start);
                scope.spawn(move || rank_loop(t, dev, case, idx, barrier, start))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(KernelError::InvalidArgument("bench thread panicked".into()))
                })
            })
            .collect()
    });
    let times = times.into_iter().collect::<Result<Vec<_>>>()?;
    let status_ok = times.iter().all(|(_, ok)| *ok);
    let step_max = |pick: fn(&(f32, f32)) -> f32| -> f64 {
        let mut v: Vec<f64> = (0..case.iters)
            .map(|i| {
                times
                    .iter()
                    .map(|(t, _)| pick(&t[i]) as f64)
                    .fold(0.0, f64::max)
                    * 1e3
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((step_max(|t| t.0), step_max(|t| t.1), status_ok))
}

/// One rank's bench: warm-up, then the timed steps. Both team-wide barriers are always reached
/// (an error is returned after them), so one failing rank cannot leave the others waiting. The
/// first is a timing barrier on `start` (the ranks leave it together, as the evaluator's timed
/// runs start: see `docs/architecture.md`, "Timed runs").
fn rank_loop<T: MoeTransport>(
    mut t: T,
    dev: &Device,
    case: &MoeCase,
    idx: &[i32],
    barrier: &Barrier,
    start: &LocalRendezvous,
) -> Result<RankTimes> {
    let s = *t.shape();
    let stream = Stream::new(dev)?;
    let x = DeviceBuffer::alloc(dev, s.tokens * s.x_row_bytes())?;
    let topk = DeviceBuffer::from_slice(&stream, idx)?;
    let w = DeviceBuffer::from_slice(&stream, &vec![1.0f32 / s.top_k as f32; s.tokens * s.top_k])?;
    let out = DeviceBuffer::alloc(dev, s.tokens * s.y_row_bytes())?;
    let ex = t.expert_x()?.clone();
    // The weights travel with the dispatch (as the evaluator gives weights that are a program
    // input), or (LATE_WEIGHTS_ENV) with the combine (weights the program computes after the
    // dispatch).
    let late = std::env::var_os(LATE_WEIGHTS_ENV).is_some();
    let dispatch = DispatchRequest {
        x: &x,
        topk_idx: &topk,
        weights: (!late).then_some(&w),
        zero_padding: false,
        outputs: None,
    };
    let combine = CombineRequest {
        expert_y: &ex,
        weights: late.then_some(&w),
    };
    let warm = (|| -> Result<()> {
        x.memset(&stream, 0x3C)?;
        for _ in 0..case.warmup {
            t.dispatch_with(&stream, &dispatch)?;
            t.combine_with(&stream, &combine, &out)?;
        }
        stream.synchronize()
    })();
    let started = start
        .timing_barrier("start", s.world, Duration::from_secs(120))
        .map_err(|e| KernelError::InvalidArgument(format!("MoE bench start: {e}")));
    let warm = warm.and(started);
    let phases = std::env::var_os(PHASES_ENV).is_some();
    let timed = warm.and_then(|()| {
        let mut events = Vec::with_capacity(case.iters);
        for _ in 0..case.iters {
            let e = [
                Event::timing(dev)?,
                Event::timing(dev)?,
                Event::timing(dev)?,
                Event::timing(dev)?,
                Event::timing(dev)?,
            ];
            e[0].record(&stream)?;
            if phases {
                // Events between the four calls (each record may cost the GPU a little).
                t.dispatch_send(&stream, &dispatch)?;
                e[3].record(&stream)?;
                t.dispatch_recv(&stream)?;
                e[1].record(&stream)?;
                t.combine_send(&stream, &combine)?;
                e[4].record(&stream)?;
                t.combine_recv(&stream, &out)?;
            } else {
                t.dispatch_with(&stream, &dispatch)?;
                e[1].record(&stream)?;
                t.combine_with(&stream, &combine, &out)?;
            }
            e[2].record(&stream)?;
            events.push(e);
        }
        stream.synchronize()?;
        let times = events
            .iter()
            .map(|e| {
                Ok((
                    Event::elapsed_ms(&e[0], &e[1])?,
                    Event::elapsed_ms(&e[1], &e[2])?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        if phases {
            log_phases(t.rank(), &s, &events)?;
        }
        Ok((times, t.status(&stream)?.is_ok()))
    });
    // Every rank must be done with its peers' memory before any transport is dropped.
    let _ = stream.synchronize();
    barrier.wait();
    timed
}

/// Set to give the weights to the combine instead of the dispatch (the kernels' path; the
/// evaluator does so when a program computes them after the dispatch): for comparisons.
pub const LATE_WEIGHTS_ENV: &str = "MESHFLOW_MOE_BENCH_LATE_WEIGHTS";

/// Set to time the four calls of a step separately (logged at `info` level by
/// `meshflow_bench`, e.g. `RUST_LOG=meshflow_bench=info`).
pub const PHASES_ENV: &str = "MESHFLOW_MOE_BENCH_PHASES";

/// Logs this rank's median time of each call of a step from the events
/// `[start, after dispatch_recv, end, after dispatch_send, after combine_send]`.
fn log_phases(rank: usize, s: &MoeShape, events: &[[Event; 5]]) -> Result<()> {
    let median = |a: usize, b: usize| -> Result<f64> {
        let mut v = events
            .iter()
            .map(|e| Ok(Event::elapsed_ms(&e[a], &e[b])? as f64 * 1e3))
            .collect::<Result<Vec<f64>>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v.get(v.len() / 2).copied().unwrap_or(0.0))
    };
    tracing::info!(
        rank,
        tokens = s.tokens,
        dispatch_send_us = median(0, 3)?,
        dispatch_recv_us = median(3, 1)?,
        combine_send_us = median(1, 4)?,
        combine_recv_us = median(4, 2)?,
        "MoE step phases (median per call)"
    );
    Ok(())
}

/// The results as a text table (one line per transport and case). MB are the busiest rank's
/// received bytes per phase (10^6), GB/s those bytes over the phase time; `step_us` and
/// `host_us` (evaluator path; `-` otherwise) are a whole step's device time and the host's
/// time to issue it ([`MoeResult::step_us`], [`MoeResult::host_us`]).
pub fn moe_table(results: &[MoeResult]) -> String {
    let mut s = String::from(
        "transport     W     T     H  K    E    C  wire          dispatch_us  MB     GB/s  \
         combine_us  MB     GB/s  status   step_us  host_us\n",
    );
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    for r in results {
        let sh = &r.shape;
        let (db, cb) = r.traffic.max_bytes();
        s.push_str(&format!(
            "{:<12} {:>2} {:>5} {:>5} {:>2} {:>4} {:>4}  {:<12} {:>11.1} {:>6.1} {:>6.1} \
             {:>11.1} {:>6.1} {:>6.1}  {:<7} {:>8} {:>8}\n",
            r.label(),
            sh.world,
            sh.tokens,
            sh.hidden,
            sh.top_k,
            sh.experts,
            sh.capacity,
            format!("{} {}", sh.dtype.name(), r.wire.name()),
            r.dispatch_us,
            db as f64 / 1e6,
            r.dispatch_gbps(),
            r.combine_us,
            cb as f64 / 1e6,
            r.combine_gbps(),
            if r.status_ok { "ok" } else { "FLAGGED" },
            us(r.step_us),
            us(r.host_us),
        ));
    }
    s
}
