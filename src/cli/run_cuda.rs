//! The `--backend cuda` path of `meshflow run`: in-process, one thread per GPU, by default;
//! one rank per process when the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) are set, e.g. under `meshflow launch --nproc N -- meshflow run
//! prog.mf --backend cuda`. Then every rank sends its outputs to rank 0 through the TCP
//! rendezvous, and rank 0 alone compares them with the reference and prints `ok`/`mismatch`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use meshflow::pipeline::Compiled;
use meshflow::runtime::cuda::{run_program_cuda, CudaConfig, CudaOptions};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::TorchrunEnv;

use super::common::CliError;

/// The least time a GPU rank waits for its peers (communicator setup can take seconds).
const MIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the compiled program on GPUs. Returns the gathered outputs, or `None` on a rank other
/// than 0 of a multi-process run (rank 0 compares).
pub(super) fn run(
    compiled: &Compiled,
    inputs: &BTreeMap<String, TensorData>,
    ranks: usize,
    streams: usize,
    timeout: Duration,
    trace: Option<&Path>,
    summary: &mut String,
) -> Result<Option<BTreeMap<String, TensorData>>, CliError> {
    let env = TorchrunEnv::from_env().map_err(|e| CliError::Usage(e.to_string()))?;
    let options = CudaOptions {
        ranks: Some(ranks),
        config: CudaConfig {
            stream_pool: streams.max(1),
            timeout: timeout.max(MIN_TIMEOUT),
            profile: trace.is_some() && env.is_none(),
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
