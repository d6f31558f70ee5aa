//! Multi-process CPU runs. `meshflow run FILE --ranks N --nodes M` (or with
//! `MESHFLOW_NODE_SIZE=K`) starts M node processes of this binary ([`start_nodes`]), each
//! running the hidden `meshflow node` subcommand ([`run`]): the ranks of one node as threads,
//! the other nodes reached through the host proxy (over `--wire`: TCP by default). Node 0
//! serves the rendezvous, gathers every rank's outputs, compares them with the reference and
//! prints the summary, which the launcher relays. With feature `fault-injection` (the tests),
//! `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]` makes the process of `RANK` exit at its `N`-th
//! communication; `MESHFLOW_PROXY_ADDR` sets the address the proxies listen on and
//! `MESHFLOW_PROXY_RING` the bytes per proxy ring.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use meshflow::kernels::proxy::{ProxyStats, Topology, WireChoice};
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::cpu::CpuConfig;
use meshflow::runtime::multinode::{
    local_address_toward, run_node, supervise, NodeCommand, NodeSpec, DEFAULT_RING,
};
use meshflow::runtime::ranks::{CpuOptions, RunOutcome};
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::rendezvous::{Rendezvous, TcpRendezvous, TorchrunEnv};
use meshflow::runtime::shard::scatter_inputs;

use super::common::{options, print_out, CliError, CompileArgs, ProgramArgs};

/// How a run executes, shared by `run` and `node`.
#[derive(Clone, Debug, Args)]
pub struct ExecArgs {
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How long a rank waits for a peer before the run fails, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Do not check stream ordering (races) while running (CPU backend).
    #[arg(long)]
    pub no_race_check: bool,
    /// The wire of the host proxy between nodes (`tcp`, `ibverbs`, `auto`).
    #[arg(long, default_value = "tcp")]
    pub wire: WireChoice,
}

/// Arguments of the hidden `node` subcommand (started by `run --nodes`).
#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    program: ProgramArgs,
    #[command(flatten)]
    compile: CompileArgs,
    #[command(flatten)]
    cpu: ExecArgs,
    /// This node.
    #[arg(long)]
    node: usize,
    /// Ranks per node (consecutive ranks share a node).
    #[arg(long)]
    node_size: usize,
    /// `host:port` of node 0's rendezvous store.
    #[arg(long)]
    master: String,
}

/// How long proxy connection setup and rendezvous steps may take.
fn setup_timeout(cpu: &ExecArgs) -> Duration {
    Duration::from_millis(cpu.timeout_ms).max(Duration::from_secs(30))
}

/// Faults from `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]` (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
fn faults_from_env() -> Result<Vec<meshflow::runtime::faults::Fault>, CliError> {
    use meshflow::runtime::faults::{Fault, FaultKind};
    Ok(super::common::fault_exits_from_env()?
        .into_iter()
        .map(|(rank, at_comm)| Fault {
            rank,
            at_comm,
            kind: FaultKind::Exit,
        })
        .collect())
}

fn sum_stats(stats: &BTreeMap<usize, ProxyStats>) -> ProxyStats {
    stats
        .values()
        .fold(ProxyStats::default(), |a, s| ProxyStats {
            chunk_writes: a.chunk_writes + s.chunk_writes,
            chunk_immediates: a.chunk_immediates + s.chunk_immediates,
            credit_writes: a.credit_writes + s.credit_writes,
            messages_received: a.messages_received + s.messages_received,
            bytes_written: a.bytes_written + s.bytes_written,
        })
}

