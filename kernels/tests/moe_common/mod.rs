//! The harness of the MoE GPU tests (`gpu_moe.rs`): input generation, the test expert, a
//! barrier that never hangs, and one checked step of one rank against the CPU reference.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use meshflow_kernels::moe::{
    reference_combine, reference_dispatch, round_to, CombineRequest, DispatchOutputs,
    DispatchRequest, MoeShape, MoeStatus, MoeTraffic, MoeTransport,
};
use meshflow_kernels::{DType, Device, DeviceBuffer, KernelError, Stream};

/// Number of visible devices, or prints why the test is skipped and returns `None`.
pub fn device_count() -> Option<usize> {
    match Device::count() {
        Err(KernelError::NoDevice(why)) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
        Ok(0) => {
            eprintln!("skipped: no CUDA device (0 visible)");
            None
        }
        Ok(n) => Some(n),
    }
}

pub fn fresh_seed() -> u64 {
    if let Ok(s) = std::env::var("MESHFLOW_MOE_SEED") {
        return s.parse().expect("MESHFLOW_MOE_SEED is a number");
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    t.as_nanos() as u64 ^ 0x9E37_79B9_7F4A_7C15
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

// ---- host data -------------------------------------------------------------------------------

pub fn upload_floats(stream: &Stream, buf: &DeviceBuffer, dtype: DType, v: &[f32]) {
    match dtype {
        DType::F32 => buf.upload(stream, v).unwrap(),
        DType::BF16 => buf
            .upload(
                stream,
                &v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>(),
            )
            .unwrap(),
        DType::F16 => buf
            .upload(
                stream,
                &v.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>(),
            )
            .unwrap(),
        d => panic!("not a float dtype: {d}"),
    }
}

pub fn download_floats(stream: &Stream, buf: &DeviceBuffer, dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => buf.to_vec::<f32>(stream).unwrap(),
        DType::BF16 => buf
            .to_vec::<bf16>(stream)
            .unwrap()
            .into_iter()
            .map(f32::from)
            .collect(),
        DType::F16 => buf
            .to_vec::<f16>(stream)
            .unwrap()
            .into_iter()
            .map(f32::from)
            .collect(),
        d => panic!("not a float dtype: {d}"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// K distinct uniform experts per token.
    Uniform,
    /// Rank 0 sends every row to the last rank's experts (it receives nothing from itself and
    /// the other ranks' experts get nothing from it); other ranks are uniform.
    Skewed,
    /// Uniform, plus one invalid expert id on every rank (skipped, `BAD_EXPERT`).
    WithBadId,
    /// Nobody routes to rank 1's experts (rank 1 receives nothing; needs `E - L >= K`).
    NothingForRank1,
}

/// One step's inputs of every rank.
pub struct StepInputs {
    pub x: Vec<Vec<f32>>,
    pub idx: Vec<Vec<i32>>,
    pub w: Vec<Vec<f32>>,
}

pub fn gen_step(shape: &MoeShape, routing: Routing, rng: &mut Rng) -> StepInputs {
    let (t, k, e, h) = (shape.tokens, shape.top_k, shape.experts, shape.hidden);
    let l = shape.local_experts();
    let mut inp = StepInputs {
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
        let (lo, n) = if routing == Routing::Skewed && r == 0 && shape.world > 1 {
            ((shape.world - 1) * l, l)
        } else {
            (0, e)
        };
        let avoid = routing == Routing::NothingForRank1 && shape.world > 1 && e - l >= k;
        let mut idx = Vec::with_capacity(t * k);
        for _ in 0..t {
            let start = idx.len();
            while idx.len() - start < k {
                let ex = (lo + rng.below(n)) as i32;
                if avoid && ex as usize / l == 1 {
                    continue;
                }
                if !idx[start..].contains(&ex) {
                    idx.push(ex);
                }
            }
        }
        if routing == Routing::WithBadId && !idx.is_empty() {
            let at = rng.below(idx.len());
            idx[at] = (e + 5) as i32;
        }
        inp.idx.push(idx);
    }
    inp
}

/// The most rows any expert receives in any of `steps`.
pub fn max_rows(shape: &MoeShape, steps: &[StepInputs]) -> usize {
    let mut max = 0;
    for s in steps {
        let mut c = vec![0usize; shape.experts];
        for e in s.idx.iter().flatten() {
            if (*e as usize) < shape.experts {
                c[*e as usize] += 1;
            }
        }
        max = max.max(c.into_iter().max().unwrap_or(0));
    }
    max
}

/// The test's expert: `y[f] = round(x[f % H] * scale(e))`.
pub fn expert_fn(shape: &MoeShape, e: usize, x: &[f32]) -> Vec<f32> {
    let scale = 0.5 + (e % 13) as f32 / 8.0;
    (0..shape.out_hidden)
        .map(|f| round_to(shape.dtype, x[f % shape.hidden] * scale))
        .collect()
}

// ---- team synchronization (never hangs) ---------------------------------------------------------

/// A barrier whose wait fails after a timeout instead of hanging when a rank died.
pub struct TimedBarrier {
    n: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl TimedBarrier {
    pub fn new(n: usize) -> TimedBarrier {
        TimedBarrier {
            n,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }
    pub fn wait(&self) -> Result<(), String> {
        let mut g = self.state.lock().unwrap();
        let gen = g.1;
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while g.1 == gen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("barrier timed out (another rank failed)".into());
            }
            g = self.cv.wait_timeout(g, left).unwrap().0;
        }
        Ok(())
    }
}

/// The `(team-global token, k)` rows each rank received.
pub type Delivered = Mutex<Vec<HashSet<(i32, i32)>>>;

/// How ranks of one test share facts: in-process threads (barrier + the delivered rows of every
/// rank) or separate processes (nothing shared: no overflow, so every valid row is delivered).
pub struct Team<'a> {
    pub barrier: Option<&'a TimedBarrier>,
    pub delivered: Option<&'a Delivered>,
}

impl Team<'_> {
    pub fn sync(&self) -> Result<(), String> {
        self.barrier.map_or(Ok(()), |b| b.wait())
    }
}

// ---- one rank, one step -----------------------------------------------------------------------

pub struct RankBufs {
    pub x: DeviceBuffer,
    pub idx: DeviceBuffer,
    pub w: DeviceBuffer,
    pub y: DeviceBuffer,
    pub out: DeviceBuffer,
    /// Caller-given dispatch outputs (`expert_x`, `expert_counts`, `routing`), each a view
    /// 256 bytes into its allocation, as a runtime's arena would hand out.
    pub ex: DeviceBuffer,
    pub counts: DeviceBuffer,
    pub routing: DeviceBuffer,
}

impl RankBufs {
    pub fn new(dev: &Device, s: &MoeShape) -> RankBufs {
        let a = |bytes: usize| DeviceBuffer::alloc(dev, bytes.max(16)).unwrap();
        let v = |b: DeviceBuffer, bytes: usize| b.view(0, bytes).unwrap();
        let (tx, tk, y, o) = (
            s.tokens * s.x_row_bytes(),
            s.tokens * s.top_k * 4,
            s.local_experts() * s.capacity * s.y_row_bytes(),
            s.tokens * s.y_row_bytes(),
        );
        let rows = s.local_experts() * s.capacity;
        let inner = |bytes: usize| a(bytes + 256).view(256, bytes).unwrap();
        RankBufs {
            x: v(a(tx), tx),
            idx: v(a(tk), tk),
            w: v(a(tk), tk),
            y: v(a(y), y),
            out: v(a(o), o),
            ex: inner(rows * s.x_row_bytes()),
            counts: inner(s.local_experts() * 4),
            routing: inner(rows * 8),
        }
    }
}

pub fn poison(stream: &Stream, dtype: DType, b: &DeviceBuffer) {
    if !b.is_empty() {
        stream.device().kernels().poison(stream, dtype, b).unwrap();
    }
}

/// How one step runs: where the weights go, whether padding is zeroed, and whether the
/// dispatch writes into caller-given outputs ([`RankBufs::ex`] and its siblings).
#[derive(Clone, Copy, Debug)]
pub struct StepMode {
    pub weights_at_dispatch: bool,
    pub zero_padding: bool,
    pub caller_outputs: bool,
}

impl StepMode {
    /// The modes of step `i`: the weights/padding combinations every four steps; steps 0, 1,
    /// 3, 6 and 7 (of every 8) write into caller-given outputs (all four combinations; the
    /// first two before the engine ever needs its own outputs, which it must then never
    /// allocate), steps 2, 4 and 5 into the engine's own (2 and 5 zero the padding: the
    /// engine's bookkeeping of its own padding must survive the steps in between).
    pub fn of_step(i: usize) -> StepMode {
        StepMode {
            weights_at_dispatch: i.is_multiple_of(2),
            zero_padding: i % 4 == 1 || i % 4 == 2,
            caller_outputs: matches!(i % 8, 0 | 1 | 3 | 6 | 7),
        }
    }
}

/// Runs one step on one rank and checks it; returns a one-line summary or the failures.
pub fn rank_step(
    t: &mut dyn MoeTransport,
    stream: &Stream,
    bufs: &RankBufs,
    inp: &StepInputs,
    team: &Team<'_>,
    expect: MoeStatus,
    mode: StepMode,
) -> Result<String, String> {
    let s = *t.shape();
    let wire = t.wire();
    let (r, l, c, h, f) = (
        t.rank(),
        s.local_experts(),
        s.capacity,
        s.hidden,
        s.out_hidden,
    );
    let mut errs = Vec::new();
    // Poison this rank's outputs (peers never write them). The padding of the engine's own
    // expert_x / routing belongs to the transport when it zeroes it, so it is poisoned only in
    // the other steps; caller-given outputs are poisoned whole (NaN / INT_POISON). An engine
    // that has only dispatched into caller outputs holds no outputs of its own (and touching
    // them here would allocate them).
    team.sync()?;
    let own_before = t.own_output_bytes();
    if mode.caller_outputs {
        poison(stream, s.dtype, &bufs.ex);
        poison(stream, DType::I32, &bufs.routing);
        poison(stream, DType::I32, &bufs.counts);
    } else if !mode.zero_padding {
        poison(stream, s.dtype, t.expert_x().map_err(|e| e.to_string())?);
        poison(stream, DType::I32, t.routing().map_err(|e| e.to_string())?);
    }
    if !mode.caller_outputs || own_before > 0 {
        poison(
            stream,
            DType::I32,
            t.expert_counts().map_err(|e| e.to_string())?,
        );
    }
    poison(stream, s.dtype, &bufs.out);
    upload_floats(stream, &bufs.x, s.dtype, &inp.x[r]);
    bufs.idx.upload(stream, &inp.idx[r]).unwrap();
    bufs.w.upload(stream, &inp.w[r]).unwrap();
    stream.synchronize().map_err(|e| e.to_string())?;
    let own_counts_before = if own_before > 0 {
        let b = t.expert_counts().map_err(|e| e.to_string())?;
        Some(b.to_vec::<i32>(stream).unwrap())
    } else {
        None
    };
    team.sync()?;

    let req = DispatchRequest {
        x: &bufs.x,
        topk_idx: &bufs.idx,
        weights: mode.weights_at_dispatch.then_some(&bufs.w),
        zero_padding: mode.zero_padding,
        outputs: mode.caller_outputs.then_some(DispatchOutputs {
            expert_x: &bufs.ex,
            expert_counts: &bufs.counts,
            routing: &bufs.routing,
        }),
    };
    t.dispatch_send(stream, &req)
        .map_err(|e| format!("dispatch_send: {e}"))?;
    t.dispatch_recv(stream)
        .map_err(|e| format!("dispatch_recv: {e}"))?;
    let (ex_buf, counts_buf, routing_buf) = if mode.caller_outputs {
        (&bufs.ex, &bufs.counts, &bufs.routing)
    } else {
        let own = |b: Result<_, KernelError>| b.map_err(|e| e.to_string());
        (
            own(t.expert_x())?,
            own(t.expert_counts())?,
            own(t.routing())?,
        )
    };
    let counts = counts_buf.to_vec::<i32>(stream).unwrap();
    let ex = download_floats(stream, ex_buf, s.dtype);
    let routing = routing_buf.to_vec::<i32>(stream).unwrap();
    if mode.caller_outputs {
        // The engine's own outputs are left alone; the combine must not read the caller's.
        if let Some(before) = &own_counts_before {
            let own_counts = t.expert_counts().map_err(|e| e.to_string())?;
            if own_counts.to_vec::<i32>(stream).unwrap() != *before {
                errs.push(format!(
                    "rank {r}: a dispatch into caller outputs wrote the engine's own counts"
                ));
            }
        }
        poison(stream, s.dtype, &bufs.ex);
        poison(stream, DType::I32, &bufs.routing);
        poison(stream, DType::I32, &bufs.counts);
    }

    // The rows received from each source are the deduplicated traffic.
    let traffic = MoeTraffic::from_routing(&s, wire, &inp.idx).unwrap();
    let want_rows: Vec<usize> = (0..s.world).map(|src| traffic.rows[src][r]).collect();
    let got_rows = t.received_rows(stream).map_err(|e| e.to_string())?;
    if got_rows != want_rows {
        errs.push(format!(
            "rank {r}: received rows per source {got_rows:?}, expected {want_rows:?}"
        ));
    }

    // Dispatch checks. With overflow the kept rows are a subset of the uncapped reference.
    let overflow = expect.overflow();
    let big = MoeShape {
        capacity: s.world * s.tokens * s.top_k + 1,
        ..s
    };
    let full = reference_dispatch(&big, wire, r, &inp.x, &inp.idx).unwrap();
    let want = reference_dispatch(&s, wire, r, &inp.x, &inp.idx).unwrap();
    if counts != want.counts {
        let first = counts
            .iter()
            .zip(&want.counts)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        errs.push(format!(
            "rank {r}: counts differ; first at local expert {first}: got {}, want {} (gpu {:?}.. ref {:?}..)",
            counts.get(first).copied().unwrap_or(-1),
            want.counts[first],
            &counts[..counts.len().min(8)],
            &want.counts[..want.counts.len().min(8)]
        ));
    }
    let mut delivered = Vec::new();
    for le in 0..l {
        let n = (counts[le].max(0) as usize).min(c);
        let mut got: Vec<(i32, i32, Vec<u32>)> = (0..n)
            .map(|j| {
                let row = &ex[(le * c + j) * h..(le * c + j + 1) * h];
                (
                    routing[(le * c + j) * 2],
                    routing[(le * c + j) * 2 + 1],
                    row.iter().map(|v| v.to_bits()).collect(),
                )
            })
            .collect();
        got.sort();
        let mut all: Vec<(i32, i32, Vec<u32>)> = full.rows[le]
            .iter()
            .enumerate()
            .map(|(j, &(g, k))| {
                (
                    g,
                    k,
                    full.expert_x[(le * big.capacity + j) * h..][..h]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect(),
                )
            })
            .collect();
        all.sort();
        if overflow {
            if let Some(bad) = got.iter().find(|row| all.binary_search(row).is_err()) {
                errs.push(format!("rank {r} expert {le}: row (token {}, k {}) is not one the reference routes here", bad.0, bad.1));
            }
            let set: HashSet<_> = got.iter().map(|g| (g.0, g.1)).collect();
            if set.len() != got.len() {
                errs.push(format!("rank {r} expert {le}: a row was delivered twice"));
            }
        } else if got != all {
            let i = got
                .iter()
                .zip(&all)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(all.len()));
            let show = |v: &[(i32, i32, Vec<u32>)]| {
                v.get(i).map(|g| {
                    format!(
                        "(token {}, k {}, x[0] bits {:#x})",
                        g.0,
                        g.1,
                        g.2.first().copied().unwrap_or(0)
                    )
                })
            };
            errs.push(format!(
                "rank {r} expert {le}: rows differ ({} vs {} rows); first sorted mismatch at {i}: gpu {:?}, ref {:?}",
                got.len(),
                all.len(),
                show(&got),
                show(&all)
            ));
        }
        if mode.zero_padding {
            for j in n..c {
                let row = &ex[(le * c + j) * h..(le * c + j + 1) * h];
                if row.iter().any(|v| v.to_bits() != 0)
                    || routing[(le * c + j) * 2] != 0
                    || routing[(le * c + j) * 2 + 1] != 0
                {
                    errs.push(format!("rank {r} expert {le}: padding row {j} is not zero"));
                    break;
                }
            }
        }
        delivered.extend(got.iter().map(|g| (g.0, g.1)));
    }

    // The expert: y from the received rows; padding rows are NaN (combine must ignore them).
    let mut y = vec![f32::NAN; l * c * f];
    for le in 0..l {
        for j in 0..(counts[le].max(0) as usize).min(c) {
            let row = &ex[(le * c + j) * h..(le * c + j + 1) * h];
            y[(le * c + j) * f..][..f].copy_from_slice(&expert_fn(&s, r * l + le, row));
        }
    }
    upload_floats(stream, &bufs.y, s.dtype, &y);

    // Which (token, k) rows survived on any rank (needed for combine under overflow).
    let survivors: HashSet<(i32, i32)> = match team.delivered {
        Some(shared) => {
            shared.lock().unwrap()[r] = delivered.iter().copied().collect();
            team.sync()?;
            let all = shared.lock().unwrap().iter().flatten().copied().collect();
            team.sync()?;
            all
        }
        None => (0..s.world * s.tokens)
            .flat_map(|g| (0..s.top_k).map(move |k| (g as i32, k as i32)))
            .collect(),
    };

    let creq = CombineRequest {
        expert_y: &bufs.y,
        weights: (!mode.weights_at_dispatch).then_some(&bufs.w),
    };
    t.combine_send(stream, &creq)
        .map_err(|e| format!("combine_send: {e}"))?;
    t.combine_recv(stream, &bufs.out)
        .map_err(|e| format!("combine_recv: {e}"))?;
    let out = download_floats(stream, &bufs.out, s.dtype);
    let idx = &inp.idx[r];
    let want_out = reference_combine(&s, idx, &inp.w[r], |tt, k| {
        let e = idx[tt * s.top_k + k];
        let g = (r * s.tokens + tt) as i32;
        (e >= 0 && (e as usize) < s.experts && survivors.contains(&(g, k as i32))).then(|| {
            let row = wire
                .arrived_row(&s, &inp.x[r][tt * h..(tt + 1) * h])
                .unwrap();
            expert_fn(&s, e as usize, &row)
        })
    })
    .unwrap();
    // The combine follows the documented summation order: bit-identical to the reference.
    if let Some(i) = out
        .iter()
        .zip(&want_out)
        .position(|(g, w)| g.to_bits() != w.to_bits())
    {
        errs.push(format!(
            "rank {r}: combine out[{}, {}] = {} ({:#x}), want {} ({:#x})",
            i / f,
            i % f,
            out[i],
            out[i].to_bits(),
            want_out[i],
            want_out[i].to_bits()
        ));
    }
    let status = t.status(stream).map_err(|e| e.to_string())?;
    if status != expect {
        errs.push(format!(
            "rank {r}: status {:#x}, expected {:#x}",
            status.0, expect.0
        ));
    }
    t.clear_status(stream).map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| e.to_string())?;
    if mode.caller_outputs && own_before == 0 && t.own_output_bytes() != 0 {
        errs.push(format!(
            "rank {r}: a step with caller outputs allocated the engine's own outputs ({} bytes)",
            t.own_output_bytes()
        ));
    }
    if errs.is_empty() {
        Ok(format!(
            "rank {r}: rows {} received {got_rows:?}, combine bit-identical ({} values)",
            counts.iter().sum::<i32>(),
            out.len()
        ))
    } else {
        Err(errs.join("\n"))
    }
}
