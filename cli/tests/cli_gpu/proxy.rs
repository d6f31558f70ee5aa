//! GPU runs split into nodes: the ring all-gather + linear example (collective permutes) and
//! the MoE layer example (dispatch/combine) on 2 and 4 GPUs forced into 2 nodes
//! (`CudaConfig::node_size` = d/2): ranks of different nodes exchange through the host proxy
//! over TCP, ranks of one node over NCCL. The outputs must match the level-1 reference on the
//! CPU, be bit-identical to the same run on one node, and the proxies must have carried the
//! cross-node messages. Then two processes as two nodes (`meshflow run --backend cuda` with the
//! torchrun variables and `MESHFLOW_NODE_SIZE=1`): a healthy run passes, and a run whose rank
//! 1 process exits in the middle of the MoE layer makes rank 0 fail, naming rank 1, within the
//! timeout.
//!
//! Built with the `cuda` feature only: `cargo test --features cuda -p meshflow-cli --test cli_gpu proxy::`.
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meshflow::ir::parse_program_with;
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::cpu::FAULT_EXIT_STATUS;
use meshflow::runtime::cuda::{run_cuda_timed, CudaOptions, TimedRun};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::RunInputs;
use meshflow::{compile, Compiled, Options};
use support::*;

const EXAMPLES: [&str; 2] = ["column_parallel_linear_ring", "moe_layer"];

fn example_path(example: &str) -> String {
    format!(
        "{}/examples/programs/{example}.mf",
        crate::support::root().display()
    )
}

/// The example lowered for `ranks` (its `program` is the level-1 program after propagation,
/// whose layouts cut the inputs and gather the outputs).
fn compiled(example: &str, ranks: usize) -> Compiled {
    let text = std::fs::read_to_string(example_path(example)).expect("example exists");
    let params = BTreeMap::from([("ranks".to_string(), ranks as i64)]);
    let program = parse_program_with(&text, &params).expect("example parses");
    compile(&program, &Options::new().check(false)).expect("example compiles")
}

fn run(
    c: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    d: usize,
    node_size: usize,
) -> TimedRun {
    let mut options: CudaOptions = cuda_options();
    options.ranks = Some(d);
    options.config.node_size = Some(node_size);
    run_cuda_timed(
        c.host(),
        RunInputs::Full {
            program: c.level1().expect("lowered"),
            inputs,
        },
        &options,
        0,
        1,
    )
    .unwrap_or_else(|e| {
        panic!(
            "{} on {d} GPUs in nodes of {node_size}: {e}",
            c.level1().expect("lowered").name
        )
    })
}

#[test]
fn permutes_and_moe_cross_nodes_through_the_proxy() {
    let counts: Vec<usize> = rank_counts("permutes_and_moe_cross_nodes_through_the_proxy")
        .into_iter()
        .filter(|&d| d >= 2)
        .collect();
    if counts.is_empty() {
        eprintln!("skipped: permutes_and_moe_cross_nodes_through_the_proxy needs 2 GPUs");
        return;
    }
    for d in counts {
        for example in EXAMPLES {
            let c = compiled(example, d);
            let program = c.level1().expect("lowered");
            let inputs = random_inputs(program, 11).unwrap();
            let split = run(&c, &inputs, d, d / 2);
            let single = run(&c, &inputs, d, d);
            assert!(single.proxy_stats.is_empty(), "one node needs no proxy");
            assert_eq!(
                split.proxy_stats.len(),
                d,
                "{example} d={d}: every rank has a peer on the other node"
            );
            let bytes: u64 = split.proxy_stats.values().map(|s| s.bytes_written).sum();
            let messages: u64 = split
                .proxy_stats
                .values()
                .map(|s| s.messages_received)
                .sum();
            assert!(bytes > 0 && messages > 0, "{example} d={d}: {split:?}");
            let got = split.outcome.gather(program).unwrap();
            let want = evaluate(program, &inputs).unwrap();
            let cmp = compare_outputs(program, &got, &want).unwrap();
            eprintln!(
                "{example} on {d} GPUs in 2 nodes: {cmp}; {messages} messages, {bytes} bytes \
                 through the proxy"
            );
            assert!(cmp.passed(), "{example} d={d}: {cmp}");
            let one = single.outcome.gather(program).unwrap();
            assert_eq!(
                got, one,
                "{example} d={d}: the split run differs from the one-node run"
            );
        }
    }
}

