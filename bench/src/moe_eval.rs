//! The evaluator path of `meshflow bench moe` (feature `cuda`): the lowered `moe_layer`
//! program's `moe_dispatch` and `moe_combine` instructions run by the evaluator on the GPUs of
//! this process (one thread per GPU), over a forced transport (`nvlink` or `nccl`), with the
//! same routing and capacity as the kernels' path ([`measure_moe`](crate::moe::measure_moe)).
//!
//! The program with both phases is timed, `steps` steps back to back per iteration (CUDA events
//! around the run, divided by the steps; the median over iterations per rank, then the slowest
//! rank; at most 5 warm-up and 20 timed iterations of the case's, since every iteration already
//! holds `steps` steps), with the evaluator's profile on. The step's time is split between the
//! phases in proportion to their device intervals in the profile (median per rank, slowest
//! rank), so the two figures add up to the step and each carries its share of the evaluator's
//! own per-instruction work (the waits, allocations and launches of the host program), which
//! the kernels' path does not have: the difference between the two paths is the evaluator's
//! overhead. (A program of the dispatch alone cannot be repeated over NVLink: its buffers are
//! free for the next dispatch only after the combine.)
//!
//! With `graph`, each run records one step as a CUDA graph and replays it `steps` times (MoE
//! over NVLink keeps its step number on the device; NCCL's grouped send/recv within a node
//! replay too): the low-latency path, no host work between steps. `meshflow bench moe` runs
//! it for NVLink. The step time is the replays' device time; a graph's
//! kernels cannot be timed one by one, so the step is split between the phases in the
//! proportion the same case's plain (profiled) run measured.

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow::ir::DType as IrDType;
use meshflow::kernels::fp8::Fp8Scales;
use meshflow::kernels::moe::{MoeShape, MoeTraffic, MoeWire};
use meshflow::kernels::{KernelError, Result};
use meshflow::runtime::cuda::{run_cuda_timed, CudaConfig, CudaOptions, Interval, Transport};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::RunInputs;

use crate::moe::{routing, shape_for, MoeCase, MoeResult};
use crate::moe_program::{MoeLayer, MoePhases};
use crate::stats::Timing;

fn invalid(e: impl std::fmt::Display) -> KernelError {
    KernelError::InvalidArgument(e.to_string())
}

/// The `wire=...` attributes of the dispatch instruction for `wire`.
fn wire_attrs(wire: MoeWire) -> &'static str {
    match wire {
        MoeWire::Native => "",
        MoeWire::Fp8E4m3(Fp8Scales::PerToken) => "wire=f8e4m3, scale=token",
        MoeWire::Fp8E4m3(Fp8Scales::Block128) => "wire=f8e4m3, scale=block128",
    }
}

/// Times `case` on `world` GPUs through the evaluator over `transport`, `steps` steps per
/// timed iteration; with `graph`, the steps are replays of a CUDA graph.
pub fn measure_moe_evaluator(
    world: usize,
    case: &MoeCase,
    transport: Transport,
    steps: usize,
    graph: bool,
) -> Result<MoeResult> {
    if world == 0 || case.iters == 0 || !case.experts.is_multiple_of(world) {
        return Err(invalid(format!(
            "MoE evaluator bench: {world} ranks, {} iterations, {} experts (a multiple of the \
             ranks)",
            case.iters, case.experts
        )));
    }
    let idx = routing(case, world, 0x5EED ^ case.tokens as u64);
    let shape: MoeShape = shape_for(case, world, &idx)?;
    let traffic = MoeTraffic::from_routing(&shape, case.wire, &idx)?;
    let layer = MoeLayer {
        world,
        tokens: case.tokens as u64,
        hidden: case.hidden as u64,
        top_k: case.top_k as u64,
        experts: case.experts as u64,
        capacity: shape.capacity as u64,
        wire: wire_attrs(case.wire),
        dtype: "bf16",
    };
    let (t, h, k) = (
        (case.tokens * world) as u64,
        case.hidden as u64,
        case.top_k as u64,
    );
    let flat: Vec<i64> = idx.iter().flatten().map(|&e| i64::from(e)).collect();
    let full = BTreeMap::from([
        (
            "x".to_string(),
            TensorData::random(IrDType::BF16, &[t, h], 0x3C).map_err(invalid)?,
        ),
        (
            "topk_idx".to_string(),
            TensorData::from_i64(IrDType::I32, &[t, k], &flat).map_err(invalid)?,
        ),
        (
            "topk_weights".to_string(),
            TensorData::from_f32(
                IrDType::F32,
                &[t, k],
                &vec![1.0 / k as f32; (t * k) as usize],
            )
            .map_err(invalid)?,
        ),
    ]);
    let phases = MoePhases::DispatchCombine;
    let (program, host) = layer.lowered(phases).map_err(invalid)?;
    let per_rank = scatter_inputs(&program, &full).map_err(invalid)?;
    let timed = |graph: bool| {
        let options = CudaOptions {
            ranks: Some(world),
            config: CudaConfig {
                transport: Some(transport),
                steps: steps.max(1),
                timeout: Duration::from_secs(120),
                profile: !graph,
                graph,
                ..CudaConfig::default()
            },
        };
        run_cuda_timed(
            &host,
            RunInputs::PerRank(per_rank.clone()),
            &options,
            case.warmup.min(5),
            case.iters.clamp(1, 20),
        )
        .map_err(|e| {
            let how = if graph { " (CUDA graph)" } else { "" };
            invalid(format!("{phases:?} over {transport}{how}: {e}"))
        })
    };
    // The plain run: its step time and the phases' shares of it.
    let run = timed(false)?;
    let dispatch = phase_us(&run.intervals, world, "moe_dispatch")?;
    let combine = phase_us(&run.intervals, world, "moe_combine")?;
    let share = dispatch / (dispatch + combine);
    let step_us = if graph {
        Timing::from_times(&timed(true)?.times_us).us
    } else {
        Timing::from_times(&run.times_us).us
    };
    let dispatch_us = step_us * share;
    Ok(MoeResult {
        transport: match transport {
            Transport::Nvlink => "nvlink",
            _ => "nccl",
        },
        shape,
        wire: case.wire,
        traffic,
        dispatch_us,
        combine_us: step_us - dispatch_us,
        status_ok: true,
        graph,
    })
}

/// The device time of instruction `name` in the profile: the median of its intervals on each
/// rank, the slowest rank.
fn phase_us(intervals: &[Interval], world: usize, name: &str) -> Result<f64> {
    let mut slowest = 0.0f64;
    for rank in 0..world {
        let mut us: Vec<f64> = intervals
            .iter()
            .filter(|i| i.rank == rank && i.name == name)
            .map(|i| i.end_us - i.start_us)
            .collect();
        if us.is_empty() {
            return Err(invalid(format!(
                "MoE evaluator bench: the profile of rank {rank} holds no `{name}`"
            )));
        }
        us.sort_by(f64::total_cmp);
        slowest = slowest.max(us[us.len() / 2]);
    }
    if slowest > 0.0 {
        Ok(slowest)
    } else {
        Err(invalid(format!(
            "MoE evaluator bench: `{name}` took no time in the profile"
        )))
    }
}
