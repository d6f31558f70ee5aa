//! Failures on GPUs are error values: no GPU or too few GPUs, a rank that fails while its peer
//! waits in a collective (the peer stops with an error naming it, no hang), and a registered
//! PTX kernel through `call_kernel`.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use meshflow::ir::DType;
use meshflow::runtime::cuda::{run_cuda, CudaKernels, CudaRunError, GridDims};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::RunInputs;
use support::*;

#[test]
fn more_ranks_than_gpus_is_an_error_value() {
    let h = host(
        "host one {\n  mesh m0 = $MESH\n  in a: f32[4] on m0\n  out b: f32[4] on m0\n  c0 = all_reduce(a -> b, team=slice(m0, DIDx), op=sum)\n  wait c0\n}\n",
        &[("MESH", iota(64))],
    );
    let inputs = per_rank_inputs(&h, 64, 1);
    match run_cuda(&h, RunInputs::PerRank(inputs), &cuda_options()) {
        Err(CudaRunError::TooFewDevices { needed, available }) => {
            assert_eq!(needed, 64);
            eprintln!("64 ranks on {available} GPUs: refused");
        }
        Err(CudaRunError::NoDevice(why)) => eprintln!("no GPU, as an error value: {why}"),
        other => panic!("expected TooFewDevices or NoDevice, got {other:?}"),
    }
}

#[test]
fn a_failing_rank_stops_its_peer_instead_of_hanging() {
    if skip_unless(2, "a_failing_rank_stops_its_peer_instead_of_hanging") {
        return;
    }
    let h = host(
        "host one {\n  mesh m0 = [0, 1]\n  in a: f32[1024] on m0\n  out b: f32[2048] on m0\n  c0 = all_gather(a -> b, team=slice(m0, DIDx))\n  wait c0\n}\n",
        &[],
    );
    let mut inputs = per_rank_inputs(&h, 2, 1);
    // Rank 1 is not given its input: it fails before posting, while rank 0 waits for it.
    inputs.insert(1, BTreeMap::new());
    let mut opts = cuda_options();
    opts.config.timeout = Duration::from_secs(20);
    let t0 = Instant::now();
    let err = run_cuda(&h, RunInputs::PerRank(inputs), &opts).expect_err("rank 1 has no input");
    let text = err.to_string();
    eprintln!("after {:?}: {text}", t0.elapsed());
    assert!(
        text.contains("rank 1") && text.contains("input `a`"),
        "{text}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    // The devices are usable again afterwards.
    let good = per_rank_inputs(&h, 2, 2);
    cpu_vs_cuda("all_gather after a failure", &h, 2, good);
}

#[test]
fn a_registered_ptx_kernel_runs_through_call_kernel() {
    if skip_unless(1, "a_registered_ptx_kernel_runs_through_call_kernel") {
        return;
    }
    let ptx = include_str!("../data/gpu/scale_f32.ptx");
    let mut kernels = CudaKernels::new();
    kernels.register("scale", ptx, "scale_f32", |_, outs, _| {
        GridDims::linear(outs[0].iter().product(), 128)
    });
    let h = host(
        "host k {\n  mesh m0 = [0]\n  in x: f32[3, 100] on m0\n  out y: f32[3, 100] on m0\n  out z: f32[3, 50] on m0\n  tensor xh: f32[3, 50] on m0\n  call_kernel(x -> y, kernel=\"scale\", args=[300, 3])\n  xh = shard_by_stream(x, axis=1, chunks=2, index=1)\n  call_kernel(xh -> z, kernel=\"scale\", args=[150, -2])\n}\n",
        &[],
    );
    let x = TensorData::random(DType::F32, &[3, 100], 5).unwrap();
    let xv = x.storage().to_f32_vec();
    let inputs = BTreeMap::from([(0usize, BTreeMap::from([("x".to_string(), x)]))]);
    let mut opts = cuda_options();
    opts.config.kernels = kernels;
    let out = run_cuda(&h, RunInputs::PerRank(inputs), &opts).expect("kernel runs");
    let y = out.outputs[&0]["y"].storage().to_f32_vec();
    let z = out.outputs[&0]["z"].storage().to_f32_vec();
    for (i, v) in xv.iter().enumerate() {
        assert_eq!(y[i], v * 3.0, "y[{i}]");
    }
    for r in 0..3 {
        for c in 0..50 {
            assert_eq!(z[r * 50 + c], xv[r * 100 + 50 + c] * -2.0, "z[{r}, {c}]");
        }
    }
}
