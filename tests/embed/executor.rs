//! The embedding API's executor on the CPU backend: one executor per rank on threads,
//! caller-owned tensors written in place, reuse across steps, binding and rank errors, and
//! a failing rank stopping the others.

use crate::support::embed as embed_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use embed_support::{data_ptr, inputs, kernels, mlp, run_ranks};
use meshflow::ir::DType;
use meshflow::runtime::reference::evaluate_with;
use meshflow::{
    compile, Bindings, Compiled, CpuConfig, CpuJob, Error, Executor, Options, TensorData,
};

fn config() -> CpuConfig {
    CpuConfig {
        kernels: kernels(),
        ..CpuConfig::default()
    }
}

/// The ring column-parallel linear of `examples/programs`, for `ranks` ranks.
fn ring(ranks: usize) -> Compiled {
    let text = include_str!("../../examples/programs/column_parallel_linear_ring.mf");
    let options = Options::for_ranks(ranks);
    compile(&meshflow::parse(text, &options).expect("parses"), &options).expect("compiles")
}

/// Runs one step of `compiled` on every rank with the full `inputs` cut by layout, outputs
/// bound to fresh caller buffers; returns the gathered outputs and, per rank, whether each
/// output buffer kept its address.
fn step(
    compiled: &Compiled,
    job: &CpuJob,
    full: &BTreeMap<String, TensorData>,
) -> (BTreeMap<String, TensorData>, bool) {
    let parts: BTreeMap<String, BTreeMap<usize, TensorData>> = full
        .iter()
        .map(|(n, t)| (n.clone(), compiled.scatter(n, t).expect("scatter")))
        .collect();
    let results = run_ranks(compiled, job, |exec| {
        let rank = exec.rank();
        let mut outs: Vec<(String, TensorData)> = exec
            .outputs()
            .into_iter()
            .map(|o| {
                let t = TensorData::zeros(o.dtype, &o.shape).expect("zeros");
                (o.name, t)
            })
            .collect();
        let before: Vec<usize> = outs.iter().map(|(_, t)| data_ptr(t)).collect();
        let mut b = Bindings::new();
        for (name, per_rank) in &parts {
            if let Some(t) = per_rank.get(&rank) {
                b.input(name.clone(), t);
            }
        }
        for (name, t) in outs.iter_mut() {
            b.output(name.clone(), t);
        }
        let unbound = exec.run(&mut b)?;
        assert!(unbound.is_empty(), "every output was bound");
        drop(b);
        let in_place = outs
            .iter()
            .zip(&before)
            .all(|((_, t), &p)| data_ptr(t) == p);
        Ok((outs, in_place))
    });
    let mut per_output: BTreeMap<String, BTreeMap<usize, TensorData>> = BTreeMap::new();
    let mut in_place = true;
    for (rank, r) in results.into_iter().enumerate() {
        let (outs, p) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        in_place &= p;
        for (name, t) in outs {
            per_output.entry(name).or_default().insert(rank, t);
        }
    }
    let gathered = per_output
        .iter()
        .map(|(n, locals)| (n.clone(), compiled.gather(n, locals).expect("gather")))
        .collect();
    (gathered, in_place)
}

fn assert_close(got: &TensorData, want: &TensorData, tol: f64) {
    let e = got.rel_error(want).expect("comparable");
    assert!(e < tol, "relative error {e}");
}

#[test]
fn outputs_are_written_in_place_into_caller_buffers() {
    let compiled = ring(4);
    let program = compiled.program().expect("compiled here");
    let full = inputs(program, 1);
    let job = CpuJob::for_program(&compiled, CpuConfig::default());
    let (got, in_place) = step(&compiled, &job, &full);
    assert!(
        in_place,
        "outputs must be written into the caller's allocations"
    );
    let want = evaluate_with(program, &full, &kernels()).expect("reference");
    assert_close(&got["y"], &want["y"], 1e-2);
}

