//! GPU tests of the MoE dispatch/combine transports against the CPU reference. Without a GPU
//! each test prints `skipped: ...` and returns; team sizes needing more GPUs than visible are
//! skipped with a message. Inputs are fresh random values per run (the seed is printed; set
//! `MESHFLOW_MOE_SEED` to replay). `MESHFLOW_MOE_WORLDS=2` runs only the 2-rank teams (quick).
//! The fused kernels' test runs a covering set of their variants (every value of every option),
//! all of them with `MESHFLOW_MOE_ALL_VARIANTS=1`, those whose name contains
//! `MESHFLOW_MOE_VARIANT_FILTER` only when set (it prints which run and why).
//!
//! Every case runs 7 steps on the same transport objects (epoch reuse), covering the weights
//! at dispatch and at combine, with and without padding zeroing, into the engine's own outputs
//! and into caller-given ones poisoned (NaN) before the dispatch and again before the combine
//! (which must not read them), and checks per rank and step:
//! per-expert counts, per-expert row multisets (routing and row bits, FP8 rows dequantized),
//! zero padding when asked, the rows received from each source (the deduplicated traffic), the
//! status word, and the combine output **bit for bit** (the documented summation order).
#![cfg(feature = "cuda")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::too_many_arguments,
    clippy::print_stdout
)]

mod moe_common;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use meshflow_kernels::fp8::Fp8Scales;
use meshflow_kernels::moe::{
    reference_combine, round_to, CombineRequest, DispatchOutputs, DispatchRequest, FusedOptions,
    MoeKernels, MoeShape, MoeStatus, MoeTransport, MoeWire, NcclMoe, NvlinkMoe,
};
use meshflow_kernels::{BinaryOp, DType, Device, DeviceBuffer, Stream};
use moe_common::*;

const STEPS: usize = 7;

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
    wire: MoeWire,
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

const FP8_BLOCK: MoeWire = MoeWire::Fp8E4m3(Fp8Scales::Block128);
const FP8_TOKEN: MoeWire = MoeWire::Fp8E4m3(Fp8Scales::PerToken);

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
        wire: MoeWire::Native,
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
            name: "E=2048 K=8 f32 (E > 1024, empty experts)",
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
            name: "E=256 K=8 bf16 fp8 per-token, rank 1 receives nothing",
            routing: Routing::NothingForRank1,
            wire: FP8_TOKEN,
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
        Case {
            name: "E=256 K=8 bf16 fp8 block128",
            tokens: 128,
            hidden: 1024,
            out_hidden: 1024,
            wire: FP8_BLOCK,
            ..base
        },
        Case {
            name: "E=64 K=2 f16 fp8 per-token F<H",
            experts: 64,
            top_k: 2,
            hidden: 272,
            out_hidden: 128,
            dtype: DType::F16,
            wire: FP8_TOKEN,
            ..base
        },
        Case {
            name: "E=32 K=8 bf16 fp8 block128 skewed",
            experts: 32,
            tokens: 40,
            hidden: 512,
            out_hidden: 512,
            wire: FP8_BLOCK,
            routing: Routing::Skewed,
            ..base
        },
        // Rows longer than one round of a block's vector loads, and more rows than blocks
        // (the grid-stride loops of the row kernels run several rows per block).
        Case {
            name: "E=256 K=8 bf16 T=600 H=7168 (several rows per block)",
            tokens: 600,
            hidden: 7168,
            out_hidden: 7168,
            ..base
        },
        Case {
            name: "E=64 K=4 f32 T=300 H=4608 (two rounds of vector loads)",
            experts: 64,
            top_k: 4,
            tokens: 300,
            hidden: 4608,
            out_hidden: 4608,
            dtype: DType::F32,
            ..base
        },
        Case {
            name: "E=256 K=8 bf16 fp8 block128 T=300 H=9216 (two rounds)",
            tokens: 300,
            hidden: 9216,
            out_hidden: 1024,
            wire: FP8_BLOCK,
            ..base
        },
        Case {
            name: "E=256 K=8 f16 fp8 per-token H=9216 (two rounds)",
            tokens: 96,
            hidden: 9216,
            out_hidden: 2048,
            dtype: DType::F16,
            wire: FP8_TOKEN,
            ..base
        },
        // More than 2048 tokens: the fused kernels take two tokens per chunk, the last one
        // partial.
        Case {
            name: "E=256 K=8 bf16 T=2601 (chunks of two tokens)",
            tokens: 2601,
            hidden: 512,
            out_hidden: 256,
            ..base
        },
        // K > 32: the routing warp takes the k in several chunks of 32.
        Case {
            name: "E=128 K=40 bf16 (k in two chunks)",
            experts: 128,
            top_k: 40,
            ..base
        },
        Case {
            name: "E=64 K=36 f16 fp8 per-token (k in two chunks)",
            experts: 64,
            top_k: 36,
            dtype: DType::F16,
            wire: FP8_TOKEN,
            ..base
        },
        Case {
            name: "E=8 K=1 f32 fp8 per-token",
            experts: 8,
            top_k: 1,
            dtype: DType::F32,
            wire: FP8_TOKEN,
            ..base
        },
    ]
}

