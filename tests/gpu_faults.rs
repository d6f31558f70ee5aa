//! The fault matrix of `tests/runtime_fault_matrix.rs` on GPUs (CUDA + NCCL): a rank that
//! returns an error, panics or stops responding in the middle of a collective (chunked
//! all_reduce), a collective permute (ring all-gather) and an MoE dispatch, on 2, 4 and 8
//! ranks (those the machine has; the others are skipped with a printed reason).
//!
//! The CUDA backend has no fault injection of its own, so the test wraps it in a `Backend`
//! that fails at the n-th communication it posts, and drives one `Evaluator` per GPU the way
//! `run_cuda` does (shared rendezvous and abort signal; a failing rank aborts both). Promises
//! checked: every rank returns an error, within the timeout (a stall: within the timeout the
//! peers wait in NCCL, plus slack); an error or a panic is named in every rank's error (NCCL
//! cannot tell which peer stalled, so a stall is not); every rank thread is joined and none
//! is left; every evaluator released its buffers.
//!
//! Built with the `cuda` feature only: `cargo test --features cuda --test gpu_faults`.
#![cfg(feature = "cuda")]

#[path = "data/runtime/common.rs"]
mod common;
mod hardening_support;
#[path = "data/gpu/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hardening_support::{open_fds, row, threads_left};
use meshflow::ir::{ComputeOp, DType, DeviceId, HostProgram, Program};
use meshflow::runtime::backend::{
    Backend, BackendError, CommRequest, InstCtx, KernelId, PlanInfo, StreamIndex, TensorView,
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
    fn launch_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<B::Buffer>],
        outputs: &[&TensorView<B::Buffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        self.inner.launch_kernel(kernel, inputs, outputs, args, ctx)
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
    fn end_group(&mut self, label: usize, ctx: InstCtx<'_>) -> Result<B::Comm, BackendError> {
        self.inner.end_group(label, ctx)
    }
    fn wait(&mut self, comm: &B::Comm, ctx: InstCtx<'_>) -> Result<(), BackendError> {
        self.inner.wait(comm, ctx)
    }
    fn finish(&mut self) -> Result<(), BackendError> {
        self.inner.finish()
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

fn run_cell(case: &str, d: usize, kind: Kind) {
    let (l1, host, at, inst) = build(case, d as i64);
    let per_rank = scatter_inputs(&l1, &random_inputs(&l1, 9).unwrap()).unwrap();
    let failed = d / 2;
    let cell = format!("{case} / {d} GPUs / {kind:?}");
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new(format!("gpu-faults-{d}")));
    let abort = AbortSignal::new();
    let empty = BTreeMap::new();
    let fds = open_fds();
    let start = Instant::now();
    let errors: Vec<(DeviceId, Result<(), String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..d)
            .map(|rank| {
                let (host, rdv, abort) = (&host, rdv.clone(), &abort);
                let inputs = per_rank.get(&rank).unwrap_or(&empty);
                let fault = (rank == failed).then_some((at, kind));
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
    });
    let elapsed = start.elapsed();
    // As the launcher does after a failed run (the ranks may disagree about which
    // communicators are healthy): abort and forget the cached communicators, which ends
    // NCCL's threads (they inherit the rank threads' names, so they would count below).
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
    assert_eq!(
        threads_left("gpu-fault-rank"),
        0,
        "{cell}: a rank thread survived"
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
