//! GPU tests of the MoE dispatch/combine transports against the CPU reference. Without a GPU
//! each test prints `skipped: ...` and returns; cases needing more GPUs than visible are skipped
//! with a message. Inputs are fresh random values per run (the seed is printed).
//!
//! Every case runs 3 steps on the same transport objects (epoch reuse) and checks, per rank and
//! step: per-expert counts, per-expert row multisets (routing and row bits), zero padding, the
//! status word, and the combine output (bf16: rel < 1e-2, f32: rel < 1e-5; also reports how many
//! elements are bit-identical to the reference).
#![cfg(feature = "cuda")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::too_many_arguments,
    clippy::print_stdout
)]

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use meshflow_kernels::moe::{
    bench_moe, format_bench_table, reference_combine, reference_dispatch, round_to, BenchCase,
    MoeShape, MoeStatus, MoeTransport, NcclMoe, NvlinkMoe,
};
use meshflow_kernels::nccl::{Comm, NcclLib};
use meshflow_kernels::{DType, Device, DeviceBuffer, KernelError, Stream};

const STEPS: usize = 3;

/// Number of visible devices, or prints why the test is skipped and returns `None`.
fn device_count() -> Option<usize> {
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

fn fresh_seed() -> u64 {
    if let Ok(s) = std::env::var("MESHFLOW_MOE_SEED") {
        return s.parse().expect("MESHFLOW_MOE_SEED is a number");
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    t.as_nanos() as u64 ^ 0x9E37_79B9_7F4A_7C15
}

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

// ---- host data -------------------------------------------------------------------------------

fn upload_floats(stream: &Stream, buf: &DeviceBuffer, dtype: DType, v: &[f32]) {
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

fn download_floats(stream: &Stream, buf: &DeviceBuffer, dtype: DType) -> Vec<f32> {
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
enum Routing {
    /// K distinct uniform experts per token.
    Uniform,
    /// Rank 0 sends every row to the last rank's experts (it receives nothing and sends
    /// nothing to itself); other ranks are uniform.
    Skewed,
    /// Uniform, plus one invalid expert id on every rank (skipped, `BAD_EXPERT`).
    WithBadId,
}

/// One step's inputs of every rank.
struct StepInputs {
    x: Vec<Vec<f32>>,
    idx: Vec<Vec<i32>>,
    w: Vec<Vec<f32>>,
}

fn gen_step(shape: &MoeShape, routing: Routing, rng: &mut Rng) -> StepInputs {
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
        if routing == Routing::WithBadId && !idx.is_empty() {
            let at = rng.below(idx.len());
            idx[at] = (e + 5) as i32;
        }
        inp.idx.push(idx);
    }
    inp
}

/// The most rows any expert receives in any of `steps`.
fn max_rows(shape: &MoeShape, steps: &[StepInputs]) -> usize {
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
fn expert_fn(shape: &MoeShape, e: usize, x: &[f32]) -> Vec<f32> {
    let scale = 0.5 + (e % 13) as f32 / 8.0;
    (0..shape.out_hidden)
        .map(|f| round_to(shape.dtype, x[f % shape.hidden] * scale))
        .collect()
}

// ---- team synchronization (never hangs) ---------------------------------------------------------

/// A barrier whose wait fails after a timeout instead of hanging when a rank died.
struct TimedBarrier {
    n: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl TimedBarrier {
    fn new(n: usize) -> TimedBarrier {
        TimedBarrier {
            n,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }
    fn wait(&self) -> Result<(), String> {
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
type Delivered = Mutex<Vec<HashSet<(i32, i32)>>>;

/// How ranks of one test share facts: in-process threads (barrier + the delivered rows of every
/// rank) or separate processes (nothing shared: no overflow, so every valid row is delivered).
struct Team<'a> {
    barrier: Option<&'a TimedBarrier>,
    delivered: Option<&'a Delivered>,
}

impl Team<'_> {
    fn sync(&self) -> Result<(), String> {
        self.barrier.map_or(Ok(()), |b| b.wait())
    }
}

// ---- one rank, one step -----------------------------------------------------------------------

struct RankBufs {
    x: DeviceBuffer,
    idx: DeviceBuffer,
    w: DeviceBuffer,
    y: DeviceBuffer,
    out: DeviceBuffer,
}

impl RankBufs {
    fn new(dev: &Device, s: &MoeShape) -> RankBufs {
        let a = |bytes: usize| DeviceBuffer::alloc(dev, bytes).unwrap();
        RankBufs {
            x: a(s.tokens * s.x_row_bytes()),
            idx: a(s.tokens * s.top_k * 4),
            w: a(s.tokens * s.top_k * 4),
            y: a(s.local_experts() * s.capacity * s.y_row_bytes()),
            out: a(s.tokens * s.y_row_bytes()),
        }
    }
}

fn poison(stream: &Stream, dtype: DType, b: &DeviceBuffer) {
    if !b.is_empty() {
        stream.device().kernels().poison(stream, dtype, b).unwrap();
    }
}

/// Runs one step on one rank and checks it; returns a one-line summary or the failures.
fn rank_step(
    t: &mut dyn MoeTransport,
    stream: &Stream,
    bufs: &RankBufs,
    inp: &StepInputs,
    team: &Team<'_>,
    expect: MoeStatus,
) -> Result<String, String> {
    let s = *t.shape();
    let (r, l, c, h, f) = (
        t.rank(),
        s.local_experts(),
        s.capacity,
        s.hidden,
        s.out_hidden,
    );
    let mut errs = Vec::new();
    // Poison the outputs while no peer can be writing them (everyone is between steps). Without
    // a team barrier (separate processes) peers may already write this step's rows into the
    // NVLink transport's expert_x / routing, so only rank-private outputs are poisoned then.
    team.sync()?;
    if team.barrier.is_some() || t.name() == "nccl" {
        poison(stream, s.dtype, t.expert_x());
        poison(stream, DType::I32, t.routing());
    }
    poison(stream, DType::I32, t.expert_counts());
    poison(stream, s.dtype, &bufs.out);
    stream.synchronize().map_err(|e| e.to_string())?;
    team.sync()?;
    upload_floats(stream, &bufs.x, s.dtype, &inp.x[r]);
    bufs.idx.upload(stream, &inp.idx[r]).unwrap();
    bufs.w.upload(stream, &inp.w[r]).unwrap();

    t.dispatch_send(stream, &bufs.x, &bufs.idx)
        .map_err(|e| format!("dispatch_send: {e}"))?;
    t.dispatch_recv(stream)
        .map_err(|e| format!("dispatch_recv: {e}"))?;
    let counts = t.expert_counts().to_vec::<i32>(stream).unwrap();
    let ex = download_floats(stream, t.expert_x(), s.dtype);
    let routing = t.routing().to_vec::<i32>(stream).unwrap();

    // Dispatch checks. With overflow the kept rows are a subset of the uncapped reference.
    let overflow = expect.overflow();
    let big = MoeShape {
        capacity: s.world * s.tokens * s.top_k + 1,
        ..s
    };
    let full = reference_dispatch(&big, r, &inp.x, &inp.idx).unwrap();
    let want = reference_dispatch(&s, r, &inp.x, &inp.idx).unwrap();
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

    let (ec, er) = (t.expert_counts().clone(), t.routing().clone());
    t.combine_send(stream, &bufs.y, &ec, &er)
        .map_err(|e| format!("combine_send: {e}"))?;
    t.combine_recv(stream, &bufs.w, &bufs.out)
        .map_err(|e| format!("combine_recv: {e}"))?;
    let out = download_floats(stream, &bufs.out, s.dtype);
    let idx = &inp.idx[r];
    let want_out = reference_combine(&s, &inp.w[r], |tt, k| {
        let e = idx[tt * s.top_k + k];
        let g = (r * s.tokens + tt) as i32;
        (e >= 0 && (e as usize) < s.experts && survivors.contains(&(g, k as i32)))
            .then(|| expert_fn(&s, e as usize, &inp.x[r][tt * h..(tt + 1) * h]))
    })
    .unwrap();
    let rel = if s.dtype == DType::F32 { 1e-5 } else { 1e-2 };
    let (mut worst, mut exact) = (0.0f32, 0usize);
    for (i, (g, w)) in out.iter().zip(&want_out).enumerate() {
        let err = (g - w).abs() / w.abs().max(1e-3);
        exact += usize::from(g.to_bits() == w.to_bits());
        if err.is_nan() || err > rel {
            errs.push(format!(
                "rank {r}: combine out[{}, {}] = {g}, want {w}",
                i / f,
                i % f
            ));
            break;
        }
        worst = worst.max(err);
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
    if errs.is_empty() {
        Ok(format!(
            "rank {r}: rows {} max rel err {worst:.2e}, {exact}/{} bit-exact",
            counts.iter().sum::<i32>(),
            out.len()
        ))
    } else {
        Err(errs.join("\n"))
    }
}

// ---- in-process cases -----------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Case {
    name: &'static str,
    experts_per_rank: Option<usize>,
    experts: usize,
    top_k: usize,
    tokens: usize,
    hidden: usize,
    out_hidden: usize,
    dtype: DType,
    routing: Routing,
    /// Capacity = this fraction of the largest expert's rows (1.0 = exactly full).
    capacity_fraction: f32,
}

impl Case {
    fn shape(&self, world: usize) -> MoeShape {
        MoeShape {
            world,
            experts: self.experts_per_rank.map_or(self.experts, |l| l * world),
            top_k: self.top_k,
            tokens: self.tokens,
            hidden: self.hidden,
            out_hidden: self.out_hidden,
            capacity: 1,
            dtype: self.dtype,
        }
    }
}

fn cases() -> Vec<Case> {
    let base = Case {
        name: "",
        experts_per_rank: None,
        experts: 256,
        top_k: 8,
        tokens: 64,
        hidden: 256,
        out_hidden: 256,
        dtype: DType::BF16,
        routing: Routing::Uniform,
        capacity_fraction: 1.0,
    };
    vec![
        Case {
            name: "E=W K=1 bf16",
            experts_per_rank: Some(1),
            top_k: 1,
            ..base
        },
        Case {
            name: "E=W K=W bf16 H=100 F=36 (scalar paths)",
            experts_per_rank: Some(1),
            top_k: 0,
            tokens: 50,
            hidden: 100,
            out_hidden: 36,
            ..base
        },
        Case {
            name: "E=256 K=2 bf16",
            top_k: 2,
            tokens: 96,
            hidden: 512,
            out_hidden: 512,
            ..base
        },
        Case {
            name: "E=256 K=8 bf16",
            tokens: 128,
            hidden: 1024,
            out_hidden: 1024,
            ..base
        },
        Case {
            name: "E=2048 K=8 f32 (empty experts)",
            experts: 2048,
            dtype: DType::F32,
            out_hidden: 128,
            ..base
        },
        Case {
            name: "E=256 K=8 bf16 skewed (rank 0 sends only remote)",
            routing: Routing::Skewed,
            ..base
        },
        Case {
            name: "E=16 K=4 f32 T=0",
            experts: 16,
            top_k: 4,
            tokens: 0,
            dtype: DType::F32,
            ..base
        },
    ]
}

/// The MoE engines under test.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Engine {
    Nccl,
    Nvlink,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Nccl => "nccl",
            Engine::Nvlink => "nvlink",
        }
    }
}

fn make_transports(kind: Engine, devs: &[Device], shape: &MoeShape) -> Vec<Box<dyn MoeTransport>> {
    match kind {
        Engine::Nvlink => NvlinkMoe::team(devs, shape)
            .unwrap()
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn MoeTransport>)
            .collect(),
        Engine::Nccl => {
            let lib = NcclLib::load().unwrap();
            Comm::init_all(&lib, devs)
                .unwrap()
                .into_iter()
                .map(|c| Box::new(NcclMoe::new(c, shape).unwrap()) as Box<dyn MoeTransport>)
                .collect()
        }
    }
}

/// Runs `case` on `world` GPUs with `kind`; returns the failures.
fn run_case(kind: Engine, world: usize, case: &Case, seed: u64) -> Vec<String> {
    let devs: Vec<Device> = (0..world).map(|i| Device::new(i).unwrap()).collect();
    let mut shape = case.shape(world);
    if case.top_k == 0 {
        shape.top_k = shape.experts.min(2);
    }
    let mut rng = Rng(seed | 1);
    let steps: Vec<StepInputs> = (0..STEPS)
        .map(|_| gen_step(&shape, case.routing, &mut rng))
        .collect();
    let max = max_rows(&shape, &steps);
    shape.capacity = ((max as f32 * case.capacity_fraction) as usize).max(1);
    let mut expect = MoeStatus::default();
    if case.capacity_fraction < 1.0 {
        expect.0 |= MoeStatus::OVERFLOW;
    }
    if case.routing == Routing::WithBadId {
        expect.0 |= MoeStatus::BAD_EXPERT;
    }
    let label = format!(
        "[{} W={world} {}] T={} H={} F={} K={} E={} C={}",
        kind.name(),
        case.name,
        shape.tokens,
        shape.hidden,
        shape.out_hidden,
        shape.top_k,
        shape.experts,
        shape.capacity
    );
    let transports = make_transports(kind, &devs, &shape);
    let barrier = TimedBarrier::new(world);
    let delivered = Mutex::new(vec![HashSet::new(); world]);
    let team = Team {
        barrier: Some(&barrier),
        delivered: Some(&delivered),
    };
    let abort = std::sync::atomic::AtomicBool::new(false);
    let errs: Vec<Vec<String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = transports
            .into_iter()
            .zip(&devs)
            .map(|(mut t, dev)| {
                let (team, steps, label, abort) = (&team, &steps, &label, &abort);
                scope.spawn(move || {
                    use std::sync::atomic::Ordering::SeqCst;
                    let stream = Stream::new(dev).unwrap();
                    let bufs = RankBufs::new(dev, &shape);
                    let r = t.rank();
                    let mut errs = Vec::new();
                    for (i, inp) in steps.iter().enumerate() {
                        // A failure is raised before this barrier, so every rank decides alike.
                        if let Err(e) = team.sync() {
                            errs.push(format!("{label} rank {r} step {i}: {e}"));
                            break;
                        }
                        if abort.load(SeqCst) {
                            break;
                        }
                        match rank_step(t.as_mut(), &stream, &bufs, inp, team, expect) {
                            Ok(msg) => println!("{label} step {i}: {msg}"),
                            Err(e) => {
                                let e = format!("{label} rank {r} step {i}: {e}");
                                println!("FAILED {e}");
                                errs.push(e);
                                abort.store(true, SeqCst);
                            }
                        }
                    }
                    // Nobody drops its transport while a peer may still use its memory.
                    let _ = stream.synchronize();
                    let _ = team.sync();
                    drop(t);
                    errs
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec!["rank thread panicked".into()])
            })
            .collect()
    });
    errs.into_iter().flatten().collect()
}

fn run_all(kind: Engine, cases: &[Case]) {
    let Some(n) = device_count() else { return };
    let seed = fresh_seed();
    println!(
        "{} seed {seed} (set MESHFLOW_MOE_SEED to replay)",
        kind.name()
    );
    let mut errs = Vec::new();
    for world in [1, 2] {
        if world > n {
            println!("skipped W={world}: only {n} GPU(s) visible");
            continue;
        }
        for (i, case) in cases.iter().enumerate() {
            if case.routing == Routing::Skewed && world == 1 {
                continue;
            }
            errs.extend(run_case(kind, world, case, seed ^ (i as u64 * 0x1234_5678)));
        }
    }
    assert!(
        errs.is_empty(),
        "{} failure(s):\n{}",
        errs.len(),
        errs.join("\n")
    );
}

#[test]
fn nccl_transport_matches_reference() {
    run_all(Engine::Nccl, &cases());
}

#[test]
fn nvlink_transport_matches_reference() {
    run_all(Engine::Nvlink, &cases());
}

#[test]
fn overflow_and_bad_ids_are_flagged_without_corruption() {
    let case = Case {
        name: "overflow + bad id",
        experts_per_rank: None,
        experts: 16,
        top_k: 4,
        tokens: 64,
        hidden: 128,
        out_hidden: 128,
        dtype: DType::BF16,
        routing: Routing::WithBadId,
        capacity_fraction: 0.5,
    };
    for kind in [Engine::Nccl, Engine::Nvlink] {
        run_all(kind, &[case]);
    }
}

#[test]
fn phases_out_of_order_are_errors() {
    let Some(_) = device_count() else { return };
    let dev = Device::new(0).unwrap();
    let shape = Case {
        experts_per_rank: Some(4),
        ..cases()[2]
    }
    .shape(1);
    let mut t = NvlinkMoe::team(std::slice::from_ref(&dev), &shape)
        .unwrap()
        .remove(0);
    let stream = Stream::new(&dev).unwrap();
    let err = t.dispatch_recv(&stream).unwrap_err().to_string();
    assert!(err.contains("out of order"), "{err}");
    let small = DeviceBuffer::alloc(&dev, 4).unwrap();
    let err = t
        .dispatch_send(&stream, &small, &small)
        .unwrap_err()
        .to_string();
    assert!(err.contains("dispatch input x"), "{err}");
}

// ---- multi-process NVLink (CUDA IPC) -----------------------------------------------------------

const IPC_RANK: &str = "MESHFLOW_MOE_IPC_RANK";
const IPC_DIR: &str = "MESHFLOW_MOE_IPC_DIR";

fn ipc_shape() -> MoeShape {
    MoeShape {
        world: 2,
        experts: 64,
        top_k: 4,
        tokens: 96,
        hidden: 512,
        out_hidden: 512,
        capacity: 0,
        dtype: DType::BF16,
    }
}

#[test]
fn nvlink_ipc_two_processes() {
    let Some(n) = device_count() else { return };
    if n < 2 {
        println!("skipped: the IPC test needs 2 GPUs, {n} visible");
        return;
    }
    let seed = fresh_seed();
    let dir = std::env::temp_dir().join(format!("meshflow-moe-ipc-{}-{seed}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|r| {
            std::process::Command::new(&exe)
                .args([
                    "--ignored",
                    "--exact",
                    "ipc_child_rank",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(IPC_RANK, r.to_string())
                .env(IPC_DIR, &dir)
                .env("MESHFLOW_MOE_SEED", seed.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut done = [false, false];
    while done.iter().any(|d| !d) && Instant::now() < deadline {
        for (c, d) in children.iter_mut().zip(done.iter_mut()) {
            *d = *d || c.try_wait().unwrap().is_some();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut ok = true;
    for (r, mut c) in children.into_iter().enumerate() {
        if c.try_wait().unwrap().is_none() {
            let _ = c.kill();
        }
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("ipc ")).collect();
        println!(
            "child {r} ({}): {}\n{}",
            out.status,
            lines.join("\n"),
            if out.status.success() {
                String::new()
            } else {
                format!("{text}\n{err}")
            }
        );
        ok &= out.status.success();
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ok, "an IPC child failed (output above)");
}

/// The child process of [`nvlink_ipc_two_processes`] (does nothing unless started by it).
#[test]
#[ignore = "child process of nvlink_ipc_two_processes"]
fn ipc_child_rank() {
    let (Ok(rank), Ok(dir)) = (std::env::var(IPC_RANK), std::env::var(IPC_DIR)) else {
        println!("not started by nvlink_ipc_two_processes: nothing to do");
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let dir = std::path::PathBuf::from(dir);
    let mut shape = ipc_shape();
    let mut rng = Rng(fresh_seed() | 1);
    let steps: Vec<StepInputs> = (0..STEPS)
        .map(|_| gen_step(&shape, Routing::Uniform, &mut rng))
        .collect();
    shape.capacity = max_rows(&shape, &steps).max(1);
    let dev = Device::new(rank).unwrap();
    let mut t = NvlinkMoe::new_ipc(&dev, &shape, rank).unwrap();
    let mine = t.export_handles().unwrap();
    let tmp = dir.join(format!("rank{rank}.tmp"));
    std::fs::write(&tmp, &mine).unwrap();
    std::fs::rename(&tmp, dir.join(format!("rank{rank}.bin"))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let handles: Vec<Vec<u8>> = (0..shape.world)
        .map(|r| loop {
            if let Ok(b) = std::fs::read(dir.join(format!("rank{r}.bin"))) {
                break b;
            }
            assert!(
                Instant::now() < deadline,
                "rank {r} never published its handles"
            );
            std::thread::sleep(Duration::from_millis(20));
        })
        .collect();
    t.import_handles(&handles).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let bufs = RankBufs::new(&dev, &shape);
    let team = Team {
        barrier: None,
        delivered: None,
    };
    let mut failed = Vec::new();
    for (i, inp) in steps.iter().enumerate() {
        match rank_step(&mut t, &stream, &bufs, inp, &team, MoeStatus::default()) {
            Ok(msg) => println!("ipc rank {rank} step {i}: {msg}"),
            Err(e) => {
                println!("ipc rank {rank} step {i}: FAILED {e}");
                failed.push(e);
            }
        }
    }
    // Let the peer finish with this process's memory before exiting.
    std::fs::write(dir.join(format!("done{rank}")), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..shape.world).any(|r| !dir.join(format!("done{r}")).exists())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

// ---- latency ---------------------------------------------------------------------------------

/// Dispatch / combine latency at T = 128 and 4096 tokens per rank (H = 7168, K = 8, E = 256,
/// bf16) on every visible GPU (at most 8), both transports. Run with `--ignored`.
#[test]
#[ignore = "benchmark: run explicitly"]
fn moe_latency_table() {
    let Some(n) = device_count() else { return };
    let devs: Vec<Device> = (0..n.min(8)).map(|i| Device::new(i).unwrap()).collect();
    println!("MoE latency on {} x {}", devs.len(), devs[0].name());
    let mut all = Vec::new();
    for tokens in [128, 4096] {
        let case = BenchCase::deepseek(tokens);
        all.push(bench_moe(&devs, &case, NvlinkMoe::team).unwrap());
        all.push(bench_moe(&devs, &case, NcclMoe::team).unwrap());
    }
    println!("{}", format_bench_table(&all));
    assert!(
        all.iter().all(|r| r.status_ok),
        "a bench run flagged overflow or a timeout"
    );
}