#[test]
fn an_executor_is_reused_across_steps_with_a_custom_op() {
    let program = mlp(4);
    let compiled = compile(&program, &Options::for_ranks(4)).expect("compiles");
    assert_eq!(compiled.kernels(), ["bias_gelu"]);
    let job = CpuJob::for_program(&compiled, config());
    let steps: Vec<BTreeMap<String, TensorData>> = (0..3).map(|s| inputs(&program, s)).collect();
    // One executor per rank for all three steps; inputs bound mutably (no copy) and left
    // unchanged.
    let results = run_ranks(&compiled, &job, |exec| {
        let rank = exec.rank();
        let mut ys = Vec::new();
        for full in &steps {
            let mut locals: BTreeMap<String, TensorData> = full
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        compiled.scatter(n, t).expect("scatter")[&rank].clone(),
                    )
                })
                .collect();
            let snapshot = locals.clone();
            let mut y = TensorData::zeros(DType::F32, &[4, 6])?;
            let mut b = Bindings::new();
            for (n, t) in locals.iter_mut() {
                b.output(n.clone(), t);
            }
            b.output("y", &mut y);
            exec.run(&mut b)?;
            drop(b);
            assert_eq!(locals, snapshot, "inputs bound mutably are not modified");
            ys.push(y);
        }
        Ok(ys)
    });
    let ys: Vec<Vec<TensorData>> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    for (s, full) in steps.iter().enumerate() {
        let want = evaluate_with(&program, full, &kernels()).expect("reference");
        // `y` is replicated after the all-reduce: every rank holds all of it.
        for y in &ys {
            assert_close(&y[s], &want["y"], 1e-5);
        }
    }
}

#[test]
fn unbound_outputs_are_returned() {
    let compiled = ring(2);
    let program = compiled.program().expect("compiled here");
    let full = inputs(program, 3);
    let job = CpuJob::for_program(&compiled, CpuConfig::default());
    let results = run_ranks(&compiled, &job, |exec| {
        let rank = exec.rank();
        let locals: Vec<(String, TensorData)> = full
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    compiled.scatter(n, t).expect("scatter")[&rank].clone(),
                )
            })
            .collect();
        let mut b = Bindings::new();
        for (n, t) in &locals {
            b.input(n.clone(), t);
        }
        exec.run(&mut b)
    });
    let locals: BTreeMap<usize, TensorData> = results
        .into_iter()
        .enumerate()
        .map(|(r, o)| (r, o.expect("runs").remove("y").expect("y returned")))
        .collect();
    let want = evaluate_with(program, &full, &kernels()).expect("reference");
    assert_close(
        &compiled.gather("y", &locals).expect("gather"),
        &want["y"],
        1e-2,
    );
}

fn binding_error(compiled: &Compiled, mut b: Bindings<'_, meshflow::CpuBackend>) -> String {
    let job = CpuJob::for_program(compiled, CpuConfig::default());
    let mut exec = Executor::new(compiled, 0, job.backend(0).expect("backend")).expect("exec");
    match exec.run(&mut b) {
        Err(e @ (Error::Binding { .. } | Error::Backend { .. })) => e.to_string(),
        other => panic!("expected a binding error, got {other:?}"),
    }
}

#[test]
fn binding_errors_name_the_tensor_and_the_problem() {
    let compiled = ring(4);
    let x = TensorData::zeros(DType::BF16, &[16, 32]).expect("x");
    let w = TensorData::zeros(DType::BF16, &[12, 32]).expect("w");
    let w_wrong = TensorData::zeros(DType::F32, &[12, 32]).expect("w");
    let mut y = TensorData::zeros(DType::BF16, &[64, 12]).expect("y");
    let mut b = Bindings::new();
    b.input("x", &x);
    let e = binding_error(&compiled, b);
    assert!(e.contains("rank 0: binding `w`: input not bound"), "{e}");
    let mut b = Bindings::new();
    b.input("x", &x).input("w", &w_wrong);
    let e = binding_error(&compiled, b);
    assert!(
        e.contains("binding `w`: must be bf16[12, 32] on this rank, is f32[12, 32]"),
        "{e}"
    );
    let mut b = Bindings::new();
    b.input("x", &x).input("w", &w).input("z", &x);
    let e = binding_error(&compiled, b);
    assert!(
        e.contains(
            "binding `z`: the program has no input or output of that name (it has: x, w, y)"
        ),
        "{e}"
    );
    let mut b = Bindings::new();
    b.input("x", &x).input("w", &w);
    b.bind("y", meshflow::CpuTensor::Shared(&y));
    let e = binding_error(&compiled, b);
    assert!(e.contains("an output must be bound mutably"), "{e}");
    // A mutable binding lent to a run that failed is given back intact.
    let before = embed_support::data_ptr(&y);
    let mut b = Bindings::new();
    b.input("x", &x).input("w", &w_wrong).output("y", &mut y);
    binding_error(&compiled, b);
    assert_eq!(embed_support::data_ptr(&y), before);
    assert_eq!(y.numel(), 64 * 12);
}

