//! [`run_node`] with the nodes as threads of this test (an in-process rendezvous, the proxies
//! over real TCP sockets): results match the in-process run bit for bit, and a rank that fails
//! on one node stops the other node through the proxy's failure notice, naming it.

use crate::support::runtime::run_full;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshflow::ir::{parse_program_with, Program};
use meshflow::kernels::proxy::Topology;
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cpu::{CpuConfig, Fault, FaultKind};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::multinode::{run_node, NodeError, NodeOutcome, NodeSpec};
use meshflow::runtime::rendezvous::{LocalRendezvous, Rendezvous};
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::CpuOptions;
use meshflow::{compile, Compiled, Options};

fn compiled(example: &str, ranks: i64) -> (Program, Compiled) {
    let path = format!(
        "{}/examples/programs/{example}.mf",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("example exists");
    let params = BTreeMap::from([("ranks".to_string(), ranks)]);
    let program = parse_program_with(&text, &params).expect("example parses");
    let c = compile(&program, &Options::new().check(false)).expect("example compiles");
    (program, c)
}

fn options(faults: Vec<Fault>) -> CpuOptions {
    CpuOptions {
        ranks: None,
        config: CpuConfig {
            timeout: Duration::from_secs(10),
            faults,
            ..CpuConfig::default()
        },
        trace: false,
    }
}

/// Runs every node of `topology` on its own thread.
fn run_nodes(
    c: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    topology: &Topology,
    ring: usize,
    opts: &CpuOptions,
) -> Vec<Result<NodeOutcome, NodeError>> {
    let per_rank = scatter_inputs(c.level1().expect("lowered"), inputs).expect("inputs scatter");
    let rendezvous: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("proxy-nodes"));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..topology.nodes())
            .map(|node| {
                let (per_rank, rendezvous) = (&per_rank, rendezvous.clone());
                s.spawn(move || {
                    let spec = NodeSpec {
                        node,
                        topology: topology.clone(),
                        host: "127.0.0.1".into(),
                        ring,
                        setup_timeout: Duration::from_secs(30),
                        wire: Default::default(),
                    };
                    run_node(c.host(), per_rank, &spec, rendezvous, opts)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a node thread does not panic"))
            .collect()
    })
}

#[test]
fn nodes_linked_by_the_proxy_compute_the_same_bits_as_one_process() {
    for (example, ranks, node_size, ring) in [
        ("moe_layer", 8, 2, 4096),
        ("column_parallel_linear_ring", 4, 2, 1 << 20),
        ("row_parallel_linear_chunked", 6, 4, 2048),
        ("mlp_2d_mesh", 4, 1, 1 << 16),
    ] {
        let (program, c) = compiled(example, ranks as i64);
        let inputs = random_inputs(&program, 3).expect("inputs");
        let opts = options(Vec::new());
        let in_process = CpuOptions {
            ranks: Some(ranks),
            ..opts.clone()
        };
        let want = run_full(c.host(), c.level1().expect("lowered"), &inputs, &in_process)
            .expect("in-process run");
        let topology = Topology::contiguous(ranks, node_size).expect("topology");
        let results = run_nodes(&c, &inputs, &topology, ring, &opts);
        let mut writes = 0;
        let mut got = None;
        for (node, r) in results.into_iter().enumerate() {
            let outcome = r.unwrap_or_else(|e| panic!("{example}: node {node}: {e}"));
            writes += outcome
                .proxy_stats
                .values()
                .map(|s| s.chunk_writes)
                .sum::<u64>();
            if node == 0 {
                got = outcome.outputs;
            } else {
                assert!(outcome.outputs.is_none());
            }
        }
        let got = got.expect("node 0 gathers every rank's outputs");
        assert!(
            writes > 0,
            "{example}: the proxy carried cross-node messages"
        );
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.outputs.keys().collect::<Vec<_>>()
        );
        for (rank, outs) in &want.outputs {
            for (name, t) in outs {
                assert!(
                    got[rank][name].bit_eq(t),
                    "{example}: rank {rank} output {name} differs"
                );
            }
        }
    }
}

#[test]
fn a_rank_that_errors_on_one_node_stops_the_other_node_naming_it() {
    let (program, c) = compiled("moe_layer", 4);
    let inputs = random_inputs(&program, 1).expect("inputs");
    let opts = options(vec![Fault {
        rank: 3,
        at_comm: 1,
        kind: FaultKind::Error,
    }]);
    let topology = Topology::contiguous(4, 2).expect("topology");
    let start = Instant::now();
    let results = run_nodes(&c, &inputs, &topology, 1 << 16, &opts);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let errors: Vec<String> = results
        .into_iter()
        .map(|r| r.expect_err("every node fails").to_string())
        .collect();
    assert!(
        errors[1].contains("injected error at communication #1"),
        "{}",
        errors[1]
    );
    assert!(
        errors[0].starts_with("node 0 (ranks [0, 1]): rank 3: ")
            && errors[0].contains("injected error at communication #1"),
        "{}",
        errors[0]
    );
}
