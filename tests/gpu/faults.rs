//! The fault matrix of `tests/hardening/fault_matrix.rs` on GPUs (CUDA + NCCL): a rank that
//! returns an error, panics or stops responding in the middle of a collective (chunked
//! all_reduce), a collective permute (ring all-gather) and an MoE dispatch, on 2, 4 and 8
//! ranks (those the machine has; the others are skipped with a printed reason).
//!
//! The CUDA backend has no fault injection of its own, so the test wraps it in a `Backend`
//! that fails at the n-th communication it posts, and drives one `Evaluator` per GPU the way
//! `run_cuda` does (shared rendezvous and abort signal; a failing rank aborts both). Promises
//! checked: every rank returns an error, within the timeout (a stall: within the timeout the
//! peers wait in NCCL, plus slack); an error or a panic is named in every rank's error (NCCL
//! cannot tell which peer stalled, so a stall is not); no thread the cell started is left
//! (rank threads, and NCCL's threads of aborted communicators); every evaluator released its
//! buffers. Each rank count starts with a run without a fault, which must succeed.
//!
//! Built with the `cuda` feature only: `cargo test --features cuda --test gpu faults::`.
#![cfg(feature = "cuda")]

use crate::support::gpu as support;
use crate::support::hardening as hardening_support;
use crate::support::runtime as common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hardening_support::{open_fds, row};
use meshflow::ir::{ComputeOp, DType, DeviceId, HostProgram, Program};
use meshflow::runtime::backend::{
    Backend, BackendError, CommLabel, CommRequest, InstCtx, KernelId, PlanInfo, StreamIndex,
    TensorView,
};
use meshflow::runtime::compare::random_inputs;
use meshflow::runtime::cuda::{clear_communicator_cache, AbortSignal, CudaBackend, CudaConfig};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::rendezvous::{LocalRendezvous, Rendezvous};
use meshflow::runtime::shard::scatter_inputs;
use meshflow::runtime::{EvalOptions, Evaluator, RuntimeError};

const TIMEOUT: Duration = Duration::from_secs(10);
/// NCCL aborts, device synchronization and thread teardown on top of the timeout.
const SLACK: Duration = Duration::from_secs(20);

#[derive(Copy, Clone, Debug, PartialEq)]
enum Kind {
    Error,
    Panic,
    Stall,
}

/// A backend that fails when it posts its `at`-th communication (0-based).
struct Faulty<B> {
    inner: B,
    fault: Option<(usize, Kind)>,
    posted: usize,
    abort: AbortSignal,
}

