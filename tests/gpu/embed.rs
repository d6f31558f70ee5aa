//! The embedding API on GPUs: the caller's streams, device buffers (written in place) and
//! borrowed NCCL communicators; the front end's PTX kernel behind a `custom` op; steps
//! recorded as CUDA graphs (`Options::graph`).
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`); without enough GPUs each
//! test prints why it skipped.
#![cfg(feature = "cuda")]

use crate::support::embed as embed_support;
use crate::support::gpu as support;

use std::collections::BTreeMap;

use embed_support::{inputs, kernels, mlp};
use meshflow::ir::DType;
use meshflow::kernels::nccl::{Comm, NcclLib};
use meshflow::kernels::{Device, DeviceBuffer, Stream};
use meshflow::runtime::reference::evaluate_with;
use meshflow::{
    compile, Bindings, CudaConfig, CudaJob, CudaResources, CudaTensor, Error, Executor, GridDims,
    Options, TensorData,
};

const BIAS_GELU_PTX: &str = include_str!("../../examples/kernels/bias_gelu.ptx");

fn config() -> CudaConfig {
    let mut config = CudaConfig {
        timeout: std::time::Duration::from_secs(60),
        ..CudaConfig::default()
    };
    config
        .kernels
        .register("bias_gelu", BIAS_GELU_PTX, "bias_gelu", |_, outs, _| {
            GridDims::linear(outs[0].iter().product(), 128)
        });
    config
}

fn device_tensor(stream: &Stream, t: &TensorData) -> Result<CudaTensor, Error> {
    Ok(CudaTensor {
        buffer: DeviceBuffer::from_slice(stream, &t.storage().to_f32_vec())?,
        dtype: t.dtype(),
        shape: t.shape().to_vec(),
    })
}

#[test]
fn the_callers_stream_buffers_and_communicators_run_the_mlp() {
    let counts = support::rank_counts("the_callers_stream_buffers_and_communicators_run_the_mlp");
    // Each step issued as is, then each step recorded as a CUDA graph and replayed.
    for (d, graph) in counts.into_iter().flat_map(|d| [(d, false), (d, true)]) {
        let program = mlp(d as u64);
        let compiled = compile(&program, &Options::for_ranks(d).graph(graph)).expect("compiles");
        let job = CudaJob::for_program(&compiled, config());
        let devices: Vec<Device> = (0..d).map(|r| Device::new(r).expect("device")).collect();
        let lib = NcclLib::load().expect("NCCL");
        let comms = Comm::init_all(&lib, &devices).expect("communicators");
        let steps: Vec<BTreeMap<String, TensorData>> =
            (0..2).map(|s| inputs(&program, 40 + s)).collect();
        let results: Vec<Result<Vec<Vec<f32>>, Error>> = std::thread::scope(|s| {
            let threads: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (compiled, job, lib, steps) = (&compiled, &job, &lib, &steps);
                    let device = devices[rank].clone();
                    s.spawn(move || -> Result<Vec<Vec<f32>>, Error> {
                        let stream = Stream::new(&device)?;
                        // SAFETY: `comm` lives until the end of this closure, after the
                        // executor; nothing else uses it meanwhile.
                        let borrowed =
                            unsafe { Comm::from_raw_borrowed(lib, comm.as_raw(), &device)? };
                        let resources = CudaResources {
                            device: device.clone(),
                            stream: Some(stream.clone()),
                            comms: vec![((0..d).collect(), borrowed)],
                        };
                        let backend = job.backend(rank, resources)?;
                        let mut exec = Executor::new(compiled, rank, backend)?;
                        let y = DeviceBuffer::alloc(&device, 4 * 6 * 4)?;
                        let mut ys = Vec::new();
                        for full in steps {
                            let mut b = Bindings::new();
                            for (name, t) in full {
                                let local = &compiled.scatter(name, t)?[&rank];
                                b.device(name.clone(), device_tensor(&stream, local)?);
                            }
                            let y_tensor = CudaTensor {
                                buffer: y.clone(),
                                dtype: DType::F32,
                                shape: vec![4, 6],
                            };
                            b.device("y", y_tensor);
                            let unbound = exec.run(&mut b)?;
                            assert!(unbound.is_empty());
                            ys.push(y.to_vec::<f32>(&stream)?);
                        }
                        drop(exec);
                        // The borrowed communicator was neither destroyed nor aborted.
                        comm.check_async_error()?;
                        Ok(ys)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("rank thread"))
                .collect()
        });
        for (rank, r) in results.into_iter().enumerate() {
            let ys = r.unwrap_or_else(|e| panic!("d={d} graph={graph} rank {rank}: {e}"));
            for (s, full) in steps.iter().enumerate() {
                let want = evaluate_with(&program, full, &kernels()).expect("reference");
                let got = TensorData::from_f32(DType::F32, &[4, 6], &ys[s]).expect("y");
                let e = got.rel_error(&want["y"]).expect("comparable");
                eprintln!("d={d} graph={graph} rank {rank} step {s}: rel err {e:.2e}");
                assert!(
                    e < 1e-4,
                    "d={d} graph={graph} rank {rank} step {s}: rel err {e}"
                );
            }
        }
    }
}

#[test]
fn borrowed_handles_are_checked() {
    if support::skip_unless(1, "borrowed_handles_are_checked") {
        return;
    }
    let device = Device::new(0).expect("device");
    // The legacy default stream is a valid caller stream.
    // SAFETY: the null stream lives as long as the context.
    let null = unsafe { Stream::from_raw_borrowed(&device, std::ptr::null_mut()) }.expect("wrap");
    let owned = DeviceBuffer::from_slice(&null, &[1.0f32, 2.0, 3.0, 4.0]).expect("alloc");
    // A caller tensor whose bytes do not match its type is refused before the run.
    let compiled = compile(&mlp(1), &Options::for_ranks(1)).expect("compiles");
    let job = CudaJob::for_program(&compiled, config());
    let resources = CudaResources {
        device: device.clone(),
        stream: Some(null.clone()),
        comms: Vec::new(),
    };
    let mut exec =
        Executor::new(&compiled, 0, job.backend(0, resources).expect("backend")).expect("exec");
    let program = mlp(1);
    let full = inputs(&program, 3);
    let mut b = Bindings::new();
    for (name, t) in &full {
        b.device(name.clone(), device_tensor(&null, t).expect("upload"));
    }
    b.device(
        "y",
        CudaTensor {
            buffer: owned.clone(),
            dtype: DType::F32,
            shape: vec![4, 6],
        },
    );
    let e = exec.run(&mut b).expect_err("16 bytes for f32[4, 6]");
    assert!(
        e.to_string().contains("needs 96 bytes, the buffer has 16"),
        "{e}"
    );
    // A communicator for a team without this rank is refused.
    let lib = NcclLib::load().expect("NCCL");
    let comm = Comm::init_all(&lib, std::slice::from_ref(&device))
        .expect("communicator")
        .remove(0);
    let resources = CudaResources {
        device,
        stream: None,
        comms: vec![(vec![1], comm)],
    };
    let e = CudaJob::new(2, config())
        .backend(0, resources)
        .expect_err("not a member");
    assert!(e.to_string().contains("without this rank"), "{e}");
}

#[test]
fn ranks_of_a_multi_process_job_that_lowered_different_programs_are_refused() {
    if support::skip_unless(
        1,
        "ranks_of_a_multi_process_job_that_lowered_different_programs_are_refused",
    ) {
        return;
    }
    use meshflow::front::agree::AgreeError;
    use meshflow::runtime::rendezvous::{Rendezvous, TcpRendezvous, TorchrunEnv};
    use std::sync::Arc;
    // Two ranks (threads, each with its own connection to a TCP store, as processes would
    // have) lowered the searched all-gather for different GPU models without agreeing: making
    // rank 1's backend fails naming both ranks, and rank 0 learns why at its next wait.
    let text = std::fs::read_to_string(
        crate::support::root().join("tests/data/agree/allgather_linear_searched.mf"),
    )
    .expect("the test program");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let timeout = std::time::Duration::from_secs(60);
    // Rank 0 serves the store: no rank leaves before both are done.
    let done = std::sync::Barrier::new(2);
    let results: Vec<(Result<(), Error>, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2usize)
            .map(|rank| {
                let (text, done) = (&text, &done);
                s.spawn(move || {
                    let env = TorchrunEnv {
                        rank,
                        world_size: 2,
                        local_rank: rank,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                    };
                    let rdv: Arc<dyn Rendezvous> =
                        Arc::new(TcpRendezvous::connect(&env, timeout).expect("the store"));
                    let gpu = ["NVIDIA H200", "NVIDIA H100 80GB HBM3"][rank];
                    let options = Options::for_ranks(2).device(gpu);
                    let program = meshflow::parse(text, &options).expect("parses");
                    let compiled = compile(&program, &options).expect("compiles");
                    let job =
                        CudaJob::for_program_with_rendezvous(&compiled, config(), rdv.clone());
                    // Both ranks on GPU 0: the check comes before any device work.
                    let made = job.backend_on(rank, 0).map(drop);
                    let next = rdv
                        .barrier("test/next", 2, timeout)
                        .map_err(|e| e.to_string())
                        .err()
                        .unwrap_or_default();
                    done.wait();
                    (made, next)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    assert!(results[0].0.is_ok(), "{:?}", results[0].0);
    match &results[1].0 {
        Err(Error::Agreement(AgreeError::Programs(reason))) => {
            assert!(
                reason.starts_with("rank 1 lowered a different host program than rank 0"),
                "{reason}"
            );
            assert!(reason.contains("h100x2: built-in profile of NVIDIA H100 80GB HBM3"));
            assert!(reason.contains("h200x2: built-in profile of NVIDIA H200"));
            for (rank, (_, next)) in results.iter().enumerate() {
                assert!(next.contains(reason.as_str()), "rank {rank}: {next}");
            }
        }
        other => panic!("rank 1: {other:?}"),
    }
}
