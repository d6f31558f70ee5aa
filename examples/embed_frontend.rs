//! A tiny front end that uses meshflow as its backend.
//!
//! The front end has its own op, a fused `bias_gelu(h, b) = gelu(h + b)` for which it brings
//! its own kernel: a Rust closure on the CPU backend, a PTX kernel on GPUs. It describes a
//! tensor-parallel MLP (`y = bias_gelu(x @ w1^T, b1) @ w2^T`, hidden axis split over the
//! ranks), lowers it with meshflow (the communication — here the all-reduce of the partial
//! sums — and the schedule are meshflow's), runs it with one executor per rank on threads,
//! on tensors it owns, and checks every rank's output against its own single-device
//! computation.
//!
//! ```sh
//! cargo run --example embed_frontend                  # 4 CPU ranks
//! cargo run --example embed_frontend --features cuda  # then on the GPUs, if there are
//! ```

#![allow(clippy::print_stdout)] // an example binary prints its result

use std::process::ExitCode;

use meshflow::ir::{DType, DeviceMesh, ParallelType::DIDx, Program, ProgramBuilder, TensorType};
use meshflow::runtime::data::SplitMix64;
use meshflow::{compile, Bindings, Compiled, CpuConfig, CpuJob, Executor, Options, TensorData};

/// The front end's model: sizes, and the weights as it stores them (full, row-major f32).
struct Mlp {
    tokens: u64,
    model: u64,
    hidden: u64,
    ranks: u64,
    x: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
}

/// The front end's own op: `gelu(h + b)`, `b` broadcast over the rows of `h`.
fn bias_gelu(h: &[f32], b: &[f32]) -> Vec<f32> {
    h.iter()
        .enumerate()
        .map(|(i, &v)| {
            let v = v + b[i % b.len()];
            0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044_715 * v * v * v)).tanh())
        })
        .collect()
}

impl Mlp {
    fn new(tokens: u64, model: u64, hidden: u64, ranks: u64) -> Mlp {
        let mut rng = SplitMix64::new(7);
        let mut values = |n: u64| -> Vec<f32> { (0..n).map(|_| rng.next_f32() - 0.5).collect() };
        Mlp {
            tokens,
            model,
            hidden,
            ranks,
            x: values(tokens * model),
            w1: values(hidden * model),
            b1: values(hidden),
            w2: values(model * hidden),
        }
    }

    /// Lowers the model to a meshflow program: `w1` and `b1` split on the hidden axis, `w2`
    /// on its input axis, `x` replicated; meshflow propagates the rest.
    fn program(&self) -> Result<Program, meshflow::Error> {
        let (t, m, h, d) = (self.tokens, self.model, self.hidden, self.ranks);
        let mut b = ProgramBuilder::new("frontend_mlp");
        let mesh = b.mesh("tp", DeviceMesh::iota(vec![d as usize], 0)?)?;
        let x = b.input("x", DType::F32, &[t, m], mesh)?;
        let w1 = b.input("w1", DType::F32, &[h, m], mesh)?;
        let b1 = b.input("b1", DType::F32, &[h], mesh)?;
        let w2 = b.input("w2", DType::F32, &[m, h], mesh)?;
        b.replicate(x);
        b.schedule(w1).outer_split(0, d).parallelize(0, DIDx);
        b.schedule(b1).outer_split(0, d).parallelize(0, DIDx);
        b.schedule(w2).outer_split(1, d).parallelize(1, DIDx);
        let pre = b.linear(x, w1)?;
        let act = b.custom(
            "bias_gelu",
            &[pre, b1],
            &[TensorType::new(DType::F32, &[t, h])],
            &[],
        )?[0];
        let y = b.linear(act, w2)?;
        b.rename(y, "y")?;
        b.output(y);
        Ok(b.build()?)
    }

    /// The front end's own single-device computation.
    fn reference(&self) -> Vec<f32> {
        let (t, m, h) = (
            self.tokens as usize,
            self.model as usize,
            self.hidden as usize,
        );
        let linear = |a: &[f32], w: &[f32], rows: usize, k: usize, n: usize| -> Vec<f32> {
            (0..rows * n)
                .map(|i| (0..k).map(|j| a[i / n * k + j] * w[i % n * k + j]).sum())
                .collect()
        };
        let act = bias_gelu(&linear(&self.x, &self.w1, t, m, h), &self.b1);
        linear(&act, &self.w2, t, h, m)
    }