/// The MoE engines under test.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Engine {
    Nccl,
    /// NVLink with the kernels `MESHFLOW_MOE_KERNELS` picks (default: fused).
    Nvlink,
    /// NVLink with the split (send + receive) kernels, whatever the environment says.
    NvlinkSplit,
    /// NVLink with the fused kernels and these variants, whatever the environment says.
    NvlinkFused(FusedOptions),
    /// NVLink with the fused kernels, each rank with variants of its own
    /// ([`mixed_options`], rotated by the offset): different dispatch kernels and dispatch
    /// chunks, different combine kernels.
    NvlinkMixed(usize),
}

/// The fused kernels' variants of rank `r` in [`Engine::NvlinkMixed`] (`r` plus the engine's
/// offset): the dispatch kernel, the dispatch's tokens per chunk (1, 2, 3, 5) and the combine
/// kernel all differ between neighbouring ranks. The dispatch releases a flag per token, so neither its kernel nor its
/// chunk needs to agree; the combine's chunk (from the environment) is the same everywhere.
fn mixed_options(r: usize) -> FusedOptions {
    use meshflow_kernels::moe::FusedCombineKernel::{OnePass, TwoPass, Warp as WarpCombine};
    use meshflow_kernels::moe::FusedDispatchKernel::{Generic, PerWire, Warp};
    let (dispatch, chunk) = [(Warp, 1), (PerWire, 2), (Generic, 3), (Warp, 5)][r % 4];
    FusedOptions {
        dispatch,
        combine: [OnePass, TwoPass, WarpCombine][r % 3],
        block: None,
        dispatch_chunk: Some(chunk),
    }
}

impl Engine {
    fn name(self) -> String {
        match self {
            Engine::Nccl => "nccl".into(),
            Engine::Nvlink => "nvlink".into(),
            Engine::NvlinkSplit => "nvlink-v1".into(),
            Engine::NvlinkFused(o) => format!("nvlink-v2-{}", o.name()),
            Engine::NvlinkMixed(o) => format!("nvlink-v2-mixed{o}"),
        }
    }
}

fn make_transports(
    kind: Engine,
    devs: &[Device],
    shape: &MoeShape,
    wire: MoeWire,
) -> Vec<Box<dyn MoeTransport>> {
    fn boxed<T: MoeTransport + 'static>(v: Vec<T>) -> Vec<Box<dyn MoeTransport>> {
        v.into_iter()
            .map(|t| Box::new(t) as Box<dyn MoeTransport>)
            .collect()
    }
    match kind {
        Engine::Nvlink => boxed(NvlinkMoe::team_with_wire(devs, shape, wire).unwrap()),
        Engine::NvlinkSplit | Engine::NvlinkFused(_) | Engine::NvlinkMixed(_) => {
            let generation = if kind == Engine::NvlinkSplit {
                MoeKernels::Split
            } else {
                MoeKernels::Fused
            };
            let mut team = NvlinkMoe::team_with_wire(devs, shape, wire).unwrap();
            for (r, t) in team.iter_mut().enumerate() {
                t.set_kernel_generation(generation).unwrap();
                match kind {
                    Engine::NvlinkFused(o) => t.set_fused_options(o).unwrap(),
                    Engine::NvlinkMixed(o) => t.set_fused_options(mixed_options(r + o)).unwrap(),
                    _ => {}
                }
            }
            boxed(team)
        }
        Engine::Nccl => boxed(NcclMoe::team_with_wire(devs, shape, wire).unwrap()),
    }
}

