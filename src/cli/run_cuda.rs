//! The `--backend cuda` path of `meshflow run`: in-process, one thread per GPU, by default;
//! one rank per process when the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) are set, e.g. under `meshflow launch --nproc N -- meshflow run
//! prog.mf --backend cuda`. Then every rank sends its outputs to rank 0 through the TCP
//! rendezvous, and rank 0 alone compares them with the reference and prints `ok`/`mismatch`.
//! With `--nodes M` or `MESHFLOW_NODE_SIZE` the ranks form nodes and reach the ranks of other
//! nodes through the host proxy; `MESHFLOW_FAULT_EXIT=RANK:N` makes the process of `RANK` (of a
//! multi-process run) exit at its `N`-th communication (fault tests).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use meshflow::kernels::proxy::WireChoice;
use meshflow::pipeline::Compiled;
use meshflow::runtime::cuda::{run_program_cuda, CudaConfig, CudaOptions, ProgramRun};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::TorchrunEnv;

use super::common::CliError;

/// The least time a GPU rank waits for its peers (communicator setup can take seconds).
const MIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How a GPU run is made (from `meshflow run`'s arguments).
#[derive(Clone, Copy)]
pub(super) struct GpuRun<'a> {
    /// Number of ranks.
    pub ranks: usize,
    /// Ranks per node, when the run is split into nodes.
    pub node_size: Option<usize>,
    /// Worker streams per rank.
    pub streams: usize,
    /// How long a rank waits for a peer (at least [`MIN_TIMEOUT`]).
    pub timeout: Duration,
    /// Where to write the trace.
    pub trace: Option<&'a Path>,
    /// Record each step as a CUDA graph and replay it.
    pub graph: bool,
    /// The wire of the host proxy between nodes.
    pub wire: WireChoice,
    /// The transport `--transport` asks the plans for.
    pub transport: Option<meshflow::Transport>,
    /// Report the transport of every communication.
    pub explain: bool,
}

/// Runs the compiled program on GPUs. Returns the gathered outputs, or `None` on a rank other
/// than 0 of a multi-process run (rank 0 compares).
pub(super) fn run(
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    how: &GpuRun<'_>,
    summary: &mut String,
) -> Result<Option<BTreeMap<String, TensorData>>, CliError> {
    let GpuRun {
        ranks,
        node_size,
        streams,
        timeout,
        trace,
        graph,
        wire,
        transport,
        explain,
    } = *how;
    let env = TorchrunEnv::from_env().map_err(|e| CliError::Usage(e.to_string()))?;
    let exit_at_comm = match &env {
        Some(e) => exit_fault(e.rank)?,
        None => None,
    };
    // The transport the plans assume: NCCL as planned (forced); otherwise chosen per team
    // (the copy engine where the ranks can use it: in one process, with peer access).
    let transport = match transport.or(compiled.transport) {
        Some(meshflow::Transport::Nccl) => Some(meshflow::Transport::Nccl),
        _ => None,
    };
    let options = CudaOptions {
        ranks: Some(ranks),
        config: CudaConfig {
            transport,
            stream_pool: streams.max(1),
            timeout: timeout.max(MIN_TIMEOUT),
            profile: trace.is_some() && env.is_none(),
            node_size,
            exit_at_comm,
            graph,
            wire,
            ..CudaConfig::default()
        },
    };
    let run = run_program_cuda(
        &compiled.program,
        &compiled.host,
        inputs,
        ranks,
        &options,
        env.as_ref(),
    )
    .map_err(|e| CliError::Run(e.to_string()))?;
    let ms = run.elapsed.as_secs_f64() * 1e3;
    match &env {
        None => summary.push_str(&format!(
            "ran on {} GPUs (one thread each) in {ms:.1} ms\n",
            run.world
        )),
        Some(e) => summary.push_str(&format!(
            "rank {} of {} (GPU {}) ran in {ms:.1} ms\n",
            e.rank, e.world_size, e.local_rank
        )),
    }
    if graph {
        summary.push_str("recorded one step as a CUDA graph and replayed it\n");
    }
    if !run.proxy_stats.is_empty() {
        let bytes: u64 = run.proxy_stats.values().map(|p| p.bytes_written).sum();
        let messages: u64 = run.proxy_stats.values().map(|p| p.messages_received).sum();
        let wire = match &run.wire {
            Some((name, reason)) => format!("over {name}, {reason}"),
            None => "no wire".to_string(),
        };
        summary.push_str(&format!(
            "between nodes through the host proxy ({wire}): {bytes} bytes written, {messages} \
             messages received ({} ranks with a peer on another node)\n",
            run.proxy_stats.len()
        ));
    }
    if explain {
        summary.push_str(&explain_transports(&run));
    }
    if let Some(path) = trace {
        match &run.trace {
            Some(t) => {
                t.write(path).map_err(|source| {
                    CliError::Run(format!(
                        "cannot write the trace `{}`: {source}",
                        path.display()
                    ))
                })?;
                summary.push_str(&format!(
                    "trace (device time per stream) written to {}\n",
                    path.display()
                ));
            }
            None => summary.push_str("note: --trace is recorded for in-process GPU runs only\n"),
        }
    }
    if run.outputs.is_none() {
        summary.push_str("outputs sent to rank 0, which compares them with the reference\n");
    }
    Ok(run.outputs)
}

/// The communication at which this process (rank `rank` of a multi-process run) exits, from
/// `MESHFLOW_FAULT_EXIT` (fault tests).
fn exit_fault(rank: usize) -> Result<Option<usize>, CliError> {
    Ok(super::common::fault_exits_from_env()?
        .into_iter()
        .find_map(|(r, n)| (r == rank).then_some(n)))
}

/// One line per communication: the transport each rank of this process ran it over.
fn explain_transports(run: &ProgramRun) -> String {
    use std::collections::BTreeSet;
    // (label, instruction, transport) -> ranks
    let mut uses: BTreeMap<(u32, &str, String), BTreeSet<usize>> = BTreeMap::new();
    for (&rank, list) in &run.transports {
        for t in list {
            let how = t
                .transport
                .map_or_else(|| "none".to_string(), |t| t.to_string());
            uses.entry((t.comm.0, t.name, how))
                .or_default()
                .insert(rank);
        }
    }
    let mut out = String::from("transports:\n");
    if uses.is_empty() {
        out.push_str("  (no communication)\n");
    }
    for ((comm, name, how), ranks) in uses {
        let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
        out.push_str(&format!(
            "  c{comm} {name}: {how} (ranks {})\n",
            ranks.join(",")
        ));
    }
    if let Some((name, reason)) = &run.wire {
        out.push_str(&format!("  host proxy wire: {name} ({reason})\n"));
    }
    out
}
