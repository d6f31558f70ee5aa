//! The `--backend cuda` path of `meshflow run`: in-process, one thread per GPU, by default;
//! one rank per process when the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) are set, e.g. under `meshflow launch --nproc N -- meshflow run
//! prog.mf --backend cuda`. Then the ranks met at the TCP rendezvous before lowering (to agree
//! on the machine profile, see [`rank`](super::rank)), every rank sends its outputs to rank 0
//! through it, and rank 0 alone compares them with the reference and prints `ok`/`mismatch`.
//! With `--nodes M` or `MESHFLOW_NODE_SIZE` the ranks form nodes and reach the ranks of other
//! nodes through the host proxy; with feature `fault-injection`, `MESHFLOW_FAULT_EXIT=RANK:N`
//! makes the process of `RANK` (of a multi-process run) exit at its `N`-th communication.

use std::collections::BTreeMap;
use std::time::Duration;

use meshflow::kernels::proxy::WireChoice;
use meshflow::runtime::backend::MoeWeightsAt;
use meshflow::runtime::cuda::{
    run_cuda, run_program_cuda, run_program_rank, CudaConfig, CudaOptions, ProgramRun,
};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::TorchrunEnv;
use meshflow::runtime::trace::Trace;
use meshflow::runtime::RunInputs;
use meshflow::Compiled;

use super::common::CliError;
use super::rank::{LaunchedRank, MIN_TIMEOUT};

/// How a GPU run is made (from `meshflow run`'s arguments).
#[derive(Clone, Copy)]
pub(super) struct GpuRun {
    /// Number of ranks.
    pub ranks: usize,
    /// Ranks per node, when the run is split into nodes.
    pub node_size: Option<usize>,
    /// Worker streams per rank.
    pub streams: usize,
    /// How long a rank waits for a peer (at least [`MIN_TIMEOUT`]).
    pub timeout: Duration,
    /// Record a trace (device time per stream; in-process runs only).
    pub trace: bool,
    /// Record each step as a CUDA graph and replay it.
    pub graph: bool,
    /// The wire of the host proxy between nodes.
    pub wire: WireChoice,
    /// The transport `--transport` asks the plans for.
    pub transport: Option<meshflow::Transport>,
    /// Report the transport of every communication.
    pub explain: bool,
}

/// What a GPU run gives back to `meshflow run`.
pub(super) struct GpuOutcome {
    /// The gathered outputs, or `None` on a rank other than 0 of a multi-process run (rank 0
    /// compares).
    pub outputs: Option<BTreeMap<String, TensorData>>,
    /// The trace, when asked for.
    pub trace: Option<Trace>,
}

/// Runs the compiled program on GPUs: in this process, or as the rank `launched` of a
/// multi-process run (which met the other ranks before lowering).
pub(super) fn run(
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    how: &GpuRun,
    launched: Option<&LaunchedRank>,
    summary: &mut String,
) -> Result<GpuOutcome, CliError> {
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
    let env = launched.map(|l| &l.env);
    #[cfg(feature = "fault-injection")]
    let exit_at_comm = match env {
        Some(e) => exit_fault(e.rank)?,
        None => None,
    };
    // The transport the plans assume: NCCL as planned (forced); otherwise chosen per team
    // (the copy engine where the ranks can use it: in one process, with peer access).
    let transport = match transport.or(compiled.transport()) {
        Some(meshflow::Transport::Nccl) => Some(meshflow::Transport::Nccl),
        _ => None,
    };
    let options = CudaOptions {
        ranks: Some(ranks),
        config: CudaConfig {
            transport,
            stream_pool: streams.max(1),
            timeout: timeout.max(MIN_TIMEOUT),
            profile: trace && env.is_none(),
            node_size,
            #[cfg(feature = "fault-injection")]
            exit_at_comm,
            graph,
            wire,
            ..CudaConfig::default()
        },
    };
    let level1 = compiled
        .level1()
        .map_err(|e| CliError::Run(e.to_string()))?;
    let run = match launched {
        Some(l) => run_program_rank(
            level1,
            compiled.host(),
            inputs,
            &options,
            &l.env,
            l.rendezvous.clone(),
        ),
        None => run_program_cuda(level1, compiled.host(), inputs, ranks, &options, None),
    }
    .map_err(|e| CliError::Run(e.to_string()))?;
    let ms = run.elapsed.as_secs_f64() * 1e3;
    match env {
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
    if run.outputs.is_none() {
        summary.push_str("outputs sent to rank 0, which compares them with the reference\n");
    }
    Ok(GpuOutcome {
        outputs: run.outputs,
        trace: run.trace,
    })
}

/// Runs a host program (loaded from host IR text, with no level-1 program) on the GPUs of
/// this process with the given local inputs; returns the trace when asked for. Multi-process
/// runs (`meshflow launch`) need the level-1 program to gather the outputs and are refused.
pub(super) fn run_host(
    compiled: &Compiled,
    per_rank: BTreeMap<usize, BTreeMap<String, TensorData>>,
    how: &GpuRun,
    summary: &mut String,
) -> Result<Option<Trace>, CliError> {
    if TorchrunEnv::from_env()
        .map_err(|e| CliError::Usage(e.to_string()))?
        .is_some()
    {
        return Err(CliError::Usage(
            "host IR text runs on the GPUs of one process only (its outputs cannot be gathered \
             across processes without the level-1 program): run it without `meshflow launch`"
                .into(),
        ));
    }
    let options = CudaOptions {
        ranks: Some(how.ranks),
        config: CudaConfig {
            stream_pool: how.streams.max(1),
            timeout: how.timeout.max(MIN_TIMEOUT),
            profile: how.trace,
            node_size: how.node_size,
            graph: how.graph,
            wire: how.wire,
            transport: how.transport.filter(|t| *t == meshflow::Transport::Nccl),
            ..CudaConfig::default()
        },
    };
    let outcome = run_cuda(compiled.host(), RunInputs::PerRank(per_rank), &options)
        .map_err(|e| CliError::Run(e.to_string()))?;
    summary.push_str(&format!(
        "ran on {} GPUs (one thread each) in {:.1} ms\n",
        how.ranks,
        outcome.elapsed.as_secs_f64() * 1e3
    ));
    Ok(outcome.trace)
}

/// The communication at which this process (rank `rank` of a multi-process run) exits, from
/// `MESHFLOW_FAULT_EXIT` (feature `fault-injection`, the fault tests).
#[cfg(feature = "fault-injection")]
fn exit_fault(rank: usize) -> Result<Option<usize>, CliError> {
    Ok(super::common::fault_exits_from_env()?
        .into_iter()
        .find_map(|(r, n)| (r == rank).then_some(n)))
}

/// One line per communication: the transport each rank of this process ran it over (and, for
/// an MoE step, which instruction carried the top-k weights).
fn explain_transports(run: &ProgramRun) -> String {
    use std::collections::BTreeSet;
    // (label, instruction, transport) -> ranks
    let mut uses: BTreeMap<(u32, &str, String), BTreeSet<usize>> = BTreeMap::new();
    for (&rank, list) in &run.transports {
        for t in list {
            let mut how = t
                .transport
                .map_or_else(|| "none".to_string(), |t| t.to_string());
            match t.moe_weights {
                Some(MoeWeightsAt::Dispatch) => {
                    how.push_str(", top-k weights travel with the dispatch")
                }
                Some(MoeWeightsAt::Combine) => {
                    how.push_str(", top-k weights sent at the combine (one more exchange)")
                }
                None => {}
            }
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
