//! Helpers of the embedding API tests: running every rank of a job on threads, the fused
//! bias + GELU kernel, a tensor-parallel MLP that uses it.

use std::collections::BTreeMap;

use meshflow::ir::DeviceMesh;
use meshflow::ir::{DType, DeviceId, ParallelType::*, Program, ProgramBuilder, TensorType};
use meshflow::runtime::cpu_ops::gelu_scalar;
use meshflow::runtime::data::Storage;
use meshflow::{Compiled, CpuBackend, CpuJob, CpuKernels, Error, Executor, TensorData};

/// Runs `step` for every rank of `job` on its own thread (named `rank-R`) with that rank's
/// executor, and returns the results by rank.
pub fn run_ranks<T: Send>(
    compiled: &Compiled,
    job: &CpuJob,
    step: impl Fn(&mut Executor<'_, CpuBackend>) -> Result<T, Error> + Sync,
) -> Vec<Result<T, Error>> {
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..job.world_size())
            .map(|rank| {
                let step = &step;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let mut exec = Executor::new(compiled, rank, job.backend(rank)?)?;
                        step(&mut exec)
                    })
                    .expect("spawn a rank thread")
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The rank running on this thread (from its name `rank-R`).
pub fn this_rank() -> Option<DeviceId> {
    std::thread::current()
        .name()?
        .strip_prefix("rank-")?
        .parse()
        .ok()
}

/// The address of a tensor's elements (to check a buffer was written in place).
pub fn data_ptr(t: &TensorData) -> usize {
    match t.storage() {
        Storage::F32(v) => v.as_ptr() as usize,
        Storage::BF16(v) => v.as_ptr() as usize,
        Storage::F16(v) => v.as_ptr() as usize,
        Storage::I32(v) => v.as_ptr() as usize,
        Storage::I64(v) => v.as_ptr() as usize,
    }
}

/// `y = gelu(x + b)` with `b` broadcast along the leading axes of `x`.
pub fn bias_gelu(x: &[f32], b: &[f32]) -> Vec<f32> {
    x.iter()
        .enumerate()
        .map(|(i, v)| gelu_scalar(v + b[i % b.len().max(1)]))
        .collect()
}

/// Kernels with the fused `bias_gelu` (inputs `x`, `b`; output `y`).
pub fn kernels() -> CpuKernels {
    let mut k = CpuKernels::new();
    k.register("bias_gelu", |ins, outs, _args| {
        let [x, b] = ins else {
            return Err(format!("bias_gelu takes 2 inputs, got {}", ins.len()));
        };
        let [y] = outs else {
            return Err("bias_gelu writes 1 output".into());
        };
        y.assign_f32(&bias_gelu(&x.to_f32(), &b.to_f32()))
            .map_err(|e| e.to_string())
    });
    k
}

/// A tensor-parallel MLP over `d` ranks: `a = bias_gelu(linear(x, w1), b1)`, `y =
/// linear(a, w2)`, with `w1`, `b1` split on the hidden axis and `w2` on its input axis.
pub fn mlp(d: u64) -> Program {
    let (m_, f, h) = (4, 4 * d, 6);
    let mut b = ProgramBuilder::new("mlp_custom");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).expect("mesh"))
        .expect("mesh");
    let x = b.input("x", DType::F32, &[m_, h], m).expect("x");
    let w1 = b.input("w1", DType::F32, &[f, h], m).expect("w1");
    let b1 = b.input("b1", DType::F32, &[f], m).expect("b1");
    let w2 = b.input("w2", DType::F32, &[h, f], m).expect("w2");
    b.replicate(x);
    b.schedule(w1).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(b1).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w2).outer_split(1, d).parallelize(1, DIDx);
    let hid = b.linear(x, w1).expect("linear");
    let a = b
        .custom(
            "bias_gelu",
            &[hid, b1],
            &[TensorType::new(DType::F32, &[m_, f])],
            &[],
        )
        .expect("custom")[0];
    let y = b.linear(a, w2).expect("linear");
    b.rename(y, "y").expect("name");
    b.output(y);
    b.build().expect("verifies")
}

/// Seeded full inputs of `program`.
pub fn inputs(program: &Program, seed: u64) -> BTreeMap<String, TensorData> {
    meshflow::runtime::compare::random_inputs(program, seed).expect("inputs")
}