impl<B: Backend> Faulty<B> {
    fn inject(&mut self) -> Result<(), BackendError> {
        let n = self.posted;
        self.posted += 1;
        match self.fault {
            Some((at, kind)) if at == n => match kind {
                Kind::Error => Err(BackendError::InjectedFault { n, kind: "error" }),
                Kind::Panic => panic!(
                    "injected panic on rank {} at communication #{n}",
                    self.inner.device()
                ),
                Kind::Stall => {
                    let start = Instant::now();
                    while !self.abort.is_aborted() && start.elapsed() < TIMEOUT * 3 {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(BackendError::InjectedFault { n, kind: "stall" })
                }
            },
            _ => Ok(()),
        }
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Buffer = B::Buffer;
    type Comm = B::Comm;

    fn device(&self) -> DeviceId {
        self.inner.device()
    }
    fn stream_pool_size(&self) -> usize {
        self.inner.stream_pool_size()
    }
    fn prepare(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError> {
        self.inner.prepare(info)
    }
    fn allocate(&mut self, dtype: DType, shape: &[u64]) -> Result<B::Buffer, BackendError> {
        self.inner.allocate(dtype, shape)
    }
    fn deallocate(&mut self, buffer: B::Buffer) -> Result<(), BackendError> {
        self.inner.deallocate(buffer)
    }
    fn upload(&mut self, buffer: B::Buffer, data: &TensorData) -> Result<(), BackendError> {
        self.inner.upload(buffer, data)
    }
    fn download(&mut self, view: &TensorView<B::Buffer>) -> Result<TensorData, BackendError> {
        self.inner.download(view)
    }
    fn set_current_stream(&mut self, stream: StreamIndex) -> Result<(), BackendError> {
        self.inner.set_current_stream(stream)
    }
    fn synchronize(&mut self, stream: StreamIndex, ctx: InstCtx<'_>) -> Result<(), BackendError> {
        self.inner.synchronize(stream, ctx)
    }
    fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TensorView<B::Buffer>],
        outputs: &[&TensorView<B::Buffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.inner.compute(op, inputs, outputs, ctx)
    }
    fn kernel(&self, name: &str) -> Option<KernelId> {
        self.inner.kernel(name)
    }
    fn call_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<B::Buffer>],
        outputs: &[&TensorView<B::Buffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.inner.call_kernel(kernel, inputs, outputs, args, ctx)
    }
    fn post(
        &mut self,
        request: &CommRequest<'_, B::Buffer>,
        ctx: InstCtx<'_>,
    ) -> Result<B::Comm, BackendError> {
        self.inject()?;
        self.inner.post(request, ctx)
    }
    fn begin_group(&mut self) -> Result<(), BackendError> {
        self.inner.begin_group()
    }
    fn end_group(&mut self, label: CommLabel, ctx: InstCtx<'_>) -> Result<B::Comm, BackendError> {
        self.inner.end_group(label, ctx)
    }
    fn wait(&mut self, comm: &B::Comm, ctx: InstCtx<'_>) -> Result<(), BackendError> {
        self.inner.wait(comm, ctx)
    }
    fn finish(&mut self) -> Result<(), BackendError> {
        self.inner.finish()
    }
    fn transport_of(&self, label: CommLabel) -> Option<meshflow::passes::Transport> {
        self.inner.transport_of(label)
    }
}

/// One rank: a CUDA backend on GPU `rank` wrapped in `Faulty`, one run. Returns its error text.
fn rank_main(
    host: &HostProgram,
    rank: DeviceId,
    world: usize,
    inputs: &BTreeMap<String, TensorData>,
    rdv: Arc<dyn Rendezvous>,
    abort: &AbortSignal,
    fault: Option<(usize, Kind)>,
) -> Result<(), String> {
    let fail = |text: &str| {
        abort.abort(rank, text.to_string());
        rdv.abort(&format!("rank {rank} failed: {text}"));
    };
    let config = CudaConfig {
        timeout: TIMEOUT,
        ..CudaConfig::default()
    };
    let mut backend = CudaBackend::new(rank, rank, config, Some(rdv.clone()), Some(abort.clone()))
        .map_err(|e| {
            fail(&e.to_string());
            e.to_string()
        })?;
    backend.set_start_barrier(world);
    let faulty = Faulty {
        inner: backend,
        fault,
        posted: 0,
        abort: abort.clone(),
    };
    let mut ev = Evaluator::new(host, faulty, EvalOptions::default()).map_err(|e| {
        fail(&e.to_string());
        e.to_string()
    })?;
    let result: Result<_, RuntimeError> = match catch_unwind(AssertUnwindSafe(|| ev.run(inputs))) {
        Ok(r) => r,
        Err(_) => {
            let text = format!("rank {rank} panicked{}", ev.position());
            ev.release_buffers();
            fail(&text);
            ev.backend_mut().inner.mark_failed();
            return Err(text);
        }
    };
    match result {
        Ok(_) => Ok(()),
        Err(e) => {
            if !e.is_abort() {
                fail(&e.to_string());
            }
            ev.backend_mut().inner.mark_failed();
            Err(e.to_string())
        }
    }
}

fn build(case: &str, d: i64) -> (Program, HostProgram, usize, &'static str) {
    match case {
        "collective (all_reduce)" => (
            common::level1("row_parallel_chunked.mf", &[("d", d), ("s", 3)]),
            common::row_parallel_host(d, 3),
            1,
            "all_reduce(",
        ),
        "collective permute" => (
            common::level1("ring_linear.mf", &[("d", d)]),
            common::ring_host(d),
            1,
            "collective_permute(",
        ),
        _ => (
            common::level1(
                "moe_layer.mf",
                &[("d", d), ("t", 3), ("e", 2), ("k", 2), ("h", 8), ("f", 4)],
            ),
            common::moe_host(d, 3, 2, 2, 8, 4),
            0,
            "moe_dispatch(",
        ),
    }
}

/// The ids of this process's threads (`/proc/self/task`).
fn thread_ids() -> BTreeSet<u64> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Threads that did not exist in `before`, waiting up to 2 s for exiting ones to go: each with
/// its name and where it sleeps (`wchan`).
fn new_threads(before: &BTreeSet<u64>) -> Vec<String> {
    let start = Instant::now();
    loop {
        let extra: Vec<u64> = thread_ids().difference(before).copied().collect();
        if extra.is_empty() || start.elapsed() > Duration::from_secs(2) {
            return extra
                .iter()
                .map(|tid| {
                    let read = |f: &str| {
                        std::fs::read_to_string(format!("/proc/self/task/{tid}/{f}"))
                            .map(|t| t.trim().to_string())
                            .unwrap_or_else(|e| format!("({e})"))
                    };
                    format!("{tid} `{}` wchan={}", read("comm"), read("wchan"))
                })
                .collect();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs the ranks of one cell (rank `failed` with `fault`), one thread each; their results.
fn run_ranks(
    l1: &Program,
    host: &HostProgram,
    d: usize,
    fault: Option<(usize, Kind)>,
) -> Vec<(DeviceId, Result<(), String>)> {
    let per_rank = scatter_inputs(l1, &random_inputs(l1, 9).unwrap()).unwrap();
    let failed = d / 2;
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new(format!("gpu-faults-{d}")));
    let abort = AbortSignal::new();
    let empty = BTreeMap::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..d)
            .map(|rank| {
                let (rdv, abort) = (rdv.clone(), &abort);
                let inputs = per_rank.get(&rank).unwrap_or(&empty);
                let fault = fault.filter(|_| rank == failed);
                std::thread::Builder::new()
                    .name(format!("gpu-fault-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        rank_main(host, rank, d, inputs, rdv, abort, fault)
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                (
                    rank,
                    h.join().unwrap_or_else(|_| Err("thread panicked".into())),
                )
            })
            .collect()
    })
}

/// A run of `case` on `d` GPUs without a fault, which must succeed on every rank. It also
/// starts whatever the process keeps for its life (CUDA contexts and their driver threads), so
/// that the cells after it can count the threads they leave.
fn warm_up(case: &str, d: usize) {
    let (l1, host, _, _) = build(case, d as i64);
    for (rank, r) in run_ranks(&l1, &host, d, None) {
        if let Err(e) = r {
            panic!("{case} / {d} GPUs without a fault: rank {rank}: {e}");
        }
    }
    clear_communicator_cache();
}

fn run_cell(case: &str, d: usize, kind: Kind) {
    let (l1, host, at, inst) = build(case, d as i64);
    let failed = d / 2;
    let cell = format!("{case} / {d} GPUs / {kind:?}");
    eprintln!("{cell}: starting");
    let threads_before = thread_ids();
    let fds = open_fds();
    let start = Instant::now();
    let errors = run_ranks(&l1, &host, d, Some((at, kind)));
    let elapsed = start.elapsed();
    // As the launcher does after a failed run (the ranks may disagree about which
    // communicators are healthy): abort and forget the cached communicators, which ends
    // NCCL's threads.
    clear_communicator_cache();
    for (rank, r) in &errors {
        let text = r
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("{cell}: rank {rank} succeeded"));
        eprintln!("{cell}: rank {rank}: {text}");
        if kind != Kind::Stall {
            assert!(
                text.contains(&format!("rank {failed}")),
                "{cell}: rank {rank}: {text}"
            );
        }
    }
    let own = errors[failed].1.as_ref().err().cloned().unwrap_or_default();
    match kind {
        Kind::Error => assert!(
            own.contains(inst) && own.contains("injected error"),
            "{cell}: {own}"
        ),
        Kind::Panic => assert!(
            own.contains("panicked") && own.contains(inst),
            "{cell}: {own}"
        ),
        Kind::Stall => {}
    }
    let bound = if kind == Kind::Stall {
        TIMEOUT + SLACK
    } else {
        SLACK
    };
    assert!(elapsed < bound, "{cell}: took {elapsed:?}");
    let left = new_threads(&threads_before);
    assert!(
        left.is_empty(),
        "{cell}: threads started by the cell are still alive (rank threads, or NCCL/CUDA \
         threads of communicators that were not torn down): {left:?}"
    );
    eprintln!("{cell}: descriptors {fds} -> {}", open_fds());
    row(
        "faults",
        &[
            "cuda".into(),
            case.into(),
            d.to_string(),
            format!("{kind:?}").to_lowercase(),
            format!("{:.0} ms", elapsed.as_secs_f64() * 1e3),
            "-".into(),
            "survived".into(),
        ],
    );
}

fn matrix(case: &str) {
    let test = format!("gpu fault matrix: {case}");
    for d in [2usize, 4, 8] {
        if support::skip_unless(d, &format!("{test} on {d} ranks")) {
            continue;
        }
        warm_up(case, d);
        for kind in [Kind::Error, Kind::Panic, Kind::Stall] {
            run_cell(case, d, kind);
        }
    }
}

#[test]
fn gpu_faults_mid_collective() {
    let _serial = hardening_support::serial();
    matrix("collective (all_reduce)");
}

#[test]
fn gpu_faults_mid_collective_permute() {
    let _serial = hardening_support::serial();
    matrix("collective permute");
}

#[test]
fn gpu_faults_mid_moe_dispatch() {
    let _serial = hardening_support::serial();
    matrix("moe_dispatch");
}