/// The shape of `case` on `world` ranks with the capacity of its generated steps.
fn sized(case: &Case, world: usize, seed: u64) -> (MoeShape, Vec<StepInputs>) {
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
    (shape, steps)
}

/// Runs `case` on `world` GPUs with `kind`; returns the failures.
fn run_case(kind: Engine, world: usize, case: &Case, seed: u64) -> Vec<String> {
    let devs: Vec<Device> = (0..world).map(|i| Device::new(i).unwrap()).collect();
    let (shape, steps) = sized(case, world, seed);
    let mut expect = MoeStatus::default();
    if case.capacity_fraction < 1.0 {
        expect.0 |= MoeStatus::OVERFLOW;
    }
    if case.routing == Routing::WithBadId {
        expect.0 |= MoeStatus::BAD_EXPERT;
    }
    let label = format!(
        "[{} W={world} {}] T={} H={} F={} K={} E={} C={} {}",
        kind.name(),
        case.name,
        shape.tokens,
        shape.hidden,
        shape.out_hidden,
        shape.top_k,
        shape.experts,
        shape.capacity,
        case.wire.name()
    );
    let transports = make_transports(kind, &devs, &shape, case.wire);
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
                        let mode = StepMode::of_step(i);
                        match rank_step(t.as_mut(), &stream, &bufs, inp, team, expect, mode) {
                            Ok(msg) => println!("{label} step {i} {mode:?}: {msg}"),
                            Err(e) => {
                                let e = format!("{label} rank {r} step {i} {mode:?}: {e}");
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

/// Restricts the team sizes to the comma-separated list it holds (e.g. `2`, for a quick run).
const WORLDS_ENV: &str = "MESHFLOW_MOE_WORLDS";

/// Team sizes to run: 1, 2, 4, 8 as far as GPUs are visible (and `MESHFLOW_MOE_WORLDS` lists).
fn worlds(n: usize) -> Vec<usize> {
    let all = [1, 2, 4, 8];
    for w in all.iter().filter(|&&w| w > n) {
        println!("skipped W={w}: only {n} GPU(s) visible");
    }
    let listed: Option<Vec<usize>> = std::env::var(WORLDS_ENV)
        .ok()
        .map(|v| v.split(',').filter_map(|w| w.trim().parse().ok()).collect());
    all.into_iter()
        .filter(|&w| w <= n)
        .filter(|w| match &listed {
            Some(l) if !l.contains(w) => {
                println!("skipped W={w}: not in {WORLDS_ENV}");
                false
            }
            _ => true,
        })
        .collect()
}

fn run_all(kind: Engine, cases: &[Case]) {
    let Some(n) = device_count() else { return };
    let seed = fresh_seed();
    println!(
        "{} seed {seed} (set MESHFLOW_MOE_SEED to replay)",
        kind.name()
    );
    let mut errs = Vec::new();
    for world in worlds(n) {
        for (i, case) in cases.iter().enumerate() {
            if matches!(case.routing, Routing::Skewed | Routing::NothingForRank1) && world == 1 {
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
fn nvlink_split_kernels_match_reference() {
    run_all(Engine::NvlinkSplit, &cases());
}

/// Set to 1: the fused kernels' test runs every combination of variants
/// ([`FusedOptions::all`]), not only the covering set.
const ALL_VARIANTS_ENV: &str = "MESHFLOW_MOE_ALL_VARIANTS";
/// Runs only the combinations whose name contains this text (e.g. `448x1`, `onepass`).
const VARIANT_FILTER_ENV: &str = "MESHFLOW_MOE_VARIANT_FILTER";

/// The option values a combination runs (`dispatch Generic`, `block shape 448x1`, ...).
fn option_values(o: &FusedOptions) -> Vec<String> {
    let mut v = vec![
        format!("dispatch {:?}", o.dispatch),
        format!("combine {:?}", o.combine),
    ];
    if o.combine.is_block() {
        let b = o.block_for(o.combine);
        v.push(format!("block shape {}", b.shape.name()));
        v.push(format!(
            "prefetch {}",
            if b.prefetch { "on" } else { "off" }
        ));
    }
    v
}

/// The variant combinations the fused kernels' test runs, each printed with why it runs (the
/// option values it is the first to run) or why not: by default the covering set
/// ([`FusedOptions::covering`]: every value of every option at least once), every combination
/// with `MESHFLOW_MOE_ALL_VARIANTS=1`; then only those whose name contains
/// `MESHFLOW_MOE_VARIANT_FILTER` if set.
fn fused_variants() -> Vec<FusedOptions> {
    let all = FusedOptions::all();
    let set = if std::env::var(ALL_VARIANTS_ENV).is_ok_and(|v| v.trim() == "1") {
        println!(
            "{ALL_VARIANTS_ENV}=1: all {} combinations of the fused kernels' variants",
            all.len()
        );
        all
    } else {
        let set = FusedOptions::covering();
        println!(
            "the covering set of the fused kernels' variants: {} of {} combinations, running \
             every value of every option (dispatch kernel, combine kernel, block shape, \
             prefetch) at least once; {ALL_VARIANTS_ENV}=1 runs all of them",
            set.len(),
            all.len()
        );
        set
    };
    let filter = std::env::var(VARIANT_FILTER_ENV).ok();
    let mut seen = HashSet::new();
    set.into_iter()
        .filter(|o| {
            let name = o.name();
            if let Some(f) = filter.as_deref().filter(|f| !name.contains(f)) {
                println!("variant {name}: skipped ({VARIANT_FILTER_ENV}={f})");
                return false;
            }
            let new: Vec<String> = option_values(o)
                .into_iter()
                .filter(|v| seen.insert(v.clone()))
                .collect();
            if new.is_empty() {
                println!("variant {name}: runs (its values all ran before; every combination)");
            } else {
                println!("variant {name}: runs (first with {})", new.join(", "));
            }
            true
        })
        .collect()
}

#[test]
fn nvlink_fused_kernels_match_reference() {
    // The variants of the fused kernels (per-wire, generic or warp dispatch; two-pass, one-pass
    // or warp combine; the block combine's shapes), each bit-identical to the reference.
    let Some(_) = device_count() else { return };
    let variants = fused_variants();
    assert!(
        !variants.is_empty(),
        "{VARIANT_FILTER_ENV} left no variant to run"
    );
    for options in variants {
        run_all(Engine::NvlinkFused(options), &cases());
    }
}

#[test]
fn nvlink_ranks_with_their_own_dispatch_kernels_and_chunks_match_reference() {
    // Offsets 0 and 2: two ranks run (warp, 1; wire, 2) and (generic, 3; warp, 5).
    run_all(Engine::NvlinkMixed(0), &cases());
    run_all(Engine::NvlinkMixed(2), &cases());
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
        wire: FP8_BLOCK,
        routing: Routing::WithBadId,
        capacity_fraction: 0.5,
    };
    for kind in [Engine::Nccl, Engine::Nvlink] {
        run_all(
            kind,
            &[
                case,
                Case {
                    wire: MoeWire::Native,
                    ..case
                },
            ],
        );
    }
}

#[test]
fn phases_out_of_order_and_misplaced_weights_are_errors() {
    let Some(_) = device_count() else { return };
    let dev = Device::new(0).unwrap();
    let shape = Case {
        experts_per_rank: Some(4),
        ..cases()[2]
    }
    .shape(1);
    let shape = MoeShape {
        capacity: 64,
        ..shape
    };
    let mut t = NvlinkMoe::team(std::slice::from_ref(&dev), &shape)
        .unwrap()
        .remove(0);
    let stream = Stream::new(&dev).unwrap();
    let err = t.dispatch_recv(&stream).unwrap_err().to_string();
    assert!(err.contains("out of order"), "{err}");
    let small = DeviceBuffer::alloc(&dev, 4).unwrap();
    let req = DispatchRequest {
        x: &small,
        topk_idx: &small,
        weights: None,
        zero_padding: false,
        outputs: None,
    };
    let err = t.dispatch_send(&stream, &req).unwrap_err().to_string();
    assert!(err.contains("dispatch input x"), "{err}");
    // Caller outputs of the wrong size, misaligned or overlapping are refused before any work.
    {
        let bufs = RankBufs::new(&dev, &shape);
        let with = |ex: &DeviceBuffer, counts: &DeviceBuffer, routing: &DeviceBuffer| {
            let mut t = NvlinkMoe::team(std::slice::from_ref(&dev), &shape)
                .unwrap()
                .remove(0);
            let req = DispatchRequest {
                x: &bufs.x,
                topk_idx: &bufs.idx,
                weights: None,
                zero_padding: false,
                outputs: Some(DispatchOutputs {
                    expert_x: ex,
                    expert_counts: counts,
                    routing,
                }),
            };
            t.dispatch_send(&stream, &req).unwrap_err().to_string()
        };
        let err = with(&bufs.ex, &small, &bufs.routing);
        assert!(err.contains("dispatch output expert_counts"), "{err}");
        let big = DeviceBuffer::alloc(&dev, bufs.routing.len() + 8).unwrap();
        let err = with(
            &bufs.ex,
            &bufs.counts,
            &big.view(4, bufs.routing.len()).unwrap(),
        );
        assert!(err.contains("not 8-byte aligned"), "{err}");
        let err = with(
            &bufs.ex,
            &bufs.counts,
            &bufs.ex.view(0, bufs.routing.len()).unwrap(),
        );
        assert!(err.contains("overlaps"), "{err}");
    }
    // A combine without weights after a dispatch without weights is refused.
    let bufs = RankBufs::new(&dev, &shape);
    let req = DispatchRequest {
        x: &bufs.x,
        topk_idx: &bufs.idx,
        weights: None,
        zero_padding: false,
        outputs: None,
    };
    bufs.idx.zero(&stream).unwrap();
    t.dispatch_with(&stream, &req).unwrap();
    let creq = CombineRequest {
        expert_y: &bufs.y,
        weights: None,
    };
    let err = t.combine_send(&stream, &creq).unwrap_err().to_string();
    assert!(err.contains("needs weights"), "{err}");
    // FP8 needs a width the scales divide.
    let odd = MoeShape {
        hidden: 100,
        ..shape
    };
    let err = NvlinkMoe::team_with_wire(std::slice::from_ref(&dev), &odd, FP8_BLOCK)
        .err()
        .expect("H = 100 cannot have 128-channel scales")
        .to_string();
    assert!(err.contains("divisible by 128"), "{err}");
    stream.synchronize().unwrap();
}

// ---- a whole step in a CUDA graph --------------------------------------------------------------

/// Captures one NVLink step per rank (dispatch with the weights, the expert `y = x * x` by the
/// elementwise kernel, combine) in a CUDA graph, then replays it with fresh inputs uploaded in
/// place, checking every replay bit for bit: no host work or synchronization inside the step.
#[test]
fn nvlink_step_replays_in_a_cuda_graph() {
    let Some(n) = device_count() else { return };
    let world = n.min(2);
    if world < 2 {
        println!("note: 1 GPU visible; the graph test runs a team of one");
    }
    let seed = fresh_seed();
    println!("graph seed {seed}");
    let devs: Vec<Device> = (0..world).map(|i| Device::new(i).unwrap()).collect();
    for wire in [MoeWire::Native, FP8_BLOCK] {
        let case = Case {
            name: "graph",
            experts_per_rank: None,
            experts: 64,
            top_k: 4,
            tokens: 48,
            hidden: 256,
            out_hidden: 256,
            dtype: DType::BF16,
            wire,
            routing: Routing::Uniform,
            capacity_fraction: 1.0,
        };
        let (mut shape, _) = sized(&case, world, seed);
        // Replays bring new routings: room for any of them.
        shape.capacity = world * shape.tokens;
        let mut rng = Rng(seed | 3);
        let replays: Vec<StepInputs> = (0..3)
            .map(|_| gen_step(&shape, Routing::Uniform, &mut rng))
            .collect();
        let ranks = NvlinkMoe::team_with_wire(&devs, &shape, wire).unwrap();
        let barrier = TimedBarrier::new(world);
        let errs: Vec<Vec<String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .zip(&devs)
                .map(|(mut t, dev)| {
                    let (barrier, replays) = (&barrier, &replays);
                    scope.spawn(move || graph_rank(&mut t, dev, barrier, replays))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| vec!["rank panicked".into()]))
                .collect()
        });
        let errs: Vec<String> = errs.into_iter().flatten().collect();
        assert!(errs.is_empty(), "{wire:?}:\n{}", errs.join("\n"));
    }
}

fn graph_rank(
    t: &mut NvlinkMoe,
    dev: &Device,
    barrier: &TimedBarrier,
    replays: &[StepInputs],
) -> Vec<String> {
    let s = *t.shape();
    let wire = t.wire();
    let r = t.rank();
    let stream = Stream::new(dev).unwrap();
    let bufs = RankBufs::new(dev, &s);
    let kernels = dev.kernels();
    let mut errs = Vec::new();
    let step = |t: &mut NvlinkMoe| -> Result<(), String> {
        let req = DispatchRequest {
            x: &bufs.x,
            topk_idx: &bufs.idx,
            weights: Some(&bufs.w),
            zero_padding: false,
            outputs: None,
        };
        t.dispatch_with(&stream, &req).map_err(|e| e.to_string())?;
        let ex = t.expert_x().map_err(|e| e.to_string())?.clone();
        kernels
            .binary(&stream, BinaryOp::Mul, s.dtype, &ex, &ex, &bufs.y)
            .map_err(|e| e.to_string())?;
        let creq = CombineRequest {
            expert_y: &bufs.y,
            weights: None,
        };
        t.combine_with(&stream, &creq, &bufs.out)
            .map_err(|e| e.to_string())
    };
    // One plain step first (compiles the kernels, which must not happen during capture).
    let upload = |inp: &StepInputs| {
        upload_floats(&stream, &bufs.x, s.dtype, &inp.x[r]);
        bufs.idx.upload(&stream, &inp.idx[r]).unwrap();
        bufs.w.upload(&stream, &inp.w[r]).unwrap();
        stream.synchronize().unwrap();
    };
    upload(&replays[0]);
    let warm = barrier.wait().and_then(|()| step(t));
    let _ = stream.synchronize();
    if let Err(e) = warm {
        let _ = barrier.wait();
        return vec![format!("rank {r}: warm-up step: {e}")];
    }
    stream.begin_capture().unwrap();
    let captured = step(t);
    let graph = stream.end_capture();
    let graph = match (captured, graph) {
        (Ok(()), Ok(g)) => Some(g),
        (c, g) => {
            errs.push(format!(
                "rank {r}: capture failed: {:?} / {:?}",
                c.err(),
                g.err().map(|e| e.to_string())
            ));
            None
        }
    };
    for (i, inp) in replays.iter().enumerate() {
        if barrier.wait().is_err() || graph.is_none() {
            errs.push(format!("rank {r}: replay {i} not run"));
            break;
        }
        poison(&stream, s.dtype, &bufs.out);
        upload(inp);
        if barrier.wait().is_err() {
            break;
        }
        if let Some(g) = &graph {
            g.replay(&stream).unwrap();
        }
        stream.synchronize().unwrap();
        let out = download_floats(&stream, &bufs.out, s.dtype);
        let h = s.hidden;
        let want = reference_combine(&s, &inp.idx[r], &inp.w[r], |tt, _| {
            let row = wire
                .arrived_row(&s, &inp.x[r][tt * h..(tt + 1) * h])
                .unwrap();
            Some(row.iter().map(|v| round_to(s.dtype, v * v)).collect())
        })
        .unwrap();
        match out
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            None => println!("graph {} rank {r} replay {i}: bit-identical", wire.name()),
            Some(p) => errs.push(format!(
                "rank {r} replay {i}: out[{p}] = {}, want {}",
                out[p], want[p]
            )),
        }
        let st = t.status(&stream).unwrap();
        if !st.is_ok() {
            errs.push(format!("rank {r} replay {i}: status {:#x}", st.0));
        }
    }
    let _ = stream.synchronize();
    let _ = barrier.wait();
    drop(graph);
    errs
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
    let mut t = NvlinkMoe::new_ipc_with_wire(&dev, &shape, FP8_BLOCK, rank).unwrap();
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
        let mode = StepMode::of_step(i);
        match rank_step(
            &mut t,
            &stream,
            &bufs,
            inp,
            &team,
            MoeStatus::default(),
            mode,
        ) {
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

// The dispatch/combine latency table is a benchmark: `meshflow bench moe` and
// `bench/tests/bench_gpu/moe_latency.rs`.
