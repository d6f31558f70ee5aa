//! [`run_program_cuda`]: runs a lowered program on GPUs from full inputs and returns the full
//! outputs, in-process (one thread per GPU) or as one rank of a multi-process run, where rank
//! 0 collects every rank's outputs through the rendezvous. This is what
//! `meshflow run --backend cuda` does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshflow_ir::{DeviceId, HostProgram, Program};
use meshflow_kernels::proxy::ProxyStats;

use super::ranks::{run_cuda_timed, run_rank, CudaOptions, CudaRunError};
use crate::runtime::data::TensorData;
use crate::runtime::evaluator::SelectedTransport;
use crate::runtime::ranks::{RunError, RunInputs};
use crate::runtime::rendezvous::{
    decode_tensors, encode_tensors, Rendezvous, RendezvousError, TcpRendezvous, TorchrunEnv,
};
use crate::runtime::shard::{gather_tensor, scatter_inputs};
use crate::runtime::trace::Trace;

/// What a GPU run of a program produced on this process.
#[derive(Clone, Debug)]
pub struct ProgramRun {
    /// The full outputs, by name: in-process, and on rank 0 of a multi-process run; `None` on
    /// the other ranks (they sent theirs to rank 0).
    pub outputs: Option<BTreeMap<String, TensorData>>,
    /// This process's rank in a multi-process run.
    pub rank: Option<usize>,
    /// Number of ranks.
    pub world: usize,
    /// Wall time of the run (start to outputs).
    pub elapsed: Duration,
    /// Device-time intervals as a trace (profiling mode, in-process runs).
    pub trace: Option<Trace>,
    /// In runs split into nodes: the host-proxy counters of the ranks of this process.
    pub proxy_stats: BTreeMap<DeviceId, ProxyStats>,
    /// Per rank of this process, every communication it posts and the transport selected for
    /// it.
    pub transports: BTreeMap<DeviceId, Vec<SelectedTransport>>,
    /// In runs split into nodes: the wire of the host proxies and why it was chosen.
    pub wire: Option<(&'static str, String)>,
}

fn gather_all(
    program: &Program,
    per_rank: &BTreeMap<usize, BTreeMap<String, TensorData>>,
) -> Result<BTreeMap<String, TensorData>, CudaRunError> {
    program
        .outputs
        .iter()
        .map(|&t| {
            let name = program.tensors[t].name.clone();
            gather_tensor(program, t, per_rank)
                .map(|d| (name, d))
                .map_err(|e| CudaRunError::Run(RunError::Shard(e)))
        })
        .collect()
}

/// Runs `host` (lowered from `program`) on `ranks` GPUs with the full `inputs`.
///
/// With `env` (the torchrun variables of this process) this process runs rank `env.rank` on
/// GPU `env.local_rank`; the ranks meet through a [`TcpRendezvous`] on
/// `MASTER_ADDR:MASTER_PORT`, each sends its outputs there, and rank 0 gathers them. Every
/// process must be given the same `inputs` (e.g. generated from the same seed).
pub fn run_program_cuda(
    program: &Program,
    host: &HostProgram,
    inputs: &BTreeMap<String, TensorData>,
    ranks: usize,
    options: &CudaOptions,
    env: Option<&TorchrunEnv>,
) -> Result<ProgramRun, CudaRunError> {
    let Some(env) = env else {
        let start = Instant::now();
        let mut o = options.clone();
        o.ranks = Some(ranks);
        let timed = run_cuda_timed(host, RunInputs::Full { program, inputs }, &o, 0, 1)?;
        let outcome = timed.outcome;
        return Ok(ProgramRun {
            outputs: Some(
                outcome
                    .gather(program)
                    .map_err(|e| CudaRunError::Run(RunError::Shard(e)))?,
            ),
            rank: None,
            world: ranks,
            elapsed: start.elapsed(),
            trace: outcome.trace,
            proxy_stats: timed.proxy_stats,
            transports: timed.transports,
            wire: timed.wire,
        });
    };
    check_world(host, env)?;
    let rdv: Arc<dyn Rendezvous> = Arc::new(TcpRendezvous::connect(env, options.config.timeout)?);
    run_program_rank(program, host, inputs, options, env, rdv)
}

/// [`run_program_cuda`] as rank `env.rank` of a multi-process run, meeting the other ranks at
/// `rendezvous`, which the caller connected already (e.g. to agree on the machine profile
/// before lowering, see [`crate::front::agree`]).
pub fn run_program_rank(
    program: &Program,
    host: &HostProgram,
    inputs: &BTreeMap<String, TensorData>,
    options: &CudaOptions,
    env: &TorchrunEnv,
    rendezvous: Arc<dyn Rendezvous>,
) -> Result<ProgramRun, CudaRunError> {
    let start = Instant::now();
    check_world(host, env)?;
    let timeout = options.config.timeout;
    let rdv = rendezvous;
    let per_rank = scatter_inputs(program, inputs).map_err(RunError::from)?;
    let empty = BTreeMap::new();
    let mine = per_rank.get(&env.rank).unwrap_or(&empty);
    let run = run_rank(
        host,
        env.rank,
        env.world_size,
        env.local_rank,
        mine,
        rdv.clone(),
        &options.config,
        0,
        1,
    )?;
    rdv.publish(
        &format!("meshflow/outputs/{}", env.rank),
        &encode_tensors(&run.outputs),
    )?;
    let outputs = if env.rank == 0 {
        let mut all = BTreeMap::new();
        for r in 0..env.world_size {
            let bytes = rdv.fetch(&format!("meshflow/outputs/{r}"), timeout)?;
            let outs = decode_tensors(&bytes).map_err(|e| {
                CudaRunError::Rendezvous(RendezvousError::Io {
                    address: format!("rank {r}'s outputs"),
                    message: e.to_string(),
                })
            })?;
            all.insert(r, outs);
        }
        Some(gather_all(program, &all)?)
    } else {
        None
    };
    // Rank 0 serves the store: nobody leaves before it has everything.
    rdv.barrier("meshflow/done", env.world_size, timeout)?;
    Ok(ProgramRun {
        outputs,
        rank: Some(env.rank),
        world: env.world_size,
        elapsed: start.elapsed(),
        trace: None,
        proxy_stats: run
            .proxy_stats
            .map(|p| BTreeMap::from([(env.rank, p)]))
            .unwrap_or_default(),
        transports: BTreeMap::from([(env.rank, run.transports)]),
        wire: run.wire,
    })
}

/// Refuses a multi-process run with fewer processes than the program has ranks.
fn check_world(host: &HostProgram, env: &TorchrunEnv) -> Result<(), CudaRunError> {
    let needed = host.world_size();
    if env.world_size < needed {
        return Err(RunError::TooFewRanks {
            needed,
            given: env.world_size,
        }
        .into());
    }
    Ok(())
}