/// Two back-to-back ring permutes of 16 MiB per rank (`b` = `a` of rank − 2) on GPUs split
/// into 2 nodes, over 4 runs of the same backends (1 untimed + 3): staging buffers are reused
/// and messages stay numbered across runs; the last run's outputs match the CPU backend.
#[test]
fn large_permutes_cross_nodes_over_several_runs() {
    let counts: Vec<usize> = rank_counts("large_permutes_cross_nodes_over_several_runs")
        .into_iter()
        .filter(|&d| d >= 2)
        .collect();
    if counts.is_empty() {
        eprintln!("skipped: large_permutes_cross_nodes_over_several_runs needs 2 GPUs");
        return;
    }
    for d in counts {
        let n = 4u64 << 20;
        let hp = host(
            "host perm {\n  mesh m0 = $mesh\n  in a: f32[$n] on m0\n  out b: f32[$n] on m0\n  tensor t: f32[$n] on m0\n  allocate t\n  c0 = collective_permute(a -> t, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $d, recv=(my(m0, DIDx) + $dm1) % $d)\n  wait c0\n  c1 = collective_permute(t -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $d, recv=(my(m0, DIDx) + $dm1) % $d)\n  wait c1\n  deallocate t\n}\n",
            &[
                ("mesh", iota(d)),
                ("n", n.to_string()),
                ("d", d.to_string()),
                ("dm1", (d - 1).to_string()),
            ],
        );
        let inputs = per_rank_inputs(&hp, d, 5);
        let mut so = cpu_options();
        so.ranks = Some(d);
        let want = meshflow::runtime::run_cpu(&hp, RunInputs::PerRank(inputs.clone()), &so)
            .unwrap_or_else(|e| panic!("cpu: {e}"));
        let mut options: CudaOptions = cuda_options();
        options.ranks = Some(d);
        options.config.node_size = Some(d / 2);
        let got = run_cuda_timed(&hp, RunInputs::PerRank(inputs), &options, 1, 3)
            .unwrap_or_else(|e| panic!("{d} GPUs in 2 nodes: {e}"));
        assert_eq!(got.outcome.outputs, want.outputs, "d={d}");
        // Each rank receives one message per permute whose sender is on the other node.
        let crossing = (0..d)
            .filter(|&r| (r + d - 1) % d / (d / 2) != r / (d / 2))
            .count();
        let messages: u64 = got.proxy_stats.values().map(|s| s.messages_received).sum();
        assert_eq!(
            messages,
            (crossing * 2 * 4) as u64,
            "d={d}: {:?}",
            got.proxy_stats
        );
        eprintln!(
            "16 MiB ring permutes x2 on {d} GPUs in 2 nodes, 4 runs: match the CPU backend; {messages} \
             messages through the proxy; {:.1} µs per run (device time, median of rank 0)",
            {
                let mut t = got.times_us[0].clone();
                t.sort_by(f64::total_cmp);
                t.get(t.len() / 2).copied().unwrap_or(0.0)
            }
        );
    }
}

/// A free TCP port on the loopback interface.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Runs `moe_layer` as two rank processes, one per node; returns each rank's exit code and
/// output, and the wall time.
fn two_process_nodes(fault: Option<&str>) -> (Vec<(Option<i32>, String)>, Duration) {
    let port = free_port().to_string();
    let start = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshflow"));
            cmd.args(["run", &example_path("moe_layer"), "--ranks", "2"])
                .args(["--backend", "cuda", "--timeout-ms", "20000"])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("MESHFLOW_NODE_SIZE", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            match fault {
                Some(f) => cmd.env("MESHFLOW_FAULT_EXIT", f),
                None => cmd.env_remove("MESHFLOW_FAULT_EXIT"),
            };
            cmd.spawn().expect("the meshflow binary starts")
        })
        .collect();
    let results = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("a rank process finishes");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.code(), text)
        })
        .collect();
    (results, start.elapsed())
}

#[test]
fn two_processes_as_two_nodes_and_a_lost_node() {
    if skip_unless(2, "two_processes_as_two_nodes_and_a_lost_node") {
        return;
    }
    let (ranks, took) = two_process_nodes(None);
    for (r, (code, text)) in ranks.iter().enumerate() {
        eprintln!("healthy run, rank {r} (exit {code:?}, {took:?}):\n{text}");
        assert_eq!(*code, Some(0), "rank {r}:\n{text}");
    }
    assert!(ranks[0].1.contains("\nok"), "{}", ranks[0].1);
    assert!(
        ranks[0].1.contains("through the host proxy"),
        "{}",
        ranks[0].1
    );

    // Rank 1 exits at its second communication (the combine, after a dispatch that crossed
    // the nodes), as a killed process would.
    let (ranks, took) = two_process_nodes(Some("1:1"));
    for (r, (code, text)) in ranks.iter().enumerate() {
        eprintln!("faulty run, rank {r} (exit {code:?}, {took:?}):\n{text}");
    }
    assert_eq!(ranks[1].0, Some(FAULT_EXIT_STATUS), "{}", ranks[1].1);
    assert!(matches!(ranks[0].0, Some(c) if c != 0), "{}", ranks[0].1);
    assert!(ranks[0].1.contains("rank 1"), "{}", ranks[0].1);
    // GPU ranks wait at least 60 s for a peer (`meshflow run` raises --timeout-ms to that).
    assert!(
        took < Duration::from_secs(60 + 40),
        "rank 0 took {took:?} to fail (timeout 60 s)"
    );
}