#[test]
fn executors_check_ranks_and_kernels() {
    let compiled = compile(&mlp(4), &Options::for_ranks(4)).expect("compiles");
    let job = CpuJob::new(4, CpuConfig::default());
    let e = Executor::new(&compiled, 1, job.backend(2).expect("backend")).expect_err("wrong rank");
    assert!(
        matches!(
            e,
            Error::BackendRank {
                rank: 1,
                backend: 2
            }
        ),
        "{e}"
    );
    assert!(matches!(
        job.backend(4),
        Err(Error::Rank {
            rank: 4,
            world_size: 4
        })
    ));
    let e = Executor::new(&compiled, 0, job.backend(0).expect("backend")).expect_err("kernel");
    assert_eq!(
        e.to_string(),
        "rank 0: the program launches kernel `bias_gelu`, which is not registered with the backend"
    );
    // The job was told: the other ranks would stop instead of waiting.
    assert_eq!(job.failure().map(|f| f.0), Some(0));
}

#[test]
fn a_failing_rank_stops_the_others() {
    let program = mlp(4);
    let compiled = compile(&program, &Options::for_ranks(4)).expect("compiles");
    let mut config = config();
    config.timeout = Duration::from_secs(30);
    config.kernels.register("bias_gelu", |_, outs, _| {
        if embed_support::this_rank() == Some(2) {
            return Err("out of shared memory".into());
        }
        for y in outs.iter_mut() {
            y.fill_zero();
        }
        Ok(())
    });
    let job = CpuJob::for_program(&compiled, config);
    let full = inputs(&program, 5);
    let start = Instant::now();
    let results = run_ranks(&compiled, &job, |exec| {
        let rank = exec.rank();
        let locals: Vec<(String, TensorData)> = full
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    compiled.scatter(n, t).expect("scatter")[&rank].clone(),
                )
            })
            .collect();
        let mut y = TensorData::zeros(DType::F32, &[4, 6])?;
        let mut b = Bindings::new();
        for (n, t) in &locals {
            b.input(n.clone(), t);
        }
        b.output("y", &mut y);
        let r = exec.run(&mut b);
        drop(b);
        // The caller's buffer is given back after a failed run too.
        assert_eq!(y.storage().len(), 24);
        r
    });
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "ranks waited for the timeout"
    );
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank fails").to_string();
        if rank == 2 {
            assert!(
                e.contains("kernel `bias_gelu` failed: out of shared memory"),
                "{e}"
            );
        } else {
            assert!(e.contains("rank 2"), "rank {rank}: {e}");
        }
    }
    assert_eq!(job.failure().map(|f| f.0), Some(2));
}

#[test]
fn recording_graphs_on_the_cpu_backend_is_refused_when_the_executor_is_made() {
    let text = include_str!("../../examples/programs/column_parallel_linear_ring.mf");
    let options = Options::for_ranks(1).graph(true);
    let program = meshflow::parse(text, &options).expect("parses");
    let compiled = compile(&program, &options).expect("compiles");
    assert!(compiled.records_graphs());
    let job = CpuJob::for_program(&compiled, CpuConfig::default());
    let e = Executor::new(&compiled, 0, job.backend(0).expect("backend"))
        .expect_err("the CPU backend records no graphs");
    assert!(e.to_string().contains("does not record graphs"), "{e}");
}