/// Runs one node of a multi-process run (the `node` subcommand).
pub fn run(args: NodeArgs) -> Result<(), CliError> {
    // The launching process ran the cross-rank check.
    let options = options(&args.program, Some(&args.compile))?.check(false);
    let program = args.program.load(&options)?;
    let compiled = meshflow::compile(&program, &options).map_err(|e| args.program.error(e))?;
    let level1 = compiled.level1().map_err(|e| args.program.error(e))?;
    let ranks = compiled.world_size();
    let topology = Topology::contiguous(ranks, args.node_size)
        .map_err(|e| CliError::Usage(format!("--node-size: {e}")))?;
    let nodes = topology.nodes();
    if args.node >= nodes {
        return Err(CliError::Usage(format!(
            "--node {}: the run has {nodes} nodes",
            args.node
        )));
    }
    let mut summary = String::new();
    let inputs =
        random_inputs(&program, args.cpu.seed).map_err(|e| CliError::Run(e.to_string()))?;
    let per_rank = scatter_inputs(level1, &inputs).map_err(|e| CliError::Run(e.to_string()))?;
    let (addr, port) = args
        .master
        .rsplit_once(':')
        .and_then(|(a, p)| Some((a.to_string(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            CliError::Usage(format!("--master `{}`: expected HOST:PORT", args.master))
        })?;
    let env = TorchrunEnv {
        rank: args.node,
        world_size: nodes,
        local_rank: args.node,
        master_addr: addr,
        master_port: port,
    };
    let setup = setup_timeout(&args.cpu);
    let rendezvous: Arc<dyn Rendezvous> = Arc::new(
        TcpRendezvous::connect_unwatched(&env, setup).map_err(|e| CliError::Run(e.to_string()))?,
    );
    let host =
        std::env::var("MESHFLOW_PROXY_ADDR").unwrap_or_else(|_| local_address_toward(&args.master));
    let ring = match std::env::var("MESHFLOW_PROXY_RING") {
        Ok(v) => v.trim().parse().map_err(|_| {
            CliError::Usage(format!(
                "MESHFLOW_PROXY_RING=`{v}`: expected a number of bytes"
            ))
        })?,
        Err(_) => DEFAULT_RING,
    };
    let spec = NodeSpec {
        node: args.node,
        topology,
        host,
        ring,
        setup_timeout: setup,
        wire: args.cpu.wire,
    };
    let cpu = CpuOptions {
        ranks: Some(ranks),
        config: CpuConfig {
            stream_pool: args.compile.streams,
            timeout: Duration::from_millis(args.cpu.timeout_ms),
            race_check: !args.cpu.no_race_check,
            #[cfg(feature = "fault-injection")]
            faults: faults_from_env()?,
            ..CpuConfig::default()
        },
        trace: false,
    };
    let outcome = run_node(compiled.host(), &per_rank, &spec, rendezvous, &cpu)
        .map_err(|e| CliError::Run(e.to_string()))?;
    let stats = sum_stats(&outcome.proxy_stats);
    let Some(outputs) = outcome.outputs else {
        return Ok(());
    };
    summary.push_str(&format!(
        "ran on {ranks} CPU ranks in {nodes} node processes in {:.1} ms (seed {})\n",
        outcome.elapsed.as_secs_f64() * 1e3,
        args.cpu.seed
    ));
    summary.push_str(&format!(
        "proxy over {} (node 0): {} chunk writes, {} chunk immediates, {} messages, {} credit writes, {} bytes\n",
        outcome.wire,
        stats.chunk_writes,
        stats.chunk_immediates,
        stats.messages_received,
        stats.credit_writes,
        stats.bytes_written
    ));
    summary.push_str(&format!(
        "proxy wire: {} ({})\n",
        outcome.wire, outcome.wire_reason
    ));
    let run = RunOutcome {
        outputs,
        trace: None,
        elapsed: outcome.elapsed,
    };
    let got = run
        .gather(level1)
        .map_err(|e| CliError::Run(e.to_string()))?;
    let want = evaluate(&program, &inputs).map_err(|e| CliError::Run(e.to_string()))?;
    let comparison =
        compare_outputs(&program, &got, &want).map_err(|e| CliError::Run(e.to_string()))?;
    summary.push_str(&format!("{comparison}\n"));
    print_out(&summary)?;
    if comparison.passed() {
        Ok(())
    } else {
        Err(CliError::Mismatch)
    }
}

/// The number of nodes of a run of `ranks`: `--nodes`, else `MESHFLOW_NODE_SIZE`, else 1.
pub fn nodes_of(ranks: usize, nodes: Option<usize>) -> Result<usize, CliError> {
    let size = match nodes {
        Some(0) => return Err(CliError::Usage("--nodes must be at least 1".into())),
        Some(n) => ranks.div_ceil(n),
        None => match meshflow::kernels::proxy::node_size_from_env()
            .map_err(|e| CliError::Usage(e.to_string()))?
        {
            Some(size) => size,
            None => return Ok(1),
        },
    };
    Ok(ranks.div_ceil(size.max(1)).max(1))
}

/// Starts the node processes of a run of `ranks` split into `nodes` and relays node 0's
/// summary. `summary` is printed first.
pub fn start_nodes(
    program: &ProgramArgs,
    compile: &CompileArgs,
    cpu: &ExecArgs,
    ranks: usize,
    nodes: usize,
    summary: &str,
) -> Result<(), CliError> {
    let node_size = ranks.div_ceil(nodes.max(1));
    let topology =
        Topology::contiguous(ranks, node_size).map_err(|e| CliError::Usage(e.to_string()))?;
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Run(format!("cannot find this executable: {e}")))?;
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| CliError::Run(format!("no free port for the rendezvous: {e}")))?
        .port();
    let master = format!("127.0.0.1:{port}");
    let commands = (0..topology.nodes())
        .map(|node| {
            let mut c = Command::new(&exe);
            c.arg("node")
                .arg(&program.file)
                .args(["--ranks", &ranks.to_string()])
                .args(program.params.iter().flat_map(|p| ["--param", p.as_str()]))
                .args(compile.to_args())
                .args(["--seed", &cpu.seed.to_string()])
                .args(["--timeout-ms", &cpu.timeout_ms.to_string()])
                .args(["--wire", cpu.wire.name()])
                .args(["--node", &node.to_string()])
                .args(["--node-size", &node_size.to_string()])
                .args(["--master", &master]);
            if cpu.no_race_check {
                c.arg("--no-race-check");
            }
            NodeCommand {
                node,
                ranks: topology.ranks_of(node),
                command: c,
            }
        })
        .collect();
    let timeout = Duration::from_millis(cpu.timeout_ms);
    let started = Instant::now();
    let exits = supervise(
        commands,
        setup_timeout(cpu) * 2 + timeout * 4,
        timeout + Duration::from_secs(5),
    );
    let mut out = summary.to_string();
    out.push_str(&format!(
        "{} node processes of {node_size} ranks, finished in {:.1} ms\n",
        exits.len(),
        started.elapsed().as_secs_f64() * 1e3
    ));
    let mut errors = Vec::new();
    for e in &exits {
        for line in e.stderr.lines() {
            eprintln!("[node {}] {line}", e.node);
        }
        if e.node == 0 {
            out.push_str(&e.stdout);
        }
        if !e.success() {
            let last = e
                .stderr
                .lines()
                .rev()
                .find(|l| l.starts_with("error:"))
                .unwrap_or("");
            let injected = injected_exit(e.status.and_then(|s| s.code()));
            errors.push(format!(
                "node {} (ranks {:?}) {}{}{}",
                e.node,
                e.ranks,
                e.describe(),
                if injected { " (injected fault)" } else { "" },
                if last.is_empty() {
                    String::new()
                } else {
                    format!(": {last}")
                }
            ));
        }
    }
    print_out(&out)?;
    let mismatch = exits.iter().any(|e| {
        e.node == 0
            && e.stdout
                .lines()
                .last()
                .is_some_and(|l| l.starts_with("mismatch"))
    });
    match (errors.is_empty(), mismatch) {
        (true, _) => Ok(()),
        (false, true) if errors.len() == 1 => Err(CliError::Mismatch),
        _ => Err(CliError::Run(format!(
            "the multi-process run failed:\n  {}",
            errors.join("\n  ")
        ))),
    }
}

/// True when a node process stopped through an injected fault (feature `fault-injection`).
fn injected_exit(code: Option<i32>) -> bool {
    #[cfg(feature = "fault-injection")]
    {
        code == Some(meshflow::runtime::faults::FAULT_EXIT_STATUS)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = code;
        false
    }
}
