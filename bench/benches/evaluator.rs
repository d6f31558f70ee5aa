//! Evaluator overhead: one CPU rank runs a 1000-iteration stream loop of no-op
//! communications (a collective permute on a one-device team, a local copy of 4 floats) with
//! a stream switch and a wait per iteration. Reported per executed instruction.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshflow::ir::{parse_host, DType, HostProgram};
use meshflow::runtime::cpu::{CpuBackend, CpuConfig, Fabric};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{EvalOptions, Evaluator};

const ITERS: u64 = 1000;
/// Executed instructions per run: get_current_stream, 3 per iteration, set_current_stream.
const INSTS: u64 = 3 * ITERS + 2;

fn program() -> HostProgram {
    let text = format!(
        "host noop_loop {{
  mesh m0 = [0]
  in x: f32[4] on m0
  out y: f32[4] on m0
  s0 = get_current_stream
  for i0 in 0..{ITERS} {{
    set_current_stream worker(i0)
    c0 = collective_permute(x -> y, team=slice(m0, DIDx), send=0, recv=0)
    wait c0
  }}
  set_current_stream s0
}}
"
    );
    parse_host(&text).expect("benchmark program parses")
}

fn bench(c: &mut Criterion) {
    let host = program();
    let inputs = BTreeMap::from([(
        "x".to_string(),
        TensorData::from_f32(DType::F32, &[4], &[1., 2., 3., 4.]).expect("valid tensor"),
    )]);
    let mut group = c.benchmark_group("evaluator");
    group.throughput(Throughput::Elements(INSTS));
    for race_check in [false, true] {
        let config = CpuConfig {
            race_check,
            ..CpuConfig::default()
        };
        let backend = CpuBackend::new(0, Arc::new(Fabric::new()), &config);
        let mut ev = Evaluator::new(&host, backend, EvalOptions::default()).expect("plan");
        // A direct measurement, printed per instruction.
        let runs = 200;
        let t0 = Instant::now();
        for _ in 0..runs {
            black_box(ev.run(&inputs).expect("run"));
        }
        let per_inst = t0.elapsed().as_secs_f64() * 1e9 / (runs as f64 * INSTS as f64);
        eprintln!("race_check={race_check}: {per_inst:.1} ns per instruction");
        let name = if race_check {
            "noop_loop_race_check"
        } else {
            "noop_loop"
        };
        group.bench_function(name, |b| {
            b.iter(|| black_box(ev.run(&inputs).expect("run")))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
