//! The cross-rank check's mutation corpus, forced to run: every broken host program that the
//! static check rejects must also end in an error on the CPU backend, within the timeout,
//! rather than hang or silently succeed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::corpus::mutation_corpus;
use meshflow::ir::{parse_host, HostProgram, Role};
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::data::TensorData;
use meshflow::runtime::ranks::{run_cpu, CpuOptions, RunInputs};

/// Random local inputs for every input tensor on every rank of its mesh.
fn per_rank_inputs(host: &HostProgram) -> RunInputs<'static> {
    let mut per_rank: BTreeMap<usize, BTreeMap<String, TensorData>> = BTreeMap::new();
    for (i, (_, t)) in host.tensors.iter().enumerate() {
        if t.role != Role::Input {
            continue;
        }
        for &device in host.meshes[t.mesh].mesh.devices() {
            let data = TensorData::random(t.dtype, &t.shape, (device * 1000 + i) as u64)
                .expect("input shapes of verified programs are valid");
            per_rank
                .entry(device)
                .or_default()
                .insert(t.name.clone(), data);
        }
    }
    RunInputs::PerRank(per_rank)
}

#[test]
fn every_mutation_fails_at_run_time_within_the_timeout() {
    let corpus = mutation_corpus().expect("the corpus loads");
    assert!(corpus.len() >= 20, "corpus has {} programs", corpus.len());
    let timeout = Duration::from_millis(500);
    let mut unexpected = Vec::new();
    for m in &corpus {
        let host = parse_host(&m.text).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let options = CpuOptions {
            ranks: Some(m.ranks),
            config: CpuConfig {
                timeout,
                ..CpuConfig::default()
            },
            trace: false,
        };
        let started = Instant::now();
        let result = run_cpu(&host, per_rank_inputs(&host), &options);
        let elapsed = started.elapsed();
        // A hang would be caught by the timeout: the run must end well within a few timeouts.
        assert!(
            elapsed < timeout * 6,
            "{}: the run took {elapsed:?} (timeout {timeout:?})",
            m.name
        );
        match result {
            Err(e) => {
                let text = e.to_string();
                assert!(!text.is_empty(), "{}: empty error", m.name);
                eprintln!("{}: failed in {elapsed:?}: {}", m.name, first_line(&text));
            }
            Ok(_) => unexpected.push(m.name.clone()),
        }
    }
    assert!(
        unexpected.is_empty(),
        "these broken programs ran to completion on the CPU backend: {unexpected:?}"
    );
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}
