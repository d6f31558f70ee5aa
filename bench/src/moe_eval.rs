//! The evaluator path of `meshflow bench moe` (feature `cuda`): the lowered `moe_layer`
//! program's `moe_dispatch` and `moe_combine` instructions run by the evaluator on the GPUs of
//! this process (one thread per GPU), over a forced transport (`nvlink` or `nccl`), with the
//! same routing and capacity as the kernels' path ([`measure_moe`](crate::moe::measure_moe)).
//!
//! The program with both phases runs `steps` steps back to back per iteration (at most 5
//! warm-up and 20 timed iterations of the case's, since every iteration already holds `steps`
//! steps) with the evaluator's profile on: CUDA events recorded on the stream just before each
//! instruction's first device work and just after its last one. A phase's time is that
//! interval: per step the slowest rank's, then the median over the steps of every timed
//! iteration. This is the span the kernels' path times (an event before the dispatch's first
//! launch, one after it, one after the combine's last launch; per step the slowest rank, the
//! median over steps), so the two paths compare the same thing: a phase's device time as
//! issued, including any wait of the device for the host *within* the phase. What the
//! evaluator does between the phases and between steps (waits, allocations and releases of
//! the host program) is outside both spans; it shows in the step time (`step_us`: the run's
//! device time divided by its steps, which includes the device's idle time whenever the host
//! falls behind) and in the host's issue time per step (`host_us`), reported beside. (A
//! program of the dispatch alone cannot be repeated over NVLink: its buffers are free for the
//! next dispatch only after the combine.)
//!
//! With `graph`, each run records one step as a CUDA graph and replays it `steps` times (MoE
//! over NVLink keeps its step number on the device; NCCL's grouped send/recv within a node
//! replay too): the low-latency path, no host work between steps. `meshflow bench moe` runs
//! it for NVLink. The profile's events are event record nodes of the graph, given fresh
//! events before every replay, so the phases of every replay are measured the same way as
//! without a graph; the step time is the replays' device time divided by the replays.

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
    let options = CudaOptions {
        ranks: Some(world),
        config: CudaConfig {
            transport: Some(transport),
            steps: steps.max(1),
            timeout: Duration::from_secs(120),
            profile: true,
            graph,
            ..CudaConfig::default()
        },
    };
    let run = run_cuda_timed(
        &host,
        RunInputs::PerRank(per_rank),
        &options,
        case.warmup.min(5),
        case.iters.clamp(1, 20),
    )
    .map_err(|e| {
        let how = if graph { " (CUDA graph)" } else { "" };
        invalid(format!("{phases:?} over {transport}{how}: {e}"))
    })?;
    let dispatch_us = phase_us(&run.timed_intervals, world, "moe_dispatch")?;
    let combine_us = phase_us(&run.timed_intervals, world, "moe_combine")?;
    let step_us = Timing::from_times(&run.times_us).us;
    let host_us = Timing::from_times(&run.host_us).us;
    Ok(MoeResult {
        transport: match transport {
            Transport::Nvlink => "nvlink",
            _ => "nccl",
        },
        shape,
        wire: case.wire,
        traffic,
        dispatch_us,
        combine_us,
        status_ok: true,
        graph,
        step_us: Some(step_us),
        host_us: Some(host_us),
    })
}

/// The device time of instruction `name` in the profiles of the timed iterations: per step
/// (the `i`-th interval of `name` on every rank within one iteration) the slowest rank's, then
/// the median over the steps of every iteration.
fn phase_us(iterations: &[Vec<Interval>], world: usize, name: &str) -> Result<f64> {
    let mut slowest = Vec::new();
    for intervals in iterations {
        slowest.extend(slowest_per_step(intervals, world, name)?);
    }
    if slowest.is_empty() {
        return Err(invalid(format!(
            "MoE evaluator bench: the profile holds no timed iteration with `{name}`"
        )));
    }
    slowest.sort_by(f64::total_cmp);
    let us = slowest[slowest.len() / 2];
    if us > 0.0 {
        Ok(us)
    } else {
        Err(invalid(format!(
            "MoE evaluator bench: `{name}` took no time in the profile"
        )))
    }
}

