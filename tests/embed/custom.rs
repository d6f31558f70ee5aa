//! External compute: a `custom` op's kernel is called by `call_kernel` with the local
//! chunks of its operands and the documented scalar arguments, and serves as the reference.

use crate::support::embed as embed_support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use embed_support::{bias_gelu, inputs, kernels, mlp, run_ranks, this_rank};
use meshflow::ir::{DType, DeviceMesh, ParallelType::*, Program, ProgramBuilder, TensorType};
use meshflow::runtime::reference::{evaluate, evaluate_with, ReferenceError};
use meshflow::runtime::{run_and_compare, CpuOptions};
use meshflow::{compile, Bindings, CpuConfig, CpuJob, CpuKernels, Options, TensorData};

/// `y = bias_gelu(x, b)` over 2 ranks: `x[8, 6]` split on rows, `b[6]` replicated, `y`
/// split on rows and Stream-split into 2 chunks of 2 rows per rank; op args `[7, -1]`.
fn chunked() -> Program {
    let mut b = ProgramBuilder::new("chunked");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![2], 0).expect("mesh"))
        .expect("mesh");
    let x = b.input("x", DType::F32, &[8, 6], m).expect("x");
    let bias = b.input("b", DType::F32, &[6], m).expect("b");
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    b.replicate(bias);
    let ty = TensorType::new(DType::F32, &[8, 6]);
    let y = b
        .custom("bias_gelu", &[x, bias], &[ty], &[7, -1])
        .expect("custom")[0];
    b.rename(y, "y").expect("name");
    b.schedule(y)
        .outer_split(0, 2)
        .parallelize(0, DIDx)
        .outer_split(1, 2)
        .parallelize(1, Stream);
    b.output(y);
    b.build().expect("verifies")
}

/// One kernel call as the kernel saw it.
#[derive(Clone, Debug, PartialEq)]
struct Call {
    rank: usize,
    shapes: Vec<Vec<u64>>,
    args: Vec<i64>,
    x: Vec<f32>,
}

#[test]
fn the_kernel_gets_the_local_chunks_and_the_args() {
    let program = chunked();
    let compiled = compile(&program, &Options::for_ranks(2)).expect("compiles");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut k = CpuKernels::new();
    let log = calls.clone();
    k.register("bias_gelu", move |ins, outs, args| {
        let mut shapes: Vec<Vec<u64>> = ins.iter().map(|v| v.shape().to_vec()).collect();
        shapes.extend(outs.iter().map(|v| v.shape().to_vec()));
        log.lock().expect("log").push(Call {
            rank: this_rank().unwrap_or(usize::MAX),
            shapes,
            args: args.to_vec(),
            x: ins[0].to_f32(),
        });
        let y = bias_gelu(&ins[0].to_f32(), &ins[1].to_f32());
        outs[0].assign_f32(&y).map_err(|e| e.to_string())
    });
    let job = CpuJob::for_program(
        &compiled,
        CpuConfig {
            kernels: k,
            ..CpuConfig::default()
        },
    );
    let xs: Vec<f32> = (0..48).map(|v| v as f32 / 48.0).collect();
    let bs: Vec<f32> = (0..6).map(|v| v as f32 / 10.0).collect();
    let x = TensorData::from_f32(DType::F32, &[8, 6], &xs).expect("x");
    let bias = TensorData::from_f32(DType::F32, &[6], &bs).expect("b");
    let x_parts = compiled.scatter("x", &x).expect("scatter");
    let results = run_ranks(&compiled, &job, |exec| {
        let mut y = TensorData::zeros(DType::F32, &[4, 6])?;
        let mut b = Bindings::new();
        b.input("x", &x_parts[&exec.rank()])
            .input("b", &bias)
            .output("y", &mut y);
        exec.run(&mut b)?;
        drop(b);
        Ok(y)
    });
    let ys: BTreeMap<usize, TensorData> = results
        .into_iter()
        .enumerate()
        .map(|(r, y)| (r, y.unwrap_or_else(|e| panic!("rank {r}: {e}"))))
        .collect();
    let y = compiled.gather("y", &ys).expect("gather");
    assert_eq!(y.storage().to_f32_vec(), bias_gelu(&xs, &bs));

    let mut calls = calls.lock().expect("log").clone();
    calls.sort_by(|a, b| {
        (a.rank, &a.x[..1])
            .partial_cmp(&(b.rank, &b.x[..1]))
            .expect("finite")
    });
    assert_eq!(calls.len(), 4, "2 ranks x 2 stream chunks: {calls:?}");
    for (i, call) in calls.iter().enumerate() {
        let (rank, chunk) = (i / 2, i % 2);
        assert_eq!(call.rank, rank);
        // x chunk [2, 6], the whole bias [6], y chunk [2, 6].
        assert_eq!(call.shapes, [vec![2, 6], vec![6], vec![2, 6]]);
        // The op's args, then the chunk's extents.
        assert_eq!(call.args, [7, -1, 2, 6]);
        // Rows 4 * rank + 2 * chunk .. + 2 of the full x.
        let first = (4 * rank + 2 * chunk) * 6;
        assert_eq!(call.x, &xs[first..first + 12]);
    }
}

#[test]
fn the_cpu_kernel_is_the_reference_of_the_custom_op() {
    let program = mlp(4);
    let full = inputs(&program, 11);
    let e = evaluate(&program, &full).expect_err("no kernels");
    assert!(
        matches!(e, ReferenceError::NoKernel { ref kernel, .. } if kernel == "bias_gelu"),
        "{e}"
    );
    let want = evaluate_with(&program, &full, &kernels()).expect("reference");
    assert_eq!(want["y"].shape(), [4, 6]);
    // A sharded CPU run of the compiled program agrees with it.
    let compiled = compile(&program, &Options::for_ranks(4)).expect("compiles");
    let options = CpuOptions {
        config: CpuConfig {
            kernels: kernels(),
            ..CpuConfig::default()
        },
        ..CpuOptions::default()
    };
    let level1 = compiled.program().expect("compiled here");
    let cmp = run_and_compare(level1, compiled.host(), 4, 11, &options).expect("runs");
    assert!(cmp.passed(), "{cmp}");
}
