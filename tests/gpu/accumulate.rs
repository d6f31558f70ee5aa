//! `linear_accumulate` (`out += x @ w^T`, cuBLAS with `beta = 1`) on a GPU against the CPU
//! backend, on packed and strided outputs, in f32 and bf16; and the reduce-scatter ring that
//! accumulates in place on 2 GPUs (NCCL and the copy engine, 1, 2 and 4 pieces per step)
//! against the level-1 reference. Without the GPUs each test prints why it skipped.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda --test gpu accumulate`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use std::collections::BTreeMap;

use meshflow::ir::{DType, DeviceMesh, ParallelType::DIDx, ProgramBuilder};
use meshflow::passes::passes::lower_to_host::lower_planned;
use meshflow::pipeline::StreamSchedule;
use meshflow::runtime::cuda::{run_and_compare_cuda, Transport};
use meshflow::{compile, Decomposition, Options, Plan};
use support::*;

/// `y = acc; y += x @ w^T` into the whole of `y`, and into its strided right half
/// (`yr`, every other column block: staged through a packed copy).
const ACCUMULATE: &str = "host acc {
  mesh m0 = [0]
  in x: $T[96, 64] on m0
  in w: $T[80, 64] on m0
  in wr: $T[40, 64] on m0
  in acc: $T[96, 80] on m0
  out y: $T[96, 80] on m0
  out z: $T[96, 80] on m0
  tensor zr: $T[96, 40] on m0
  copy(acc -> y)
  linear_accumulate(x, w -> y)
  copy(acc -> z)
  zr = shard_by_stream(z, axis=1, chunks=2, index=1)
  linear_accumulate(x, wr -> zr)
}
";

#[test]
fn linear_accumulate_matches_the_cpu_backend() {
    if skip_unless(1, "linear_accumulate_matches_the_cpu_backend") {
        return;
    }
    for t in ["f32", "bf16"] {
        let h = host(ACCUMULATE, &[("T", t.to_string())]);
        let inputs = per_rank_inputs(&h, 1, 31);
        let worst = cpu_vs_cuda(&format!("linear_accumulate {t}"), &h, 1, inputs);
        eprintln!("linear_accumulate {t}: worst rel err vs the CPU backend {worst:.3e}");
    }
}

#[test]
fn the_ring_accumulating_in_place_matches_the_reference_on_two_gpus() {
    if skip_unless(
        2,
        "the_ring_accumulating_in_place_matches_the_reference_on_two_gpus",
    ) {
        return;
    }
    let d = 2u64;
    let mut b = ProgramBuilder::new("rsmm");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::BF16, &[512, 256], m).unwrap();
    let w = b.input("w", DType::BF16, &[384, 256], m).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    let z = b.set(y).unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
    let program = b.build().unwrap();
    let options = Options::new()
        .check(false)
        .decomposition("y", Decomposition::RingForward);
    let c = compile(&program, &options).unwrap();
    let level1 = c.level1().expect("lowered");
    for transport in [Transport::Nccl, Transport::CopyEngine] {
        for pieces in [1u64, 2, 4] {
            let plan = Plan {
                decomposition: Decomposition::RingForward,
                pieces,
                schedule: StreamSchedule::Prefetch,
                transport,
                accumulate: true,
            };
            let plans = BTreeMap::from([("y".to_string(), plan)]);
            let (host, _) = lower_planned(level1, &plans).unwrap();
            assert!(host.to_string().contains("linear_accumulate("));
            let mut co = cuda_options();
            co.config.transport = Some(transport);
            let what = format!("accumulating ring, {transport:?}, {pieces} piece(s)");
            let cmp = run_and_compare_cuda(level1, &host, 2, 7, &co)
                .unwrap_or_else(|e| panic!("{what}: {e}\n{host}"));
            eprintln!("{what}: {cmp}");
            assert!(cmp.passed(), "{what}: {cmp}");
        }
    }
}
