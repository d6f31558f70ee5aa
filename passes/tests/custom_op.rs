//! `custom` ops through propagation, resharding and lowering to `call_kernel`.

mod common;

use meshflow_ir::{DType, Expr, InstKind, ParallelType::*, Program, TensorType};

/// A tensor-parallel MLP whose bias + GELU is the front end's own fused kernel: `w1` and `b1`
/// split on the hidden axis, `h` and `a` unannotated, `w2` split on its input axis.
fn mlp(d: u64, bias_replicated: bool) -> Program {
    let (m_, f, h) = (4, 8 * d, 6);
    let (mut b, m) = common::builder("mlp_custom", d as usize);
    let x = b.input("x", DType::F32, &[m_, h], m).unwrap();
    let w1 = b.input("w1", DType::F32, &[f, h], m).unwrap();
    let b1 = b.input("b1", DType::F32, &[f], m).unwrap();
    let w2 = b.input("w2", DType::F32, &[h, f], m).unwrap();
    b.replicate(x);
    b.schedule(w1).outer_split(0, d).parallelize(0, DIDx);
    if bias_replicated {
        b.replicate(b1);
    } else {
        b.schedule(b1).outer_split(0, d).parallelize(0, DIDx);
    }
    b.schedule(w2).outer_split(1, d).parallelize(1, DIDx);
    let hid = b.linear(x, w1).unwrap();
    b.rename(hid, "h").unwrap();
    let a = b
        .custom(
            "bias_gelu",
            &[hid, b1],
            &[TensorType::new(DType::F32, &[m_, f])],
            &[1],
        )
        .unwrap()[0];
    b.rename(a, "a").unwrap();
    let y = b.linear(a, w2).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

fn launches(host: &meshflow_ir::HostProgram) -> Vec<(String, Vec<String>, Vec<Expr>, usize)> {
    common::insts(host)
        .into_iter()
        .filter_map(|(i, depth)| match &i.kind {
            InstKind::CallKernel {
                kernel,
                inputs,
                args,
                ..
            } => Some((
                kernel.clone(),
                inputs
                    .iter()
                    .map(|&t| host.tensors[t].name.clone())
                    .collect(),
                args.clone(),
                depth,
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn tensor_parallel_mlp_with_a_custom_op_lowers_to_call_kernel() {
    let host = common::lower_full(&mlp(4, false));
    insta::assert_snapshot!(host.to_string());
    let l = launches(&host);
    assert_eq!(l.len(), 1, "{host}");
    let (kernel, inputs, args, depth) = &l[0];
    assert_eq!(kernel, "bias_gelu");
    assert_eq!(inputs, &["h", "b1"]);
    // The op's args, then the local shape of `a`: [4, 32 / 4].
    assert_eq!(args, &[Expr::c(1), Expr::c(4), Expr::c(8)]);
    assert_eq!(*depth, 0);
    // The hidden axis stays split: no communication before the custom op, one all-reduce
    // of the partial sums after the second linear.
    assert_eq!(common::count(&host, "all_reduce"), 1, "{host}");
    assert_eq!(
        host.tensors[host.tensor_by_name("a").unwrap()].shape,
        [4, 8]
    );
}

#[test]
fn a_replicated_input_is_resliced_to_the_split_the_custom_op_needs() {
    let out = common::run(&mlp(4, true), common::all_passes()).expect("lowers");
    let l = launches(&out.host);
    let (_, inputs, _, _) = &l[0];
    assert_eq!(inputs[0], "h");
    assert_ne!(inputs[1], "b1", "the bias must be resharded first");
    let resharded = out
        .program
        .tensor_by_name(&inputs[1])
        .expect("level-1 tensor");
    let def = out.program.definition(resharded).expect("defined by a set");
    assert_eq!(out.program.ops[def].kind, meshflow_ir::OpKind::Set);
    assert_eq!(
        out.host.tensors[out.host.tensor_by_name(&inputs[1]).unwrap()].shape,
        [8]
    );
}

#[test]
fn a_stream_split_custom_op_launches_per_chunk() {
    let (mut b, m) = common::builder("chunked", 2);
    let x = b.input("x", DType::F32, &[8, 6], m).unwrap();
    let bias = b.input("b", DType::F32, &[6], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    b.replicate(bias);
    let y = b
        .custom(
            "bias_gelu",
            &[x, bias],
            &[TensorType::new(DType::F32, &[8, 6])],
            &[],
        )
        .unwrap()[0];
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, 2)
        .parallelize(0, DIDx)
        .outer_split(1, 2)
        .parallelize(1, Stream);
    b.output(y);
    let host = common::lower_full(&b.build().unwrap());
    let l = launches(&host);
    assert_eq!(l.len(), 1, "{host}");
    let (_, inputs, args, depth) = &l[0];
    assert_eq!(*depth, 1, "inside the stream loop:\n{host}");
    assert_eq!(args, &[Expr::c(2), Expr::c(6)], "{host}");
    // `x` is read chunk by chunk, the bias whole.
    assert_ne!(inputs[0], "x");
    assert_eq!(
        host.tensors[host.tensor_by_name(&inputs[0]).unwrap()].shape,
        [2, 6]
    );
    assert_eq!(inputs[1], "b");
}

#[test]
fn outputs_of_one_custom_op_must_be_sharded_alike() {
    let (mut b, m) = common::builder("two_outputs", 2);
    let x = b.input("x", DType::F32, &[8, 6], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    let ty = TensorType::new(DType::F32, &[8, 6]);
    let outs = b.custom("pair", &[x], &[ty.clone(), ty], &[]).unwrap();
    b.schedule(outs[0]).outer_split(0, 2).parallelize(0, DIDx);
    b.replicate(outs[1]);
    b.output(outs[0]);
    b.output(outs[1]);
    let e = common::run(&b.build().unwrap(), common::all_passes()).expect_err("mismatch");
    assert!(
        e.to_string()
            .contains("every output of a `custom` op must be sharded like its first output"),
        "{e}"
    );
}
