//! The measuring tools on 2 GPUs, as smoke tests (no timed assertions): `meshflow calibrate`'s
//! measurement writes a profile the schedule search reads, and the evaluator path of `bench
//! moe` runs the lowered `moe_layer` program's dispatch and combine over both transports, plain
//! and as CUDA graph replays.
#![cfg(feature = "cuda")]

use crate::support::gpu::skip_unless;

use meshflow::kernels::fp8::Fp8Scales;
use meshflow::kernels::moe::MoeWire;
use meshflow::runtime::cuda::Transport;
use meshflow_bench::calibrate::{calibrate, CalibrateOptions, GpuTimer};
use meshflow_bench::moe::MoeCase;
use meshflow_bench::moe_eval::measure_moe_evaluator;

#[test]
fn calibrate_measures_a_profile_on_gpus() {
    if skip_unless(2, "calibrate_measures_a_profile_on_gpus") {
        return;
    }
    let device = meshflow::kernels::Device::name_of(0).unwrap();
    let o = CalibrateOptions {
        sizes: vec![1 << 20, 4 << 20],
        gemms: vec![(1024, 1024, 1024), (2048, 1024, 1024)],
        gemm_f32: (1024, 1024, 1024),
        add_elements: 1 << 20,
        ..CalibrateOptions::gpu(&device, 2)
    };
    let mut timer = GpuTimer {
        world: 2,
        warmup: 1,
        iterations: 2,
        steps: 2,
    };
    let p = calibrate(&mut timer, &o).unwrap();
    assert!(!p.provisional);
    assert_eq!(p.world, 2);
    let back = meshflow::Profile::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p);
    assert!(
        p.transports.contains_key("nccl"),
        "{:?}",
        p.transports.keys()
    );
    eprintln!("{}", p.to_json());
}

#[test]
fn the_moe_evaluator_path_runs_over_both_transports() {
    if skip_unless(2, "the_moe_evaluator_path_runs_over_both_transports") {
        return;
    }
    for wire in [MoeWire::Native, MoeWire::Fp8E4m3(Fp8Scales::Block128)] {
        let case = MoeCase {
            hidden: 1024,
            experts: 16,
            wire,
            iters: 3,
            warmup: 1,
            ..MoeCase::deepseek(64)
        };
        for (t, graph) in [
            (Transport::Nvlink, false),
            (Transport::Nvlink, true),
            (Transport::Nccl, false),
            (Transport::Nccl, true),
        ] {
            let r = measure_moe_evaluator(2, &case, t, 2, graph).unwrap();
            assert!(r.dispatch_us.is_finite() && r.dispatch_us > 0.0, "{r:?}");
            assert!(r.combine_us.is_finite() && r.combine_us > 0.0, "{r:?}");
            // Measured per phase for the graph rows too (not split from the plain run), and
            // the whole step and the host's issue time beside.
            for v in [r.step_us, r.host_us] {
                assert!(v.is_some_and(|v| v.is_finite() && v > 0.0), "{r:?}");
            }
            assert!(r.traffic.max_bytes().0 > 0, "{r:?}");
            assert_eq!(r.graph, graph);
            eprintln!(
                "{} {}: dispatch {:.1} us ({:.1} GB/s), combine {:.1} us ({:.1} GB/s)",
                r.label(),
                wire.name(),
                r.dispatch_us,
                r.dispatch_gbps(),
                r.combine_us,
                r.combine_gbps()
            );
        }
    }
}