    /// The full input tensors, by name.
    fn inputs(&self) -> Result<Vec<(&'static str, TensorData)>, meshflow::Error> {
        let (t, m, h) = (self.tokens, self.model, self.hidden);
        Ok(vec![
            ("x", TensorData::from_f32(DType::F32, &[t, m], &self.x)?),
            ("w1", TensorData::from_f32(DType::F32, &[h, m], &self.w1)?),
            ("b1", TensorData::from_f32(DType::F32, &[h], &self.b1)?),
            ("w2", TensorData::from_f32(DType::F32, &[m, h], &self.w2)?),
        ])
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs every rank on the CPU backend, one thread and one executor each, on tensors this
/// front end owns; returns each rank's `y`.
fn run_cpu(mlp: &Mlp, compiled: &Compiled) -> Result<Vec<Vec<f32>>, meshflow::Error> {
    let mut config = CpuConfig::default();
    config.kernels.register("bias_gelu", |ins, outs, _args| {
        let ([h, b], [y]) = (ins, outs) else {
            return Err("bias_gelu takes (h, b) -> y".into());
        };
        y.assign_f32(&bias_gelu(&h.to_f32(), &b.to_f32()))
            .map_err(|e| e.to_string())
    });
    let job = CpuJob::for_program(compiled, config);
    // The per-rank slices of the weights, cut by the layouts meshflow chose.
    let parts = mlp
        .inputs()?
        .into_iter()
        .map(|(name, full)| Ok((name, compiled.scatter(name, &full)?)))
        .collect::<Result<Vec<_>, meshflow::Error>>()?;
    let y_shape = [mlp.tokens, mlp.model];
    let mut ys = vec![TensorData::zeros(DType::F32, &y_shape)?; job.world_size()];
    std::thread::scope(|s| {
        let threads: Vec<_> = ys
            .iter_mut()
            .enumerate()
            .map(|(rank, y)| {
                let (job, parts) = (&job, &parts);
                s.spawn(move || -> Result<(), meshflow::Error> {
                    let mut exec = Executor::new(compiled, rank, job.backend(rank)?)?;
                    let mut bindings = Bindings::new();
                    for (name, per_rank) in parts {
                        if let Some(local) = per_rank.get(&rank) {
                            bindings.input(*name, local);
                        }
                    }
                    bindings.output("y", y);
                    // Two training-like steps on one executor; `y` is written in place.
                    exec.run(&mut bindings)?;
                    exec.run(&mut bindings)?;
                    Ok(())
                })
            })
            .collect();
        threads
            .into_iter()
            .try_for_each(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })?;
    Ok(ys.iter().map(|y| y.storage().to_f32_vec()).collect())
}

fn check(what: &str, want: &[f32], got: &[Vec<f32>]) -> bool {
    let err = got
        .iter()
        .map(|y| max_abs_diff(y, want))
        .fold(0.0, f32::max);
    let ok = got.iter().all(|y| y.len() == want.len()) && err < 1e-4;
    println!(
        "{what}: {} ranks, max |y - reference| = {err:.2e}: {}",
        got.len(),
        if ok { "ok" } else { "MISMATCH" }
    );
    ok
}

fn main() -> ExitCode {
    let mlp = Mlp::new(8, 16, 64, 4);
    let result = (|| -> Result<bool, meshflow::Error> {
        let compiled = compile(&mlp.program()?, &Options::for_ranks(4))?;
        println!("{}", compiled.host_text());
        let want = mlp.reference();
        let mut ok = check("cpu", &want, &run_cpu(&mlp, &compiled)?);
        // On GPUs: as many ranks as there are GPUs, up to 4 (the same model, split fewer ways).
        if let Some(ranks) = gpu::ranks() {
            let mlp = Mlp::new(8, 16, 64, ranks);
            let want = mlp.reference();
            ok &= check(
                "cpu",
                &want,
                &run_cpu(
                    &mlp,
                    &compile(&mlp.program()?, &Options::for_ranks(ranks as usize))?,
                )?,
            );
            ok &= gpu::run(&mlp, &want)?;
        }
        Ok(ok)
    })();
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    /// Without feature `cuda` there is nothing to run on GPUs.
    pub fn ranks() -> Option<u64> {
        println!("gpu: skipped (build with --features cuda)");
        None
    }

    /// Never called without feature `cuda`.
    pub fn run(_: &super::Mlp, _: &[f32]) -> Result<bool, meshflow::Error> {
        Ok(true)
    }
}

/// The same model on GPUs, on the front end's own resources: its streams, its device buffers
/// (bound in place) and its NCCL communicators (handed in borrowed), with the fused kernel as
/// PTX.
#[cfg(feature = "cuda")]
mod gpu {
    use meshflow::ir::DType;
    use meshflow::kernels::nccl::{Comm, NcclLib};
    use meshflow::kernels::{Device, DeviceBuffer, Stream};
    use meshflow::{
        compile, Bindings, CudaConfig, CudaJob, CudaResources, CudaTensor, Executor, GridDims,
        Options,
    };

    /// The fused kernel: `(h, b, y, rows, cols)`.
    const BIAS_GELU_PTX: &str = include_str!("kernels/bias_gelu.ptx");

    /// How many GPU ranks to run: every GPU, up to 4; `None` (with the reason printed) when
    /// there is no GPU.
    pub fn ranks() -> Option<u64> {
        match Device::count() {
            Ok(0) => {
                println!("gpu: skipped (no CUDA device)");
                None
            }
            Ok(n) => Some(n.min(4) as u64),
            Err(e) => {
                println!("gpu: skipped ({e})");
                None
            }
        }
    }

    pub fn run(mlp: &super::Mlp, want: &[f32]) -> Result<bool, meshflow::Error> {
        let ranks = mlp.ranks as usize;
        let compiled = compile(&mlp.program()?, &Options::for_ranks(ranks))?;
        let mut config = CudaConfig::default();
        config.kernels.register(
            "bias_gelu",
            BIAS_GELU_PTX,
            "bias_gelu",
            |_ins, outs, _args| GridDims::linear(outs[0].iter().product(), 256),
        );
        let job = CudaJob::for_program(&compiled, config);
        // The front end's own GPUs and communicators (one per rank, created together).
        let devices = (0..ranks).map(Device::new).collect::<Result<Vec<_>, _>>()?;
        let lib = NcclLib::load()?;
        let comms = Comm::init_all(&lib, &devices)?;
        let parts = mlp
            .inputs()?
            .into_iter()
            .map(|(name, full)| Ok((name, compiled.scatter(name, &full)?)))
            .collect::<Result<Vec<_>, meshflow::Error>>()?;
        let y_shape = vec![mlp.tokens, mlp.model];
        let ys = std::thread::scope(|s| {
            let threads: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (compiled, job, parts, lib) = (&compiled, &job, &parts, &lib);
                    let (device, y_shape) = (devices[rank].clone(), y_shape.clone());
                    s.spawn(move || -> Result<Vec<f32>, meshflow::Error> {
                        let stream = Stream::new(&device)?;
                        // SAFETY: `comm` is this thread's and outlives the executor (dropped
                        // first, at the end of this closure); nothing else uses it meanwhile.
                        let borrowed =
                            unsafe { Comm::from_raw_borrowed(lib, comm.as_raw(), &device)? };
                        let resources = CudaResources {
                            device: device.clone(),
                            stream: Some(stream.clone()),
                            comms: vec![((0..ranks).collect(), borrowed)],
                        };
                        let mut exec =
                            Executor::new(compiled, rank, job.backend(rank, resources)?)?;
                        let mut bindings = Bindings::new();
                        for (name, per_rank) in parts {
                            if let Some(local) = per_rank.get(&rank) {
                                let values = local.storage().to_f32_vec();
                                let buffer = DeviceBuffer::from_slice(&stream, &values)?;
                                let shape = local.shape().to_vec();
                                bindings.device(
                                    *name,
                                    CudaTensor {
                                        buffer,
                                        dtype: DType::F32,
                                        shape,
                                    },
                                );
                            }
                        }
                        let bytes = (y_shape.iter().product::<u64>() * 4) as usize;
                        let y = DeviceBuffer::alloc(&device, bytes)?;
                        bindings.device(
                            "y",
                            CudaTensor {
                                buffer: y.clone(),
                                dtype: DType::F32,
                                shape: y_shape,
                            },
                        );
                        exec.run(&mut bindings)?;
                        exec.run(&mut bindings)?;
                        drop(exec);
                        Ok(y.to_vec::<f32>(&stream)?)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(super::check("gpu", want, &ys))
    }
}
