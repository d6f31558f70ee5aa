//! The inter-node host proxy between processes: `meshflow run --nodes` (or `MESHFLOW_NODE_SIZE`)
//! starts node processes of the binary that reach each other's ranks through the proxy over
//! TCP; node 0 gathers and compares with the CPU reference. Faults: a node process that dies
//! mid-run makes the others fail naming a lost rank, well within the timeout, and nothing hangs.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn meshflow(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_meshflow"));
    c.args(args)
        .current_dir(crate::support::root())
        .env_remove("RUST_LOG")
        .env_remove("MESHFLOW_NODE_SIZE")
        .env_remove("MESHFLOW_FAULT_EXIT")
        .env_remove("MESHFLOW_PROXY_RING");
    for (k, v) in env {
        c.env(k, v);
    }
    let start = Instant::now();
    let o = c.output().expect("the binary runs");
    (o, start.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The numbers of node 0's proxy line: (chunk writes, chunk immediates, messages).
fn proxy_counts(out: &str) -> (u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.starts_with("proxy over tcp (node 0):"))
        .unwrap_or_else(|| panic!("no proxy line in:\n{out}"));
    let n: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    // "proxy over tcp (node 0): W chunk writes, I chunk immediates, M messages, ..."
    (n[1], n[2], n[3])
}

/// Runs `file` on `ranks` ranks in `nodes` node processes and checks it matches the reference
/// with cross-node traffic through the proxy.
fn assert_matches(file: &str, ranks: usize, nodes: usize, env: &[(&str, &str)]) -> String {
    let (r, n) = (ranks.to_string(), nodes.to_string());
    let (o, _) = meshflow(
        &["run", file, "--ranks", &r, "--nodes", &n, "--seed", "5"],
        env,
    );
    let out = text(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{file} on {ranks} ranks / {nodes} nodes:\n{out}{}",
        text(&o.stderr)
    );
    assert!(
        out.contains(&format!(
            "ran on {ranks} CPU ranks in {nodes} node processes"
        )),
        "{out}"
    );
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("ok "), "{file}: last line {last}");
    let (writes, immediates, _) = proxy_counts(&out);
    assert!(
        writes + immediates > 0,
        "{file}: node 0 used the proxy: {out}"
    );
    out
}

/// Node 0 both wrote to and received from the other node through the proxy.
fn assert_both_ways(out: &str) {
    let (writes, immediates, messages) = proxy_counts(out);
    assert!(writes > 0 && immediates > 0 && messages > 0, "{out}");
}

#[test]
fn moe_dispatch_and_combine_cross_two_nodes_at_two_and_four_ranks() {
    for ranks in [2, 4] {
        assert_both_ways(&assert_matches(
            "examples/programs/moe_layer.mf",
            ranks,
            2,
            &[],
        ));
    }
}

#[test]
fn the_ring_column_parallel_linear_crosses_two_nodes_at_two_and_four_ranks() {
    for ranks in [2, 4] {
        let out = assert_matches(
            "examples/programs/column_parallel_linear_ring.mf",
            ranks,
            2,
            &[],
        );
        assert_both_ways(&out);
    }
}

#[test]
fn collective_permutes_cross_nodes_in_many_chunks_through_small_rings() {
    // 64 KiB per permute step through 16 KiB rings: every message is cut into chunks and the
    // rings are reused through credits many times.
    for ranks in [2, 4] {
        let out = assert_matches(
            "tests/data/proxy/ring_all_gather.mf",
            ranks,
            2,
            &[("MESHFLOW_PROXY_RING", "16384")],
        );
        assert_both_ways(&out);
        let (writes, _, messages) = proxy_counts(&out);
        assert!(writes >= 16 * messages, "{out}");
    }
}

#[test]
fn meshflow_node_size_splits_the_ranks_into_node_processes() {
    let (o, _) = meshflow(
        &["run", "examples/programs/moe_layer.mf", "--ranks", "4"],
        &[("MESHFLOW_NODE_SIZE", "2")],
    );
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}{}", text(&o.stderr));
    assert!(out.contains("2 node processes of 2 ranks"), "{out}");
    assert!(
        out.contains("ran on 4 CPU ranks in 2 node processes"),
        "{out}"
    );
}

#[test]
fn every_example_runs_on_uneven_nodes() {
    // Five ranks in two nodes: three on node 0, two on node 1.
    for name in [
        "column_parallel_linear_collective",
        "column_parallel_linear_broadcast",
        "row_parallel_linear_chunked",
        "mlp_2d_mesh",
        "pipeline_two_meshes",
        "moe_layer",
    ] {
        assert_matches(&format!("examples/programs/{name}.mf"), 5, 2, &[]);
    }
}

/// Kills (exits) the process of `rank` at its `at`-th communication and checks that the run
/// fails fast, with the surviving node naming a rank of the dead node.
fn assert_lost_node_fails_fast(rank: usize, at: usize, dead: [usize; 2]) {
    let fault = format!("{rank}:{at}");
    let (o, took) = meshflow(
        &[
            "run",
            "examples/programs/moe_layer.mf",
            "--ranks",
            "4",
            "--nodes",
            "2",
            "--timeout-ms",
            "20000",
        ],
        &[("MESHFLOW_FAULT_EXIT", &fault)],
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}, the timeout is 20 s"
    );
    let dead_node = dead[0] / 2;
    assert!(
        err.contains(&format!(
            "node {dead_node} (ranks {dead:?}) exited with status 86 (injected fault)"
        )),
        "{err}"
    );
    let survivor = 1 - dead_node;
    let line = err
        .lines()
        .find(|l| l.starts_with(&format!("  node {survivor} ")))
        .unwrap_or_else(|| panic!("no line for node {survivor}:\n{err}"));
    assert!(
        dead.iter()
            .any(|r| line.contains(&format!("rank {r} (node {dead_node}) was lost"))),
        "{line}"
    );
    assert!(!out.lines().any(|l| l.starts_with("ok")), "{out}");
}

#[test]
fn a_node_process_killed_mid_dispatch_makes_the_others_fail_naming_it() {
    // Communication #0 of every rank is the dispatch.
    assert_lost_node_fails_fast(2, 0, [2, 3]);
}

#[test]
fn a_node_process_killed_mid_combine_makes_the_others_fail_naming_it() {
    // Communication #1 is the combine: rank 1 dies after the dispatch went through.
    assert_lost_node_fails_fast(1, 1, [0, 1]);
}
