//! Timing a host program with one process per GPU (`meshflow launch -- meshflow bench ...`):
//! every process runs its rank of each program ([`run_rank`]) and the processes meet through
//! one TCP rendezvous (the torchrun variables), each program under a key prefix of its own.
//! Every rank publishes whether its run succeeded, its device times and its outputs; rank 0
//! gathers them, so that it reports the same figures (the maximum over ranks of the per-rank
//! medians) and checks the same outputs as an in-process run. The cases of `bench agmm|rsmm|
//! schedule` run through [`crate::session`] on a [`Launched::scope`] of the store instead.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use meshflow::ir::HostProgram;
use meshflow::runtime::cuda::{run_rank, CudaConfig};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::{
    decode_tensors, encode_tensors, Rendezvous, RendezvousError, TcpRendezvous, TorchrunEnv,
};
use meshflow::runtime::RunOutcome;

use crate::gpu::BenchError;
use crate::session::Scoped;

/// The rendezvous of this process's rank, shared by its runs.
pub(crate) struct Launched {
    env: TorchrunEnv,
    store: Arc<TcpRendezvous>,
    runs: AtomicUsize,
    timeout: Duration,
}

/// What every rank gathers from one run: per-rank device times, and (rank 0) every rank's
/// outputs.
pub(crate) struct Gathered {
    pub times_us: Vec<Vec<f64>>,
    pub outcome: RunOutcome,
}

fn rdv_err(what: &str, e: RendezvousError) -> BenchError {
    BenchError::Invalid(format!("{what}: rendezvous: {e}"))
}

fn floats(v: &[f64]) -> Vec<u8> {
    v.iter()
        .map(f64::to_string)
        .collect::<Vec<_>>()
        .join(",")
        .into_bytes()
}

fn parse_floats(b: &[u8]) -> Vec<f64> {
    String::from_utf8_lossy(b)
        .split(',')
        .filter_map(|x| x.parse().ok())
        .collect()
}

/// The process's connection, made once: rank 0 serves the store on one port for the whole
/// process, and every benchmark of the process (`schedule` runs two) numbers its runs on.
static SHARED: OnceLock<Mutex<Option<Arc<Launched>>>> = OnceLock::new();

impl Launched {
    /// This rank's connection to the store of the run (`MASTER_ADDR:MASTER_PORT`), made on the
    /// first call and shared by later ones.
    pub(crate) fn connect(
        env: &TorchrunEnv,
        timeout: Duration,
    ) -> Result<Arc<Launched>, BenchError> {
        let mut shared = SHARED
            .get_or_init(|| Mutex::new(None))
            .lock()
            .map_err(|_| BenchError::Invalid("the rendezvous connection was poisoned".into()))?;
        if let Some(l) = shared.as_ref() {
            return Ok(l.clone());
        }
        let store = TcpRendezvous::connect(env, timeout).map_err(|e| rdv_err("connecting", e))?;
        let l = Arc::new(Launched {
            env: env.clone(),
            store: Arc::new(store),
            runs: AtomicUsize::new(0),
            timeout,
        });
        *shared = Some(l.clone());
        Ok(l)
    }

    /// The number of ranks (processes).
    pub(crate) fn world(&self) -> usize {
        self.env.world_size
    }

    /// The rank of this process (rank 0 holds every rank's outputs).
    pub(crate) fn rank(&self) -> usize {
        self.env.rank
    }

    /// The GPU ordinal of this process.
    pub(crate) fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// A fresh scope of the store for one run or one case: keys and barriers under
    /// `bench/<n>/`, the store's namespace (so that communicators cached per namespace serve
    /// every run of the process, as they do across the runs of an in-process benchmark).
    pub(crate) fn scope(&self) -> Arc<dyn Rendezvous> {
        let n = self.runs.fetch_add(1, Ordering::Relaxed);
        let store: Arc<dyn Rendezvous> = self.store.clone();
        Arc::new(Scoped::new(store, format!("bench/{n}/")))
    }

    /// Runs this rank of `host` (`warmup` untimed and `iterations` timed runs) with this
    /// rank's `inputs`; every rank gets the times of all, rank 0 also their outputs.
    pub(crate) fn time(
        &self,
        what: &str,
        host: &HostProgram,
        inputs: &BTreeMap<usize, BTreeMap<String, TensorData>>,
        config: &CudaConfig,
        warmup: usize,
        iterations: usize,
    ) -> Result<Gathered, BenchError> {
        let rdv = self.scope();
        let (rank, world) = (self.env.rank, self.env.world_size);
        let empty = BTreeMap::new();
        let mine = inputs.get(&rank).unwrap_or(&empty);
        let shared = rdv.clone();
        let run = run_rank(
            host,
            rank,
            world,
            self.env.local_rank,
            mine,
            shared,
            config,
            warmup,
            iterations,
        );
        let err = |e| rdv_err(what, e);
        let status = match &run {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("rank {rank}: {e}"),
        };
        if let Ok(r) = &run {
            rdv.publish(&format!("times/{rank}"), &floats(&r.times_us))
                .map_err(err)?;
            // One key per rank for every run (a later run's outputs replace this one's, after
            // the barrier below), so the store holds one run's outputs at a time. The status
            // goes last: a rank that reads it finds this run's times and outputs in place.
            self.store
                .publish(
                    &format!("bench/outputs/{rank}"),
                    &encode_tensors(&r.outputs),
                )
                .map_err(err)?;
        }
        rdv.publish(&format!("status/{rank}"), status.as_bytes())
            .map_err(err)?;
        let mut failure = None;
        let mut times_us = Vec::new();
        let mut outputs = BTreeMap::new();
        for r in 0..world {
            let s = rdv
                .fetch(&format!("status/{r}"), self.timeout)
                .map_err(err)?;
            if s != b"ok" {
                failure.get_or_insert_with(|| String::from_utf8_lossy(&s).into_owned());
                continue;
            }
            let t = rdv
                .fetch(&format!("times/{r}"), self.timeout)
                .map_err(err)?;
            times_us.push(parse_floats(&t));
            if rank == 0 {
                let o = self
                    .store
                    .fetch(&format!("bench/outputs/{r}"), self.timeout)
                    .map_err(err)?;
                let o = decode_tensors(&o)
                    .map_err(|e| BenchError::Invalid(format!("{what}: rank {r}'s outputs: {e}")))?;
                outputs.insert(r, o);
            }
        }
        // Rank 0 serves the store: every rank has read what it needs before the next run.
        rdv.barrier("done", world, self.timeout).map_err(err)?;
        if let Some(f) = failure {
            return Err(BenchError::Invalid(format!("{what}: {f}")));
        }
        run.map_err(|e| BenchError::Invalid(format!("{what}: {e}")))?;
        Ok(Gathered {
            times_us,
            outcome: RunOutcome {
                outputs,
                trace: None,
                elapsed: Duration::ZERO,
            },
        })
    }
}