/// Per step of one iteration (the `i`-th interval of `name` on every rank), the slowest
/// rank's time of instruction `name`.
fn slowest_per_step(intervals: &[Interval], world: usize, name: &str) -> Result<Vec<f64>> {
    let per_rank: Vec<Vec<f64>> = (0..world)
        .map(|rank| {
            let mut mine: Vec<&Interval> = intervals
                .iter()
                .filter(|i| i.rank == rank && i.name == name)
                .collect();
            mine.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
            mine.iter().map(|i| i.end_us - i.start_us).collect()
        })
        .collect();
    let steps = per_rank.first().map_or(0, Vec::len);
    if steps == 0 || per_rank.iter().any(|r| r.len() != steps) {
        let counts: Vec<usize> = per_rank.iter().map(Vec::len).collect();
        return Err(invalid(format!(
            "MoE evaluator bench: the profile holds {counts:?} `{name}` intervals per rank (the \
             same number of steps on every rank expected)"
        )));
    }
    Ok((0..steps)
        .map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow::runtime::backend::PreorderIndex;
    use meshflow::runtime::cuda::IntervalKind;

    fn interval(rank: usize, name: &'static str, start_us: f64, end_us: f64) -> Interval {
        Interval {
            rank,
            stream: 0,
            kind: IntervalKind::Comm,
            name,
            transport: None,
            preorder: PreorderIndex(0),
            iteration: Vec::new(),
            start_us,
            end_us,
        }
    }

    #[test]
    fn a_phase_is_the_median_over_steps_of_the_slowest_rank() {
        // Three steps; rank 1 is slower in step 0, rank 0 in step 2; the other op is ignored.
        let iv = vec![
            interval(0, "moe_dispatch", 0.0, 10.0),
            interval(0, "moe_combine", 10.0, 15.0),
            interval(0, "moe_dispatch", 20.0, 31.0),
            interval(0, "moe_dispatch", 40.0, 70.0),
            interval(1, "moe_dispatch", 0.0, 12.0),
            interval(1, "moe_dispatch", 20.0, 29.0),
            interval(1, "moe_dispatch", 40.0, 45.0),
        ];
        // Per step: max(10, 12) = 12, max(11, 9) = 11, max(30, 5) = 30; median 12.
        assert_eq!(
            phase_us(std::slice::from_ref(&iv), 2, "moe_dispatch").unwrap(),
            12.0
        );
        assert_eq!(
            phase_us(&[iv[..2].to_vec()], 1, "moe_combine").unwrap(),
            5.0
        );
        // A second iteration's steps join the same median: 9, 11, 12, 13, 14, 30 -> 13.
        let second = vec![
            interval(0, "moe_dispatch", 100.0, 109.0),
            interval(0, "moe_dispatch", 120.0, 133.0),
            interval(0, "moe_dispatch", 140.0, 154.0),
            interval(1, "moe_dispatch", 100.0, 108.0),
            interval(1, "moe_dispatch", 120.0, 121.0),
            interval(1, "moe_dispatch", 140.0, 141.0),
        ];
        assert_eq!(phase_us(&[iv, second], 2, "moe_dispatch").unwrap(), 13.0);
    }

    #[test]
    fn ranks_with_different_step_counts_or_no_intervals_are_errors() {
        let iv = vec![
            interval(0, "moe_dispatch", 0.0, 10.0),
            interval(0, "moe_dispatch", 20.0, 30.0),
            interval(1, "moe_dispatch", 0.0, 10.0),
        ];
        let e = phase_us(std::slice::from_ref(&iv), 2, "moe_dispatch")
            .unwrap_err()
            .to_string();
        assert!(e.contains("[2, 1]"), "{e}");
        let e = phase_us(&[iv], 2, "moe_combine").unwrap_err().to_string();
        assert!(e.contains("moe_combine"), "{e}");
        let e = phase_us(&[], 2, "moe_dispatch").unwrap_err().to_string();
        assert!(e.contains("no timed iteration"), "{e}");
    }
}
