mod hardening_support;
use hardening_support::*;
use meshflow::ir::parse_program;
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::sim::Fabric;
use meshflow::runtime::{EvalOptions, Evaluator, SimBackend, SimConfig};
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

fn go(race: bool, poison: bool, steps: usize) {
    let text = std::fs::read_to_string("examples/programs/pipeline_two_meshes.mf").unwrap();
    let l1 = parse_program(&text).unwrap();
    let host = compile(&l1, &CompileOptions::default()).unwrap().host;
    let inputs = scatter_inputs(&l1, &random_inputs(&l1, 5).unwrap()).unwrap();
    let empty = BTreeMap::new();
    let fabric = Arc::new(Fabric::new());
    let config = SimConfig {
        race_check: race,
        poison,
        ..SimConfig::default()
    };
    let barrier = Barrier::new(5);
    let (mut a, mut b) = (0, 0);
    std::thread::scope(|s| {
        for rank in 0..4 {
            let (fabric, config, barrier, host) = (&fabric, &config, &barrier, &host);
            let inputs = inputs.get(&rank).unwrap_or(&empty);
            s.spawn(move || {
                let mut ev = Evaluator::new(
                    host,
                    SimBackend::new(rank, fabric.clone(), config),
                    EvalOptions::default(),
                )
                .unwrap();
                for step in 1..=steps {
                    ev.run(inputs).unwrap();
                    if step == 10 || step == steps {
                        barrier.wait();
                        barrier.wait();
                    }
                }
            });
        }
        barrier.wait();
        a = status("VmRSS");
        barrier.wait();
        barrier.wait();
        b = status("VmRSS");
        barrier.wait();
    });
    eprintln!("race {race} poison {poison} steps {steps}: {a} -> {b} KiB");
}
#[test]
fn scratch() {
    let n: usize = std::env::var("N").unwrap().parse().unwrap();
    go(true, true, n);
}
