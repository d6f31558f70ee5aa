//! MoE dispatch/combine latency at T = 128 and 4096 tokens per rank (H = 7168, K = 8, E = 256,
//! bf16 and FP8 dispatch) on every visible GPU (at most 8), both transports. A benchmark: run with `--ignored`.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stdout)]

use meshflow::kernels::fp8::Fp8Scales;
use meshflow::kernels::moe::{MoeWire, NcclMoe, NvlinkMoe};
use meshflow::kernels::{Device, KernelError};
use meshflow_bench::moe::{measure_moe, moe_table, MoeCase};

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

#[test]
#[ignore = "benchmark: run explicitly"]
fn moe_latency_table() {
    let Some(n) = device_count() else { return };
    let devs: Vec<Device> = (0..n.min(8)).map(|i| Device::new(i).unwrap()).collect();
    println!("MoE latency on {} x {}", devs.len(), devs[0].name());
    let fp8_block = MoeWire::Fp8E4m3(Fp8Scales::Block128);
    let mut all = Vec::new();
    for tokens in [128, 4096] {
        for wire in [MoeWire::Native, fp8_block] {
            let case = MoeCase {
                wire,
                ..MoeCase::deepseek(tokens)
            };
            all.push(measure_moe(&devs, &case, NvlinkMoe::team_with_wire).unwrap());
            all.push(measure_moe(&devs, &case, NcclMoe::team_with_wire).unwrap());
        }
    }
    println!("{}", moe_table(&all));
    assert!(
        all.iter().all(|r| r.status_ok),
        "a bench run flagged overflow or a timeout"
    );
}
